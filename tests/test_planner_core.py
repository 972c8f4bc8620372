"""The Planner's contract: admission, release, events, the ledger, and its state machine."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvindex.index import EngineMatch
from planner.actions import Dispatch, Reject, Warm
from planner.core import TRANSITIONS, Call, Planner, RequestState, make_planner, planner_settings
from planner.dag import IllegalTransition
from planner.events import (
    Cancelled,
    EngineHealth,
    EngineJoined,
    EngineLeft,
    EngineScraped,
    Finished,
    FirstToken,
    TaskSpec,
    WorkflowOver,
    WorkflowSubmitted,
)
from planner.hints import RequestHints
from planner.policy import EngineView, PolicyContext, RouteRequest, make_policy
from planner.profiles import get_profile


def planner(policy: str = "least-loaded", engines: tuple[str, ...] = ("a", "b"),
            speculative_ttl_s: float = 0.0) -> Planner:
    p = Planner(make_policy(policy, PolicyContext()), speculative_ttl_s=speculative_ttl_s,
                engine_block_size=lambda _: 16)
    for e in engines:
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    return p


def call(rid: str, model: str = "m", prompt_tokens: int = 64, keys: int = 4,
         matches: dict[str, EngineMatch] | None = None) -> Call:
    return Call(RouteRequest(rid, model, prompt_tokens=prompt_tokens,
                             block_keys=tuple(range(keys)), matches=matches or {}))


def test_admitted_requests_are_dispatched_in_order_and_counted() -> None:
    p = planner()
    p.admit(call("r1"), 0.0)
    p.admit(call("r2"), 0.0)
    actions = p.release(0.0)
    assert [(a.request_id, a.engine) for a in actions if isinstance(a, Dispatch)] == [
        ("r1", "a"), ("r2", "b")]
    views = {v.name: v for v in p.views()}
    assert views["a"].in_flight == 1 and views["a"].prefilling == 1
    assert views["a"].queued_prefill_tokens == 64
    p.on_event(FirstToken("r1"), 1.0)
    assert p.state("r1") is RequestState.PREFILLED
    assert {v.name: v.prefilling for v in p.views()}["a"] == 0
    p.on_event(Finished("r1", 10), 2.0)
    assert not p.knows("r1")
    assert {v.name: v.in_flight for v in p.views()} == {"a": 0, "b": 1}


def test_dispatch_carries_cached_tokens_cost_and_speculative_keys() -> None:
    p = planner("kvgate", speculative_ttl_s=5.0)
    p.admit(call("r", prompt_tokens=8192, keys=512,
                 matches={"b": EngineMatch("b", 500, 500, 500.0)}), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch)
    assert d.engine == "b" and d.cached_tokens == 8000
    assert d.cost is not None and d.cost.engine == "b" and d.cost.cached_tokens == 8000
    assert d.speculative_keys == tuple(range(512)) and d.speculative_ttl_s == 5.0


def test_baselines_get_no_speculative_entries() -> None:
    p = planner("round-robin", speculative_ttl_s=5.0)
    p.admit(call("r"), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.speculative_keys == () and d.cost is None


def test_unknown_and_unserved_models_are_rejected_with_the_reason() -> None:
    p = planner()
    p.admit(call("r", model="nope"), 0.0)
    (r,) = p.release(0.0)
    assert isinstance(r, Reject) and not r.model_known and r.available_models == ("m",)
    p.on_event(EngineHealth("a", False), 1.0)
    p.on_event(EngineHealth("b", False), 1.0)
    p.admit(call("s"), 1.0)
    (r,) = p.release(1.0)
    assert isinstance(r, Reject) and r.model_known and "no engine is healthy" in r.reason
    assert not p.knows("s")


def test_excluded_engines_are_not_offered() -> None:
    p = planner()
    p.admit(Call(call("r").route, exclude=frozenset({"a"})), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.engine == "b"


def test_held_requests_wait_for_a_load_change_and_keep_their_order() -> None:
    p = planner("dynamo-like", engines=("a",))
    big = 1_000_000  # far above the router queue's threshold
    p.admit(call("big", prompt_tokens=big), 0.0)
    assert [a.request_id for a in p.release(0.0)] == ["big"]
    p.admit(call("h1"), 0.1)
    p.admit(call("h2"), 0.2)
    assert p.release(0.2) == []
    assert p.held == 2 and p.state("h1") is RequestState.HELD
    assert not p.pending  # nothing changed: no point offering them again
    p.on_event(Cancelled("h2"), 0.3)
    assert p.held == 1 and not p.knows("h2")
    p.on_event(FirstToken("big"), 1.0)  # the prefill queue drains
    assert p.pending
    assert [a.request_id for a in p.release(1.0)] == ["h1"]


def test_cancel_after_dispatch_is_an_illegal_transition() -> None:
    p = planner()
    p.admit(call("r"), 0.0)
    p.release(0.0)
    with pytest.raises(IllegalTransition, match="report its end with Finished"):
        p.on_event(Cancelled("r"), 1.0)


def test_a_scrape_sent_before_the_gateways_own_requests_finished_shows_no_foreign_load() -> None:
    # A live scrape takes a round trip: the engine may count a request of the gateway's as
    # running that the gateway has seen finish by the time the figures arrive. That request
    # is not another client's: the engine must not look busier than it is.
    p = planner(engines=("a",))
    p.admit(call("r1"), 0.0)
    p.admit(call("r2"), 0.0)
    p.release(0.0)
    before = p.finished_at("a")
    assert before == 0 and p.finished_at("nowhere") is None
    p.on_event(Finished("r1", 4), 0.5)  # while the scrape is on its way
    assert p.finished_at("a") == 1
    p.on_event(EngineScraped("a", 2, 0, 0.1, finished_before=before), 0.6)
    assert p.views()[0].foreign == 0
    # Figures of the instant (no finished_before), or a request the gateway never sent, do
    # count.
    p.on_event(EngineScraped("a", 2, 0, 0.1), 0.7)
    assert p.views()[0].foreign == 1
    p.on_event(EngineScraped("a", 3, 0, 0.1, finished_before=before), 0.8)
    assert p.views()[0].foreign == 1


def test_duplicate_request_ids_are_refused() -> None:
    p = planner()
    p.admit(call("r"), 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        p.admit(call("r"), 0.0)


def test_engine_events_shape_the_views() -> None:
    p = planner(engines=("a",))
    p.on_event(EngineScraped("a", 3, 2, 0.5), 1.0)
    (v,) = p.views()
    assert (v.num_running, v.num_waiting, v.kv_usage, v.block_size) == (3, 2, 0.5, 16)
    p.admit(call("r"), 1.0)
    p.release(1.0)
    p.on_event(EngineLeft("a"), 2.0)
    assert p.views() == []
    with pytest.raises(ValueError, match="already in the pool"):
        p.on_event(EngineJoined("x"), 2.0)
        p.on_event(EngineJoined("x"), 2.0)
    # The request that ran on the engine that left still ends cleanly.
    p.on_event(Finished("r"), 3.0)
    assert not p.knows("r")


def test_transition_table_is_closed_and_terminal_states_are_final() -> None:
    for state, targets in TRANSITIONS.items():
        assert targets <= set(RequestState)
        if state in (RequestState.FINISHED, RequestState.REJECTED, RequestState.CANCELLED):
            assert not targets


# -- batch release (SBS) and DAG priorities ----------------------------------------------------


PROFILE = get_profile("h100-llama3-8b")
BUDGET = PROFILE.max_num_batched_tokens


def batch_planner(variant: str = "kvgate", engines: tuple[str, ...] = ("a", "b")) -> Planner:
    p = make_planner(variant, PolicyContext(default_profile=PROFILE))
    for e in engines:
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    return p


def long_call(rid: str, workflow: str | None = None, task: str | None = None) -> Call:
    """A prompt of one full prefill step: two of them back an engine up."""
    return Call(RouteRequest(rid, "m", prompt_tokens=BUDGET, max_tokens=16),
                hints=RequestHints(workflow=workflow, task=task))


def test_variants_are_put_together_as_named() -> None:
    assert planner_settings("kvgate").release == "batch"
    assert planner_settings("kvgate").priorities
    assert planner_settings("kvgate-no-batch").release == "immediate"
    assert not planner_settings("kvgate-no-priority").priorities
    assert planner_settings("dynamo-like").release == "immediate"
    assert batch_planner("kvgate-routing-only").release_mode == "immediate"


def test_batch_release_is_work_conserving_then_buffers_when_every_engine_is_backed_up() -> None:
    p = batch_planner()
    for i in range(4):
        p.admit(long_call(f"r{i}"), 0.0)
    sent = p.release(0.0)
    assert len(sent) == 4  # two steps' worth on each engine: both have been open until now
    assert p.next_wakeup() is None
    p.admit(long_call("r4"), 0.1)
    assert p.release(0.1) == []
    assert p.buffered == 1 and p.state("r4") is RequestState.QUEUED
    wake = p.next_wakeup()
    assert wake is not None and wake > 0.1
    # Nothing changed by the interval: still backed up, still buffered, next interval set.
    assert p.release(wake) == [] and p.buffered == 1
    p.on_event(FirstToken("r0"), 0.5)  # one engine's queue drains a step
    (d,) = p.release(0.5)
    assert isinstance(d, Dispatch) and d.request_id == "r4"
    assert p.buffered == 0 and p.next_wakeup() is None


def test_a_call_that_does_not_stream_frees_its_engines_prefill_budget_by_its_estimate(
) -> None:
    # Its first token is seen only with its whole answer: counted as prefilling until then,
    # a non-streamed call held its engine's prefill budget for its whole decode, and calls
    # waited behind it in the buffer for as long.
    p = batch_planner(engines=("a",))
    for i in range(2):
        p.admit(Call(replace(long_call(f"r{i}").route, streams=False)), 0.0)
    sent = p.release(0.0)
    assert [d.request_id for d in sent if isinstance(d, Dispatch)] == ["r0", "r1"]
    p.admit(long_call("r2"), 0.1)
    assert p.release(0.1) == [] and p.buffered == 1
    cost = [d.cost for d in sent if isinstance(d, Dispatch)]
    assert all(c is not None for c in cost)
    due = min(c.queue_s + c.prefill_s for c in cost if c is not None)
    wake = p.next_wakeup()
    assert wake is not None and wake <= due  # a batch interval, or the estimate itself
    t = due + 1e-6
    released = [a.request_id for a in p.release(t) if isinstance(a, Dispatch)]
    assert p.state("r0") is RequestState.PREFILLED and released == ["r2"]
    # Its first token, reported with its answer, counts nothing twice.
    queued = p.views()[0].queued_prefill_tokens
    p.on_event(FirstToken("r0", observed=False), t + 5)
    assert p.views()[0].queued_prefill_tokens == queued
    # A streamed call waits for its first token as before.
    assert p.state("r2") is RequestState.DISPATCHED
    p.release(t + 100)
    assert p.state("r2") is RequestState.DISPATCHED


def test_a_call_its_engine_cannot_take_goes_to_a_stand_in_that_holds_as_much_of_it() -> None:
    p = batch_planner()
    choose = p.policy.choose

    def prefer_a(route: RouteRequest, engines: Any, now: float) -> Any:
        return choose(route, [v for v in engines if v.name == "a"] or engines, now)

    p.policy.choose = prefer_a  # type: ignore[method-assign]
    for i in range(2):
        p.admit(long_call(f"f{i}"), 0.0)
    assert {d.engine for d in p.release(0.0) if isinstance(d, Dispatch)} == {"a"}
    # Three steps of prompt, two and a half cached on a alone: a is backed up, and b would
    # compute what a holds, so the call waits for a.
    blocks = BUDGET * 5 // 2 // 16
    p.admit(Call(RouteRequest("held", "m", prompt_tokens=3 * BUDGET, max_tokens=16,
                              matches={"a": EngineMatch("a", blocks, blocks, float(blocks))})),
            0.1)
    assert p.release(0.1) == [] and p.buffered == 1
    # A prompt no engine holds goes to b, which has room, instead of waiting for a.
    p.admit(long_call("new"), 0.2)
    (d,) = p.release(0.2)
    assert isinstance(d, Dispatch) and (d.request_id, d.engine) == ("new", "b")
    assert p.buffered == 1 and p.state("held") is RequestState.QUEUED
    p.on_event(FirstToken("f0"), 0.5)
    p.on_event(FirstToken("f1"), 0.6)
    (d2,) = p.release(0.6)
    assert isinstance(d2, Dispatch) and (d2.request_id, d2.engine) == ("held", "a")


def test_buffer_releases_the_workflow_closest_to_done_first() -> None:
    p = batch_planner(engines=("a",))
    short = (TaskSpec("t", (), 1000, 16),)
    long = (TaskSpec("t", (), 1000, 16), TaskSpec("u", ("t",), 1000, 2000))
    p.on_event(WorkflowSubmitted("long", long), 0.0)
    p.on_event(WorkflowSubmitted("short", short), 0.0)
    p.admit(long_call("fill0"), 0.0)
    p.admit(long_call("fill1"), 0.0)
    p.release(0.0)
    p.admit(long_call("l", "long", "t"), 0.1)
    p.admit(long_call("s", "short", "t"), 0.2)
    assert p.release(0.2) == [] and p.buffered == 2
    p.on_event(FirstToken("fill0"), 1.0)
    (d,) = p.release(1.0)
    assert isinstance(d, Dispatch) and d.request_id == "s"  # arrived later, finishes sooner
    assert d.priority is not None
    p.on_event(FirstToken("fill1"), 2.0)
    (d2,) = p.release(2.0)
    assert isinstance(d2, Dispatch) and d2.request_id == "l" and d2.priority is not None
    assert d.priority < d2.priority  # the engine's own queue keeps the same order
    p.on_event(WorkflowOver("short"), 3.0)


def test_a_long_workflow_waiting_behind_shorter_ones_is_not_starved() -> None:
    # Every engine backed up, one slot freed a second, and a new short workflow every second:
    # by rank alone the long workflow's call lost every release for as long as they came.
    p = batch_planner(engines=("a",))
    long = (TaskSpec("t", (), 1000, 16), TaskSpec("u", ("t",), 1000, 2000))
    p.on_event(WorkflowSubmitted("long", long), 0.0)
    assert p.priorities is not None
    path_s = p.priorities.rank(RequestHints(workflow="long", task="t"))[1]
    p.admit(long_call("fill0"), 0.0)
    p.admit(long_call("fill1"), 0.0)
    p.release(0.0)
    p.admit(long_call("l", "long", "t"), 0.0)
    in_flight = ["fill0", "fill1"]
    went = None
    for second in range(1, 200):
        now = float(second)
        p.on_event(WorkflowSubmitted(f"s{second}", (TaskSpec("t", (), 1000, 16),)), now)
        p.admit(long_call(f"s{second}", f"s{second}", "t"), now)
        p.on_event(FirstToken(in_flight.pop(0)), now)
        (d,) = [a for a in p.release(now) if isinstance(a, Dispatch)]
        in_flight.append(d.request_id)
        if d.request_id == "l":
            went = now
            break
    # It waited about as long as its path is longer than theirs, then went ahead.
    assert went is not None and path_s - 2 < went < path_s + 2, (went, path_s)


def test_an_explicit_priority_decides_before_any_rank_at_the_engine() -> None:
    from planner.priorities import MAX_RANK_S, WorkflowPriorities

    pr = WorkflowPriorities(PROFILE)
    pr.submit("far", (TaskSpec("t", (), 100, 10_000_000),))  # a path of days
    far = pr.engine_priority(RequestHints(workflow="far", task="t"))
    assert far > pr.engine_priority(RequestHints(workflow="w"))
    # One explicit step outranks it; none overflows vLLM's 64-bit integer.
    assert pr.engine_priority(RequestHints(workflow="w", priority=1)) > far
    assert pr.engine_priority(RequestHints(workflow="far", task="t", priority=-1)) < 0
    assert pr.engine_priority(RequestHints(workflow="w", priority=1_000_000),
                              ) < 2**63
    assert pr.engine_priority(RequestHints(priority=-1_000_000),
                              waited_s=2 * MAX_RANK_S) >= -(2**63)


def test_a_failed_attempt_leaves_its_task_on_the_critical_path() -> None:
    p = batch_planner(engines=("a",))
    p.on_event(WorkflowSubmitted("w", (TaskSpec("t", (), 1000, 16),
                                       TaskSpec("u", ("t",), 1000, 2000))), 0.0)
    assert p.priorities is not None
    before = p.priorities.rank(RequestHints(workflow="w", task="t"))
    p.admit(long_call("t1", "w", "t"), 0.0)
    p.release(0.0)
    p.on_event(Finished("t1", 3, error="engine a failed before answering"), 0.5)
    # The retry ranks as the task did: nothing of the workflow's path is done.
    assert p.priorities.rank(RequestHints(workflow="w", task="t")) == before
    p.admit(long_call("t2", "w", "t"), 0.6)
    p.release(0.6)
    p.on_event(Finished("t2", 16), 1.0)
    assert p.priorities.rank(RequestHints(workflow="w", task="u"))[1] < before[1]


def test_an_engine_that_leaves_takes_its_workflow_homes_with_it() -> None:
    p = batch_planner()
    p.admit(long_call("w1", "w", "t"), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch)
    assert {v.name: v.homed_workflows for v in p.views()}[d.engine] == 1
    p.on_event(EngineLeft(d.engine), 0.1)
    p.on_event(EngineJoined(d.engine, healthy=True, models=frozenset({"m"})), 0.2)
    assert {v.name: v.homed_workflows for v in p.views()}[d.engine] == 0
    p.on_event(Finished("w1", 16, error="engine left"), 0.3)
    # The workflow's next call is a root again: nothing of it is where it was sent.
    p.admit(long_call("w2", "w", "u"), 0.4)
    (d2,) = p.release(0.4)
    assert isinstance(d2, Dispatch)
    assert sum(v.homed_workflows for v in p.views()) == 1


def test_priorities_follow_the_critical_path_as_tasks_finish() -> None:
    from planner.priorities import WorkflowPriorities

    pr = WorkflowPriorities(PROFILE)
    pr.submit("w", (TaskSpec("a", (), 100, 500), TaskSpec("b", ("a",), 100, 500),
                    TaskSpec("c", ("a",), 100, 10)))
    before = pr.rank(RequestHints(workflow="w", task="b"))
    # Within the workflow, the task with more below it (b) goes before c.
    assert before < pr.rank(RequestHints(workflow="w", task="c"))
    pr.task_done("w", "a", 500)
    after = pr.rank(RequestHints(workflow="w", task="b"))
    assert after[1] < before[1]  # less remains
    # Unknown DAG: least attained service; explicit priority first.
    pr.task_done("h", "x", 300)
    assert pr.rank(RequestHints(workflow="h2")) < pr.rank(RequestHints(workflow="h"))
    assert pr.rank(RequestHints(workflow="h", priority=-1)) < pr.rank(RequestHints(workflow="h2"))


def test_hint_mode_service_is_remembered_for_the_most_recently_served_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.priorities as priorities

    monkeypatch.setattr(priorities, "MAX_HINTED", 3)
    pr = priorities.WorkflowPriorities(PROFILE)
    for wf in ("w1", "w2", "w3"):
        pr.task_done(wf, "t", 100)
    pr.task_done("w1", "t", 100)  # served again: the most recent now
    pr.task_done("w4", "t", 100)  # past the cap: w2, the least recently served, goes
    token_s = PROFILE.decode_step_time(1, 0)  # service as seconds of one sequence's decode
    assert {wf: pr.rank(RequestHints(workflow=wf))[1] for wf in ("w1", "w2", "w3", "w4")} == {
        "w1": 200 * token_s, "w2": 0.0, "w3": 100 * token_s, "w4": 100 * token_s}


def test_hint_mode_and_submitted_workflows_rank_on_one_scale_and_a_deadline_caps_a_rank(
) -> None:
    """Attained service counts as seconds of decode, as a DAG's remaining path counts
    seconds: an agent served 300 tokens (about 2 s) goes before a DAG with 3 s left, in the
    gateway's buffer and in the engine's queue alike (it compared 300 with 3.3 and waited
    behind every DAG, while engines ran it first)."""
    from planner.priorities import WorkflowPriorities

    pr = WorkflowPriorities(PROFILE)
    pr.task_done("agent", "t1", 300)
    token_s = PROFILE.decode_step_time(1, 0)
    tasks = round(3.0 / token_s)  # a DAG of one task decoding about 3 s alone
    pr.submit("dag", (TaskSpec("a", (), 0, tasks),))
    agent, dag = RequestHints(workflow="agent", task="t2"), RequestHints(workflow="dag",
                                                                         task="a")
    assert pr.rank(agent) < pr.rank(dag)
    assert pr.engine_priority(agent) < pr.engine_priority(dag)
    # A deadline ranks the call as a workflow with that long left, no longer.
    tight = RequestHints(workflow="dag", task="a", deadline_s=0.5)
    assert pr.rank(tight) < pr.rank(agent) and pr.engine_priority(tight) == 500
    assert pr.rank(RequestHints(workflow="dag", task="a", deadline_s=60.0)) == pr.rank(dag)


def test_a_hint_mode_workflow_remembers_its_latest_calls_only() -> None:
    # Each remembered call holds its prompt's keys; a hint-mode session never ends.
    from planner.core import LINEAGE_HINT_TASKS

    p = planner()
    n = LINEAGE_HINT_TASKS + 40
    for i in range(n):
        keys = tuple(range(i + 2))  # each call extends the one before
        p.admit(Call(RouteRequest(f"r{i}", "m", prompt_tokens=16 * len(keys), block_keys=keys),
                     hints=RequestHints(workflow="h", task=f"t{i}",
                                        after=(f"t{i - 1}",) if i else ())), 0.0)
        p.release(0.0)
        p.on_event(Finished(f"r{i}", 1), 0.0)
    # The latest calls, parents of what comes next, are kept; the first are forgotten.
    kept = p._lineage["h"]
    assert len(kept) == LINEAGE_HINT_TASKS
    assert f"t{n - 1}" in kept and "t0" not in kept
    # A parent every call names (an orchestrator's plan) is never the one forgotten.
    p.admit(Call(RouteRequest("plan", "m", prompt_tokens=32, block_keys=(7, 8)),
                 hints=RequestHints(workflow="o", task="plan")), 0.0)
    for i in range(n):
        p.admit(Call(RouteRequest(f"c{i}", "m", prompt_tokens=48, block_keys=(7, 8, i)),
                     hints=RequestHints(workflow="o", task=f"c{i}", after=("plan",))), 0.0)
    assert "plan" in p._lineage["o"] and len(p._lineage["o"]) == LINEAGE_HINT_TASKS
    # A workflow submitted whole keeps every task (its spec bounds them).
    p.on_event(WorkflowSubmitted("api", tuple(TaskSpec(f"t{i}", (), 10, 10)
                                             for i in range(n))), 0.0)
    for i in range(n):
        p.admit(Call(RouteRequest(f"a{i}", "m", prompt_tokens=32, block_keys=(i, i + 1)),
                     hints=RequestHints(workflow="api", task=f"t{i}")), 0.0)
    assert len(p._lineage["api"]) == n


def test_cancel_removes_a_buffered_call() -> None:
    p = batch_planner(engines=("a",))
    for i in range(2):
        p.admit(long_call(f"f{i}"), 0.0)
    p.release(0.0)
    p.admit(long_call("x"), 0.1)
    p.release(0.1)
    assert p.buffered == 1
    p.on_event(Cancelled("x"), 0.2)
    assert p.buffered == 0 and not p.knows("x")
    p.on_event(FirstToken("f0"), 0.3)
    assert p.release(0.3) == []


def test_siblings_in_flight_reach_the_cost_model_and_leave_with_their_calls() -> None:
    p = batch_planner()
    seen: list[RouteRequest] = []
    choose = p.policy.choose

    def spy(route: RouteRequest, engines: Any, now: float) -> Any:
        seen.append(route)
        return choose(route, engines, now)

    p.policy.choose = spy  # type: ignore[method-assign]
    p.admit(Call(RouteRequest("a", "m", prompt_tokens=500, max_tokens=64),
                 hints=RequestHints(workflow="w", task="a")), 0.0)
    (first,) = p.release(0.0)
    assert isinstance(first, Dispatch) and first.cost is not None
    p.admit(Call(RouteRequest("b", "m", prompt_tokens=500, max_tokens=64),
                 hints=RequestHints(workflow="w", task="b")), 0.5)
    p.release(0.5)
    assert seen[0].group_finish_s == 0.0 and not seen[0].group_at
    assert seen[1].group_at == {first.engine: 1}
    assert seen[1].group_finish_s == pytest.approx(first.cost.total_s - 0.5)
    p.on_event(Finished("a"), 1.0)
    p.on_event(Finished("b"), 1.0)
    p.admit(Call(RouteRequest("c", "m", prompt_tokens=500, max_tokens=64),
                 hints=RequestHints(workflow="w", task="c")), 2.0)
    p.release(2.0)
    assert seen[2].group_finish_s == 0.0 and not seen[2].group_at


def test_a_sibling_that_would_finish_last_elsewhere_stays_with_the_cached_context() -> None:
    from kvindex.index import EngineMatch
    from planner.cost import CostModel, CostSettings

    profile = get_profile("h100x4-llama3-70b")
    # Without the opportunity term, which would keep it there on its own at this load.
    model = CostModel({}, profile, CostSettings(opportunity=0.0))
    holder = EngineView("a", True, frozenset({"m"}), in_flight=6, active_blocks=6 * 2250)
    idle = EngineView("b", True, frozenset({"m"}))
    prompt = 36_000
    matches = {"a": EngineMatch("a", 2249, 2249, 2249.0)}
    alone = RouteRequest("r", "m", prompt_tokens=prompt, block_keys=tuple(range(2250)),
                         matches=matches, max_tokens=256)
    with_siblings = RouteRequest("r", "m", prompt_tokens=prompt, block_keys=tuple(range(2250)),
                                 matches=matches, max_tokens=256, group_finish_s=6.0,
                                 group_at={"a": 6})
    # Alone, recomputing 36k tokens on the idle engine looks cheapest; with six siblings
    # decoding on the holder, the join waits for the slowest, so the request stays.
    assert model.best(alone, [holder, idle]).engine == "b"
    assert model.best(with_siblings, [holder, idle]).engine == "a"


def test_with_siblings_a_calls_own_finish_counts_more_the_idler_the_pool() -> None:
    """The later of its own and its group's finish alone is indifferent to where a call goes
    while the group's finish dominates; its own completion also counts, weighted by
    `own_weight` over one plus the pool's mean load (low load: fan-outs spread)."""
    from planner.cost import CostModel, CostSettings

    model = CostModel({}, get_profile("h100-llama3-8b"), CostSettings())
    siblings = RouteRequest("r", "m", prompt_tokens=2000, max_tokens=128, group_finish_s=30.0,
                            group_at={"a": 1})
    alone = replace(siblings, group_finish_s=0.0, group_at={})

    def views(load: int) -> list[EngineView]:
        return [EngineView(n, True, frozenset({"m"}), in_flight=load) for n in ("a", "b")]

    idle = {c.engine: c for c in model.estimate(siblings, views(1))}
    busy = {c.engine: c for c in model.estimate(siblings, views(7))}
    assert all(c.own_s == 0.0 for c in model.estimate(alone, views(1)))
    for costs, load in ((idle, 1), (busy, 7)):
        c = costs["b"]
        assert c.own_s == pytest.approx(2.0 / (1 + load) * c.total_s)
        assert c.score == pytest.approx(max(c.total_s, c.group_s) + c.external_s + c.own_s)
    assert idle["b"].own_s / idle["b"].total_s > busy["b"].own_s / busy["b"].total_s


def test_views_count_a_workflows_calls_at_an_engine_once() -> None:
    p = batch_planner(engines=("a",))
    for rid, wf in (("x1", "w"), ("x2", "w"), ("y", "v"), ("z", None)):
        hints = RequestHints(workflow=wf, task=rid) if wf else RequestHints()
        p.admit(Call(RouteRequest(rid, "m", prompt_tokens=16, max_tokens=8), hints=hints),
                0.0)
        p.release(0.0)
    (view,) = p.views()
    assert (view.in_flight, view.grouped, view.groups, view.workflows) == (4, 3, 2, 3)
    p.on_event(Finished("x1"), 1.0)
    (view,) = p.views()
    assert (view.in_flight, view.workflows) == (3, 3)
    p.on_event(Finished("x2"), 1.0)
    p.on_event(Finished("z"), 1.0)
    (view,) = p.views()
    assert (view.in_flight, view.grouped, view.groups, view.workflows) == (1, 1, 1, 1)


def test_a_recompute_is_priced_by_the_workflows_waiting_not_their_calls() -> None:
    """The compute a recompute takes waits once per workflow in flight: a fan-out's eight
    children at one engine count as one workflow, not eight."""
    from planner.cost import CostModel, CostSettings

    profile = get_profile("h100-llama3-8b")
    request = RouteRequest("r", "m", prompt_tokens=2000, max_tokens=64)
    fanout = [EngineView(n, True, frozenset({"m"}), in_flight=8, grouped=8, groups=1)
              for n in ("a", "b")]
    per_workflow = CostModel({}, profile, CostSettings(externality=0.0))
    per_request = CostModel({}, profile, CostSettings(externality=0.0,
                                                      opportunity_per_workflow=False))
    one, eight = (m.estimate(request, fanout)[0] for m in (per_workflow, per_request))
    assert one.external_s == pytest.approx(1 * one.prefill_s)
    assert eight.external_s == pytest.approx(8 * eight.prefill_s)


def test_every_policy_module_is_registered_explicitly() -> None:
    import pkgutil

    import planner.policies as package
    from planner.policy import POLICY_MODULES

    found = {f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)}
    assert found == set(POLICY_MODULES)


def test_a_buffered_call_sees_the_prefixes_placed_while_it_waited() -> None:
    p = batch_planner()
    seen: dict[str, RouteRequest] = {}
    choose = p.policy.choose

    def spy(route: RouteRequest, engines: Any, now: float) -> Any:
        seen[route.request_id] = route
        return choose(route, engines, now)

    p.policy.choose = spy  # type: ignore[method-assign]
    for i in range(4):  # two full steps on each engine: both backed up
        p.admit(long_call(f"f{i}"), 0.0)
    p.release(0.0)
    keys = tuple(range(1000, 1000 + BUDGET // 32))
    for rid in ("s1", "s2"):  # siblings on a context nobody holds yet, half a step long
        p.admit(Call(RouteRequest(rid, "m", prompt_tokens=BUDGET // 2 + 5, block_keys=keys,
                                  max_tokens=16)), 0.1)
    assert p.release(0.1) == [] and p.buffered == 2
    p.on_event(FirstToken("f0"), 0.5)
    # s1 goes out first: dispatched, or its prompt's first piece (paced prefill: f0 decodes
    # there).
    placed = [(a.request_id, a.engine) if isinstance(a, Dispatch) else (a.origin, a.engine)
              for a in p.release(0.5) if isinstance(a, Dispatch | Warm)]
    assert [rid for rid, _ in placed][:1] == ["s1"]
    # Matched when admitted, s2 knew of no holder; offered after s1 went out, it sees s1's
    # engine as holding the whole prefix, as the index's speculative entries would.
    match = seen["s2"].matches.get(placed[0][1])
    assert match is not None and match.blocks == len(keys)


def test_a_workflows_first_call_goes_where_the_fewest_workflows_live() -> None:
    """Engine a is home to two workflows between calls (nothing of theirs runs), b to none but
    it runs a plain request: the estimate alone sends a new workflow's first call to the idle
    a, where both loops will come back; kvgate sends it to b. Later calls are placed by the
    estimate, and a workflow that is over is home nowhere."""
    def setup(name: str) -> Planner:
        p = batch_planner(name)
        for n, wf in enumerate(("w1", "w2")):
            rid = f"{wf}/t1"
            p.admit(Call(RouteRequest(rid, "m", prompt_tokens=512, max_tokens=64,
                                      block_keys=tuple(range(100 * n, 100 * n + 32)),
                                      matches={"a": EngineMatch("a", 32, 32, 32.0)}),
                         hints=RequestHints(workflow=wf, task="t1", after=("t0",))), 0.0)
            (d,) = p.release(0.0)
            assert isinstance(d, Dispatch) and d.engine == "a"
            p.on_event(Finished(rid, 64), 1.0)
        p.admit(Call(RouteRequest("plain", "m", prompt_tokens=512, max_tokens=64,
                                  block_keys=tuple(range(500, 532)),
                                  matches={"b": EngineMatch("b", 32, 32, 32.0)})), 1.0)
        (d,) = p.release(1.0)
        assert isinstance(d, Dispatch) and d.engine == "b"
        return p

    def root(p: Planner, wf: str, now: float) -> str:
        p.admit(Call(RouteRequest(f"{wf}/t0", "m", prompt_tokens=512, max_tokens=64,
                                  block_keys=tuple(range(900, 932))),
                     hints=RequestHints(workflow=wf, task="t0")), now)
        (d,) = p.release(now)
        assert isinstance(d, Dispatch)
        return d.engine

    p = setup("kvgate")
    assert {v.name: v.homed_workflows for v in p.views()} == {"a": 2, "b": 0}
    assert {v.name: v.in_flight for v in p.views()} == {"a": 0, "b": 1}
    assert root(p, "w3", 2.0) == "b"
    assert root(setup("kvgate-no-homes"), "w3", 2.0) == "a"
    p.on_event(WorkflowOver("w1"), 3.0)
    p.on_event(WorkflowOver("w2"), 3.0)
    assert {v.name: v.homed_workflows for v in p.views()} == {"a": 0, "b": 1}


def test_a_call_the_cost_model_cannot_price_is_refused_alone() -> None:
    # A length beyond any float once overflowed the cost model inside a batch release, and the
    # call, left in the buffer, failed every release after it.
    p = planner("kvgate")
    bad = call("huge")
    p.admit(Call(replace(bad.route, max_tokens=10**400)), 0.0)
    p.admit(call("fine"), 0.0)
    actions = p.release(0.0)
    (reject,) = [a for a in actions if isinstance(a, Reject)]
    assert reject.request_id == "huge" and "could not price this call" in reject.reason
    assert [a.request_id for a in actions if isinstance(a, Dispatch)] == ["fine"]
    assert not p.knows("huge")
    p.admit(call("later"), 1.0)
    assert [a.request_id for a in p.release(1.0) if isinstance(a, Dispatch)] == ["later"]


def test_a_fan_out_parents_first_token_with_no_healthy_engine_plans_no_prefetch() -> None:
    """Prefetch planning is best effort: a parent that answers while no engine is healthy
    (its only engine missed its health checks mid-answer) copies nothing; the event was an
    exception that cut the parent's own answer."""
    bs = 16
    ctx = PolicyContext(profiles={}, default_profile=get_profile("h100-llama3-8b"),
                        block_size=bs)
    p = make_planner("kvgate", ctx, engine_block_size=lambda _: bs)
    p.on_event(EngineJoined("a", True, frozenset({"m"})), 0.0)
    p.admit(Call(RouteRequest("plan", "m", prompt_tokens=4000, block_keys=tuple(range(250)),
                              max_tokens=64),
                 hints=RequestHints(workflow="w", task="plan", expect_children=3),
                 static_blocks=16), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.engine == "a"
    p.on_event(EngineHealth("a", False), 0.5)
    p.on_event(FirstToken("plan"), 0.6)
    assert p.state("plan") is RequestState.PREFILLED and not p.release(0.6)
    p.on_event(Finished("plan", 64), 1.0)
    assert p.engines["a"].load.in_flight == 0


def test_first_tokens_of_one_step_do_not_shrink_the_batch_interval() -> None:
    """A live gateway reads the first tokens of one engine step microseconds apart: they are
    no step gap (taken as one, the interval fell to 20 us and the buffer was re-released back
    to back); the gap to the next step's first token is."""
    bs = 16
    profile = get_profile("h100-llama3-8b")
    ctx = PolicyContext(profiles={}, default_profile=profile, block_size=bs)
    p = make_planner("kvgate", ctx, engine_block_size=lambda _: bs)
    p.on_event(EngineJoined("a", True, frozenset({"m"})), 0.0)
    for i in range(400):
        keys = tuple(range(i * 10**6, i * 10**6 + 60))
        p.admit(Call(RouteRequest(f"r{i}", "m", prompt_tokens=960, block_keys=keys,
                                  max_tokens=128)), 0.0)
    sent = [a.request_id for a in p.release(0.0) if isinstance(a, Dispatch)]
    assert len(sent) >= 3 and p.buffered > 0
    assert p._batch is not None
    full_step = p._batch.interval("a")
    for k, rid in enumerate(sent[:2]):
        p.on_event(FirstToken(rid), 0.05 + k * 20e-6)
    assert p._batch.interval("a") == full_step  # one step: no gap learnt
    p.on_event(FirstToken(sent[2]), 0.35)
    assert p._batch.interval("a") == pytest.approx(0.30)
    p.on_event(EngineLeft("a"), 0.4)
    assert p._batch.interval("b") != pytest.approx(0.30)  # its pace left with it


def test_a_paced_piece_falling_due_makes_the_planner_pending() -> None:
    """A paced prompt's next piece falls due `PACE_AHEAD_S` after the one before reached the
    engine: the drivers read `next_wakeup` only when `pending` says so, and it did not for
    this, so the piece waited for an unrelated event (every other piece set off only when the
    one before answered: half the pace)."""
    from planner.actions import Warm
    from planner.core import PACE_AHEAD_S
    from planner.events import TransferDone
    from planner.transfer import TransferLink

    bs = 16
    ctx = PolicyContext(profiles={}, default_profile=get_profile("h100-llama3-8b"),
                        block_size=bs, link=TransferLink())
    p = make_planner("kvgate", ctx, engine_block_size=lambda _: bs)
    p.on_event(EngineJoined("a", healthy=True, models=frozenset({"m"})), 0.0)
    p.on_event(EngineScraped("a", 20, 0, 0.3), 0.0)  # a decode batch to pace beside
    p.admit(Call(RouteRequest("r", "m", prompt_tokens=1000 * bs,
                              block_keys=tuple(range(1000)), max_tokens=64)), 0.0)
    (first,) = [a for a in p.release(0.0) if isinstance(a, Warm)]
    ahead_at = p.next_wakeup()
    assert ahead_at is not None
    (second,) = [a for a in p.release(ahead_at) if isinstance(a, Warm)]  # sent ahead
    assert not p.pending
    now = ahead_at + 0.01
    p.on_event(TransferDone(first.move_id), now)  # the second is at the engine: the third
    assert p.pending  # falls due PACE_AHEAD_S on, so the driver must look again
    assert not p.release(now) and not p.pending
    wake = p.next_wakeup()
    assert wake is not None and now < wake <= now + PACE_AHEAD_S + 1e-9
    (third,) = [a for a in p.release(wake) if isinstance(a, Warm)]
    assert third.move_id not in (first.move_id, second.move_id)


def test_hint_mode_lineage_holds_a_bounded_number_of_prompt_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hint-mode workflows never end, and each remembered call holds its prompt's keys: all
    of them together hold at most LINEAGE_HINT_BLOCKS (the least recently called forgotten),
    while a submitted workflow keeps its calls until it is over."""
    import planner.core as core

    monkeypatch.setattr(core, "LINEAGE_HINT_BLOCKS", 1000)
    bs = 16
    ctx = PolicyContext(profiles={}, default_profile=get_profile("h100-llama3-8b"),
                        block_size=bs)
    p = make_planner("kvgate", ctx, engine_block_size=lambda _: bs)
    p.on_event(EngineJoined("a", True, frozenset({"m"})), 0.0)
    p.on_event(WorkflowSubmitted("dag", ()), 0.0)
    n = 0

    def call(workflow: str, task: str, blocks: int) -> None:
        nonlocal n
        n += 1
        keys = tuple(range(n * 10**6, n * 10**6 + blocks))
        p.admit(Call(RouteRequest(f"r{n}", "m", prompt_tokens=blocks * bs, block_keys=keys),
                     hints=RequestHints(workflow=workflow, task=task)), 0.0)
        p.release(0.0)
        p.on_event(FirstToken(f"r{n}"), 0.0)
        p.on_event(Finished(f"r{n}", 1), 0.0)

    call("dag", "t0", 600)
    for session in range(6):
        for turn in range(2):
            call(f"s{session}", f"t{turn}", 150)
    assert p._hint_blocks <= 1000 and p._hint_blocks == sum(p._lineage_size.values())
    assert "s0" not in p._lineage and "s5" in p._lineage and len(p._lineage["s5"]) == 2
    assert len(p._lineage["dag"]) == 1  # submitted: not the budget's to forget
    p.on_event(WorkflowOver("s5"), 0.0)
    assert "s5" not in p._lineage and p._hint_blocks == sum(p._lineage_size.values())


def test_a_call_of_n_sequences_counts_n_times_in_its_engines_load() -> None:
    from gateway.proxy import sequences_of

    # vLLM decodes `n` sequences for it (parallel sampling), each stepping and reading the
    # prompt's KV: it counted as one, and the cost model priced its engine n-1 calls light.
    p = planner()
    p.admit(Call(RouteRequest("best-of-4", "m", prompt_tokens=64, block_keys=(1, 2, 3, 4),
                              sequences=4)), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch)
    view = {v.name: v for v in p.views()}[d.engine]
    assert view.in_flight == 4 and view.active_blocks == 16 and view.prefilling == 1
    p.on_event(Finished("best-of-4", 40), 1.0)
    view = {v.name: v for v in p.views()}[d.engine]
    assert view.in_flight == 0 and view.active_blocks == 0
    assert [sequences_of(b) for b in ({}, {"n": 4}, {"n": "3"}, {"n": 0}, {"n": "x"},
                                      {"n": 10**9})] == [1, 4, 3, 1, 1, 256]
