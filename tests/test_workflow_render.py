"""A workflow task renders to the OpenAI chat body the workflow API sends; specs that cannot run
against real engines are named before they start."""

from __future__ import annotations

from typing import Any

import pytest

from planner.workflow import WorkflowError, load_workflow, render_task, runnable_problems

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def spec(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "m",
        "segments": {
            "sys": {"kind": "static", "content": "You are a researcher.", "tools": TOOLS},
            "ask": {"kind": "transient", "role": "user", "content": "Find sources."},
        },
        "tasks": [
            {"id": "plan", "messages": [{"segment": "sys"},
                                        {"role": "user", "content": "Plan the work."}]},
            {"id": "work", "after": ["plan"], "tools": "sys", "max_tokens": 64,
             "params": {"temperature": 0.2},
             "messages": [{"segment": "sys"}, {"output_of": "plan", "role": "user"},
                          {"segment": "ask"}]},
            {"id": "sum", "output_tokens": 12, "messages": [{"segment": "sys"},
                                                            {"output_of": "work"}]},
        ],
    }
    doc.update(changes)
    return doc


def test_a_root_task_renders_its_segments_and_literal_messages() -> None:
    body = render_task(load_workflow(spec()), "plan", {})
    assert body == {"model": "m", "messages": [
        {"role": "system", "content": "You are a researcher."},
        {"role": "user", "content": "Plan the work."}]}


def test_a_child_gets_its_parents_output_tools_max_tokens_and_params() -> None:
    body = render_task(load_workflow(spec()), "work", {"plan": "1. read 2. write"})
    assert body["messages"] == [{"role": "system", "content": "You are a researcher."},
                                {"role": "user", "content": "1. read 2. write"},
                                {"role": "user", "content": "Find sources."}]
    assert body["tools"] == TOOLS
    assert (body["max_tokens"], body["temperature"]) == (64, 0.2)


def test_an_output_of_defaults_to_an_assistant_message() -> None:
    body = render_task(load_workflow(spec()), "sum", {"plan": "p", "work": "found 3"})
    assert body["messages"][-1] == {"role": "assistant", "content": "found 3"}


def test_output_tokens_asks_for_exactly_that_many() -> None:
    body = render_task(load_workflow(spec()), "sum", {"work": "w"})
    assert (body["max_tokens"], body["ignore_eos"]) == (12, True)


def test_the_tenant_salts_the_cache() -> None:
    body = render_task(load_workflow(spec(tenant="acme")), "plan", {})
    assert body["cache_salt"] == "acme"


def test_a_missing_parent_output_is_named() -> None:
    with pytest.raises(WorkflowError, match="needs the output of 'plan'"):
        render_task(load_workflow(spec()), "work", {})


def test_a_runnable_spec_has_no_problems() -> None:
    assert runnable_problems(load_workflow(spec())) == []


def test_synthetic_token_segments_are_named() -> None:
    doc = spec()
    doc["segments"]["filler"] = {"kind": "shared", "tokens": 500}
    doc["segments"]["pad"] = {"kind": "shared", "tokens": 50}
    (problem,) = runnable_problems(load_workflow(doc))
    assert "segments 'filler', 'pad' have synthetic `tokens`" in problem


def test_a_tools_only_segment_used_as_a_message_is_named() -> None:
    doc = spec()
    doc["segments"]["toolbox"] = {"kind": "static", "tools": TOOLS}
    doc["tasks"][0]["messages"].append({"segment": "toolbox"})
    assert runnable_problems(load_workflow(doc)) == [
        "task 'plan' uses segment 'toolbox' as a message, but it has no content"]


@pytest.mark.parametrize("task_id", ["a,b", "has space", "a/b", "x" * 129])
def test_task_ids_unfit_for_headers_are_named(task_id: str) -> None:
    doc = spec()
    doc["tasks"][0]["id"] = task_id
    doc["tasks"][1]["after"] = [task_id]
    doc["tasks"][1]["messages"][1] = {"output_of": task_id, "role": "user"}
    (problem,) = runnable_problems(load_workflow(doc))
    assert problem.startswith(f"task id {task_id!r} may hold only")


def test_params_may_not_override_what_the_spec_decides() -> None:
    doc = spec()
    doc["tasks"][1]["params"] = {"stream": True, "model": "other", "top_p": 0.9}
    assert runnable_problems(load_workflow(doc)) == ["task 'work': params may not set model, "
                                                     "stream"]
