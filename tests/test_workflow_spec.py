"""Workflow specs validate with errors that name the problem (issue 4's spec, first slice)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.workflow import OutputOf, WorkflowError, load_workflow, task_specs


def fanout(workers: int = 3) -> dict[str, Any]:
    return {
        "model": "m",
        "segments": {
            "sys": {"kind": "static", "content": "You are a researcher.",
                    "tools": [{"type": "function", "function": {"name": "search"}}]},
            "notes": {"kind": "transient", "role": "user", "tokens": 200},
        },
        "tasks": [
            {"id": "plan", "messages": [{"segment": "sys"},
                                        {"role": "user", "content": "Plan the work."}]},
            *({"id": f"w{i}", "after": ["plan"], "tools": "sys", "think_time_s": 0.5,
               "messages": [{"segment": "sys"}, {"output_of": "plan", "role": "user"},
                            {"segment": "notes"}]} for i in range(workers)),
            {"id": "reduce", "messages": [{"segment": "sys"}, *({"output_of": f"w{i}"}
                                                                  for i in range(workers))]},
        ],
    }


def test_a_fanout_workflow_validates_and_orders_its_tasks() -> None:
    wf = load_workflow(fanout())
    order = wf.topological_order()
    assert order[0] == "plan" and order[-1] == "reduce"
    assert set(wf.graph().predecessors("reduce")) == {"w0", "w1", "w2"}
    assert isinstance(wf.task("w1").messages[1], OutputOf)


def test_tasks_name_the_static_segment_they_open_with() -> None:
    """Replication demand announced ahead: equal static content, equal name; a tenant's
    names are its own; a task that opens with no static message names none."""
    doc = fanout()
    doc["tasks"].append({"id": "free", "messages": [{"role": "user", "content": "Hi."}]})
    specs = {t.task: t for t in task_specs(load_workflow(doc))}
    assert specs["plan"].static_segment and specs["free"].static_segment == ""
    assert specs["w0"].static_segment == specs["w1"].static_segment  # the same tools, too
    assert specs["plan"].static_segment != specs["w0"].static_segment  # w* offer tools
    assert specs["reduce"].static_segment == specs["plan"].static_segment
    other = {t.task: t for t in task_specs(load_workflow(doc), "tenant-b")}
    assert other["plan"].static_segment != specs["plan"].static_segment


def test_a_cycle_is_named_with_its_path() -> None:
    spec = {"model": "m", "tasks": [
        {"id": "a", "after": ["c"], "messages": [{"role": "user", "content": "x"}]},
        {"id": "b", "after": ["a"], "messages": [{"role": "user", "content": "x"}]},
        {"id": "c", "messages": [{"output_of": "b"}]},
    ]}
    with pytest.raises(WorkflowError, match=r"cycle: .*a.*->.*b.*->.*c"):
        load_workflow(spec)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda s: s["tasks"][1].update(after=["nope"]), "runs after unknown task 'nope'"),
    (lambda s: s["tasks"][-1]["messages"].append({"output_of": "ghost"}),
     "output of unknown task 'ghost'"),
    (lambda s: s["tasks"][0]["messages"].append({"segment": "missing"}),
     "unknown segment 'missing'"),
    (lambda s: s["tasks"][1].update(tools="notes"), "which defines none"),
    (lambda s: s["tasks"].append(dict(s["tasks"][0])), "duplicate task ids: plan"),
    (lambda s: s.update(tasks=[]), "no tasks"),
    (lambda s: s["segments"].update(empty={"kind": "static"}), "needs content, tools or tokens"),
    (lambda s: s["segments"]["sys"].update(kind="forever"), "segments.sys.kind"),
    (lambda s: s.pop("model"), "model"),
    (lambda s: s["tasks"][0].update(messages=[{"bogus": 1}]), "tasks.0.messages.0"),
])
def test_invalid_specs_get_errors_naming_the_problem(mutate: Any, message: str) -> None:
    spec = fanout()
    mutate(spec)
    with pytest.raises(WorkflowError) as info:
        load_workflow(spec, "spec.json")
    assert message in str(info.value)
    assert str(info.value).startswith("spec.json:")


def test_a_non_object_document_is_rejected() -> None:
    with pytest.raises(WorkflowError, match="JSON object"):
        load_workflow([1, 2])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 11), max_size=3), min_size=1, max_size=12))
def test_any_dependency_list_is_accepted_iff_it_is_acyclic(deps: list[list[int]]) -> None:
    import networkx as nx

    n = len(deps)
    spec = {"model": "m", "tasks": [
        {"id": f"t{i}", "after": [f"t{j}" for j in d if j < n],
         "messages": [{"role": "user", "content": "x"}]} for i, d in enumerate(deps)]}
    g = nx.DiGraph()
    g.add_nodes_from(f"t{i}" for i in range(n))
    g.add_edges_from((f"t{j}", f"t{i}") for i, d in enumerate(deps) for j in d if j < n)
    if nx.is_directed_acyclic_graph(g):
        order = load_workflow(spec).topological_order()
        position = {t: k for k, t in enumerate(order)}
        assert all(position[u] < position[v] for u, v in g.edges)
    else:
        with pytest.raises(WorkflowError, match="cycle"):
            load_workflow(spec)
