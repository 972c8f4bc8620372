"""Hint mode's parsing: headers, `extra_body={"kvgate": ...}`, Dynamo's `nvext.agent_hints`."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from planner.hints import MAX_EXPECT_CHILDREN, NO_HINTS, HintError, RequestHints, parse_hints

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_plain_call_has_no_hints_and_its_body_goes_unchanged() -> None:
    hints, forwarded = parse_hints(CIMultiDict(), dict(BODY))
    assert hints is NO_HINTS and not hints.in_workflow and forwarded is None


def test_headers_are_read_case_insensitively() -> None:
    headers = CIMultiDict({"X-KVGate-Workflow": "w1", "x-kvgate-task": "t3",
                           "X-KVGATE-AFTER": "t1, t2,,t1", "X-KVGate-Expect-Children": "4",
                           "X-Session-Id": "s"})
    hints, forwarded = parse_hints(headers, dict(BODY))
    assert hints == RequestHints(workflow="w1", task="t3", after=("t1", "t2"),
                                 expect_children=4, session="s")
    assert forwarded is None


def test_the_body_field_wins_over_headers_and_is_stripped() -> None:
    body = {**BODY, "user": "u", "kvgate": {"workflow": "w2", "after": ["a", "b"],
                                             "expect_children": 0, "priority": -3,
                                             "deadline_s": 2.5}}
    hints, forwarded = parse_hints(CIMultiDict({"X-KVGate-Workflow": "w1"}), body)
    assert hints == RequestHints(workflow="w2", after=("a", "b"), expect_children=0,
                                 priority=-3, deadline_s=2.5, session="u")
    assert forwarded == {**BODY, "user": "u"} and "kvgate" in body  # the caller's dict intact


def test_priority_and_deadline_headers_are_read_and_the_body_wins() -> None:
    headers = CIMultiDict({"X-KVGate-Priority": "-2", "X-KVGate-Deadline": "1.5"})
    hints, _ = parse_hints(headers, dict(BODY))
    assert (hints.priority, hints.deadline_s) == (-2, 1.5)
    body = {**BODY, "kvgate": {"priority": 4}}
    hints, _ = parse_hints(headers, body)
    assert (hints.priority, hints.deadline_s) == (4, 1.5)


def test_dynamo_agent_hints_are_read_and_nvext_forwarded() -> None:
    body = {**BODY, "nvext": {"agent_hints": {"priority": 5, "osl": 512,
                                              "latency_sensitivity": 1.2}}}
    hints, forwarded = parse_hints(CIMultiDict(), body)
    assert (hints.priority, hints.osl) == (5, 512)
    assert forwarded is None  # vLLM ignores fields it does not know
    explicit = {**body, "kvgate": {"priority": 1}}
    assert parse_hints(CIMultiDict(), explicit)[0].priority == 1
    assert parse_hints(CIMultiDict({"X-KVGate-Priority": "2"}), body)[0].priority == 2


@pytest.mark.parametrize(("headers", "body", "message"), [
    ({"X-KVGate-Workflow": " "}, {}, "header X-KVGate-Workflow must be a non-empty string"),
    ({"X-KVGate-Workflow": "w", "X-KVGate-Expect-Children": "x"}, {},
     "header X-KVGate-Expect-Children must be an integer"),
    ({"X-KVGate-Workflow": "w", "X-KVGate-Expect-Children": "-1"}, {},
     "must be an integer from 0 to 2147483647, got -1"),
    # Numbers the planner could not price.
    ({"X-KVGate-Workflow": "w", "X-KVGate-Expect-Children": "1" * 30}, {},
     "header X-KVGate-Expect-Children must be an integer from 0 to 2147483647"),
    ({}, {"kvgate": {"workflow": "w", "expect_children": 10**40}},
     "kvgate.expect_children must be an integer from 0 to 2147483647, got 10000000000000000000"
     "..."),
    ({"X-KVGate-Priority": "9" * 5000}, {}, "header X-KVGate-Priority must be an integer from"),
    ({}, {"kvgate": {"priority": -10**7}}, "kvgate.priority must be an integer from -1000000"),
    ({}, {"nvext": {"agent_hints": {"priority": 10**400}}}, "nvext.agent_hints.priority must"),
    ({}, {"nvext": {"agent_hints": {"osl": 10**400}}},
     "nvext.agent_hints.osl must be an integer from 0 to 2147483647"),
    ({"X-KVGate-Priority": "\u00b2"}, {}, "header X-KVGate-Priority must be an integer"),
    ({}, {"kvgate": "w"}, "body field `kvgate` must be an object"),
    ({}, {"kvgate": {"workflow": "w", "parents": []}}, "unknown keys: parents"),
    ({}, {"kvgate": {"workflow": "w", "after": 3}}, "kvgate.after must be a list"),
    ({}, {"kvgate": {"workflow": "w", "priority": 1.5}}, "kvgate.priority must be an integer"),
    ({}, {"kvgate": {"workflow": "w", "deadline_s": 0}}, "kvgate.deadline_s must be a positive"),
    ({"X-KVGate-Priority": "high"}, {}, "header X-KVGate-Priority must be an integer"),
    ({"X-KVGate-Deadline": "soon"}, {}, "header X-KVGate-Deadline must be a number of seconds"),
    ({"X-KVGate-Deadline": "-2"}, {}, "header X-KVGate-Deadline must be a positive number"),
    ({"X-KVGate-Deadline": "inf"}, {}, "header X-KVGate-Deadline must be a positive number"),
    ({}, {"kvgate": {"workflow": "w", "deadline_s": "3"}}, "kvgate.deadline_s must be a pos"),
    ({}, {"kvgate": {"workflow": "w" * 300}}, "longer than 256"),
    ({}, {"kvgate": {"task": "t"}}, "needs a workflow id"),
    # Kept with the task's record and each of its events for the workflow's lifetime.
    ({}, {"kvgate": {"workflow": "w", "after": [f"t{i}" for i in range(1001)]}},
     "kvgate.after names 1001 tasks; a call may name at most 1000"),
    ({}, {"nvext": {"agent_hints": []}}, "nvext.agent_hints must be an object"),
    ({}, {"nvext": {"agent_hints": {"osl": "long"}}}, "nvext.agent_hints.osl"),
    # An integer past any float, and header bytes that are no UTF-8 (aiohttp keeps them as
    # surrogates): both were 500s.
    ({}, {"kvgate": {"workflow": "w", "deadline_s": 10**400}},
     "kvgate.deadline_s must be a positive number of seconds, not 401 digits"),
    ({"X-KVGate-Workflow": "w\udcff"}, {}, "header X-KVGate-Workflow must be UTF-8 text"),
    ({"X-KVGate-Workflow": "w", "X-KVGate-After": "a,\udcfe"}, {},
     "header X-KVGate-After must be UTF-8 text"),
])
def test_bad_hints_name_the_problem(headers: dict[str, str], body: dict[str, Any],
                                    message: str) -> None:
    with pytest.raises(HintError, match=message.replace("(", r"\(").replace("`", "`")):
        parse_hints(CIMultiDict(headers), {**BODY, **body})


def test_a_task_naming_itself_in_after_keeps_the_others() -> None:
    # A cycle of one: an agent naming every turn's task the same means its earlier call.
    hints, _ = parse_hints(CIMultiDict({"X-KVGate-Workflow": "w", "X-KVGate-Task": "b",
                                        "X-KVGate-After": "a,b"}), {})
    assert hints.after == ("a",)


def test_more_children_than_the_planner_prepares_for_count_as_that_many() -> None:
    # A fan-out of 10^12 once looped the event loop in prefetch planning.
    for headers, body in (({"X-KVGate-Expect-Children": "1000000000"}, BODY),
                          ({}, {**BODY, "kvgate": {"expect_children": 5000}})):
        hints, _ = parse_hints(CIMultiDict({"X-KVGate-Workflow": "w", **headers}),
                               dict(body))
        assert hints.expect_children == MAX_EXPECT_CHILDREN == 1000
