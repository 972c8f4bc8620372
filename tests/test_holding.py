"""Requests a policy holds wait at the gateway and are offered again, oldest first."""

from __future__ import annotations

import pytest

from kvgate.bench.prompts import ChatRenderer, Vocabulary
from kvgate.bench.virtual import MODEL, Load, PromptBuilder, VirtualRun
from kvgate.bench.workloads import build_workload
from kvindex.keys import PromptKeyer
from kvindex.tokenizer import Tokenizer
from planner.actions import Dispatch
from planner.core import Call, RequestState, make_planner
from planner.events import EngineJoined, Finished, FirstToken
from planner.holding import HoldQueue
from planner.policies.dynamo_like import DynamoKvRouter
from planner.policy import EngineView, Hold, PolicyContext, RouteRequest
from planner.profiles import get_profile


def test_release_offers_oldest_first_and_stops_at_the_first_still_held() -> None:
    queue: HoldQueue[str] = HoldQueue()
    for rid in ("r1", "r2", "r3"):
        queue.hold(rid, rid)
    offered: list[str] = []

    def offer(token: str) -> bool:
        offered.append(token)
        return token != "r2"

    assert queue.release(offer) == 1
    assert offered == ["r1", "r2"]
    assert len(queue) == 2


def test_a_held_request_stops_only_its_own_queue() -> None:
    """Dynamo keeps a router, and its queue, per model: a held call of one model holds back
    the later calls of that model only."""
    queue: HoldQueue[str] = HoldQueue()
    for rid in ("x1", "x2", "y1", "x3", "y2"):
        queue.hold(rid, rid)
    offered: list[str] = []

    def offer(token: str) -> bool:
        offered.append(token)
        return token != "x2"

    assert queue.release(offer, lambda token: token[0]) == 3
    assert offered == ["x1", "x2", "y1", "y2"]
    assert len(queue) == 2  # x2 and x3 wait, in their order


def test_a_held_call_of_one_model_does_not_hold_back_an_idle_engines_model() -> None:
    bs = 16
    ctx = PolicyContext(profiles={}, default_profile=get_profile("h100-llama3-8b"),
                        block_size=bs)
    p = make_planner("dynamo-like", ctx, engine_block_size=lambda _: bs)
    p.on_event(EngineJoined("x-engine", True, frozenset({"X"})), 0.0)
    p.on_event(EngineJoined("y-engine", True, frozenset({"Y"})), 0.0)
    for n, (rid, model) in enumerate([("x0", "X"), ("x1", "X"), ("y0", "Y"), ("y1", "Y"),
                                      ("x-held", "X"), ("y-held", "Y")]):
        keys = tuple(range(n * 10**6, n * 10**6 + 70_000 // bs))
        p.admit(Call(RouteRequest(rid, model, prompt_tokens=70_000, block_keys=keys)), 0.0)
        p.release(0.0)
    assert p.state("x-held") is RequestState.HELD and p.state("y-held") is RequestState.HELD
    for rid in ("y0", "y1"):  # the Y engine drains; the X engine stays backed up
        p.on_event(FirstToken(rid), 1.0)
        p.on_event(Finished(rid, 10), 1.0)
    sent = [(a.request_id, a.engine) for a in p.release(1.0) if isinstance(a, Dispatch)]
    assert sent == [("y-held", "y-engine")]
    assert p.state("x-held") is RequestState.HELD


def test_discarded_requests_are_never_offered() -> None:
    queue: HoldQueue[str] = HoldQueue()
    queue.hold("r1", "r1")
    queue.hold("r2", "r2")
    assert queue.discard("r1")
    assert not queue.discard("r1")
    offered: list[str] = []
    queue.release(lambda token: offered.append(token) is None)
    assert offered == ["r2"]
    assert len(queue) == 0


def test_a_request_cannot_be_held_twice() -> None:
    queue: HoldQueue[str] = HoldQueue()
    queue.hold("r1", "r1")
    with pytest.raises(ValueError, match="already held"):
        queue.hold("r1", "again")


# -- dynamo-like's router queue -----------------------------------------------------------------

BUDGET = get_profile("h100-llama3-8b").max_num_batched_tokens


def backed_up(name: str, tokens: int) -> EngineView:
    return EngineView(name=name, healthy=True, models=frozenset({"m"}),
                      queued_prefill_tokens=tokens, in_flight=1, prefilling=1)


def test_dynamo_holds_while_every_worker_is_over_the_threshold() -> None:
    policy = DynamoKvRouter(PolicyContext(default_profile=get_profile("h100-llama3-8b")))
    req = RouteRequest(request_id="r", model="m", prompt_tokens=100)
    limit = 16 * BUDGET
    with pytest.raises(Hold):
        policy.choose(req, [backed_up("a", limit + 1), backed_up("b", limit + 1)], 0.0)
    assert policy.choose(req, [backed_up("a", limit + 1), backed_up("b", limit)], 0.0) == "b"


def test_dynamo_queue_can_be_turned_off() -> None:
    policy = DynamoKvRouter(PolicyContext(default_profile=get_profile("h100-llama3-8b")),
                            queue_threshold=None)
    req = RouteRequest(request_id="r", model="m", prompt_tokens=100)
    over = 100 * BUDGET
    assert policy.choose(req, [backed_up("a", over), backed_up("b", over + 1)], 0.0) == "a"


# -- the virtual driver -------------------------------------------------------------------------

def one_engine_flood(policy: str) -> VirtualRun:
    """32 fan-out workflows with 8k-token system prompts arriving at once on one engine."""
    tok = Tokenizer.load()
    vocab = Vocabulary(tok)
    profile = get_profile("h100-llama3-8b")
    workload = build_workload("fanout", None, {"static_tokens": "8000", "width": "2"}, 32, MODEL,
                              vocab, profile.max_model_len)
    builder = PromptBuilder(vocab, ChatRenderer(tok, vocab), PromptKeyer(tok, 16))
    return VirtualRun(policy, workload.workflows, Load(concurrency=32), profile, 1, builder)


def test_virtual_held_requests_wait_at_the_gateway_and_leave_in_arrival_order() -> None:
    result = one_engine_flood("dynamo-like").run()
    assert all(w.finished_s is not None and not w.failed for w in result.workflows)
    plans = [r for r in result.requests if r.task == "plan"]
    held = [r for r in plans if r.dispatched_s > r.ready_s]
    assert held, "the flood never backed the engine up"
    order = sorted(plans, key=lambda r: r.dispatched_s)
    assert [r.workflow for r in order] == [r.workflow for r in plans]


def test_virtual_policies_that_never_hold_dispatch_when_ready() -> None:
    result = one_engine_flood("least-loaded").run()
    assert all(r.dispatched_s == r.ready_s for r in result.requests)
