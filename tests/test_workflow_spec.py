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
    (lambda s: s["tasks"][0].update(params={"temperature": float("nan")}), "must be finite"),
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


def test_a_cycle_is_found_in_one_pass_over_the_graph() -> None:
    """A chain listed in reverse was walked again from every task (networkx's find_cycle):
    6 s for 1,000 tasks, the gateway's event loop held meanwhile."""
    import networkx as nx

    from planner.workflow import a_cycle

    class Counted(nx.DiGraph):  # type: ignore[type-arg]
        visits = 0

        def successors(self, n: Any) -> Any:
            Counted.visits += 1
            return super().successors(n)

    chain = Counted()
    nx.add_path(chain, [str(i) for i in range(2000, 0, -1)])
    assert a_cycle(chain) is None
    assert Counted.visits == chain.number_of_nodes()  # each node's edges once
    chain.add_edge("1", "1500")
    cycle = a_cycle(chain)
    assert cycle is not None and cycle[0] == "1500" and cycle[-1] == "1" and len(cycle) == 1500
    spec = {"model": "m", "tasks": [
        {"id": f"t{i}", "after": [f"t{i + 1}"] if i < 999 else [],
         "messages": [{"role": "user", "content": "x"}]} for i in range(1000)]}
    assert len(load_workflow(spec).tasks) == 1000


def test_a_call_its_parents_outputs_would_make_too_large_is_refused_before_it_is_built(
) -> None:
    from planner.workflow import render_task

    spec = load_workflow({"model": "m", "tasks": [
        {"id": "p", "messages": [{"role": "user", "content": "x"}]},
        {"id": "c", "messages": [{"output_of": "p"}] * 200}]})
    outputs = {"p": "y" * 50_000}
    with pytest.raises(WorkflowError, match="10000000 bytes; the gateway takes calls of at "
                                            "most 4194304"):
        render_task(spec, "c", outputs, limit=4 * 1024 * 1024)
    assert len(render_task(spec, "c", {"p": "short"}, limit=4 * 1024 * 1024)["messages"]) == 200


def test_a_tasks_own_length_wins_over_its_params_and_the_planner_prices_it() -> None:
    from planner.workflow import render_task

    # `max_tokens` beside `output_tokens` overrode it in the call (60 tokens came back) while
    # the planner priced 10; a length in `params` overrode both. Specs stored by an earlier
    # replica keep running on a newer one, so neither is refused: the smaller length wins.
    spec = load_workflow({"model": "m", "tasks": [
        {"id": "a", "output_tokens": 10, "max_tokens": 60, "params": {"max_tokens": 99},
         "messages": [{"role": "user", "content": "x"}]},
        {"id": "b", "params": {"max_tokens": 7, "temperature": 0.5},
         "messages": [{"role": "user", "content": "x"}]}]})
    a = render_task(spec, "a", {})
    assert a["max_tokens"] == 10 and a["ignore_eos"] is True
    assert {t.task: t.output_tokens for t in task_specs(spec)}["a"] == 10
    b = render_task(spec, "b", {})
    assert b["max_tokens"] == 7 and b["temperature"] == 0.5 and "ignore_eos" not in b
