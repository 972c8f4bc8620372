"""Paced prefill: on an engine with sequences decoding, a long uncached prompt is computed in
pieces that each ride along with one decode step for free (warm-ups of longer and longer
prefixes), and the request goes out with the last piece; the engine model's roofline says
what is free, and the virtual driver carries the pieces out."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm_plugins.kvgate_pace_caps import read_caps
from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import prepare
from kvgate.bench.virtual import RunResult, VirtualRun
from planner.actions import Dispatch, Warm
from planner.core import (
    PACE,
    PACE_AHEAD_S,
    PACE_IN_ENGINE,
    PACE_MIN_BLOCKS,
    PACE_SCHEDULE_TOKENS,
    Call,
    Planner,
    RequestState,
    make_planner,
    paced_steps,
)
from planner.events import EngineJoined, Finished, FirstToken, TransferDone, TransferFailed
from planner.policy import PolicyContext, RouteRequest
from planner.profiles import get_profile
from planner.transfer import TransferLink

PROFILE = get_profile("h100-llama3-8b")
BS = 16


def planner(name: str = "kvgate-no-batch") -> Planner:
    """The planner with immediate release (the virtual runs below show `kvgate`'s batch release
    pacing too)."""
    ctx = PolicyContext(profiles={}, default_profile=PROFILE, block_size=BS,
                        link=TransferLink())
    p = make_planner(name, ctx, engine_block_size=lambda _: BS)
    p.on_event(EngineJoined("a", healthy=True, models=frozenset({"m"})), 0.0)
    return p


def decoding(p: Planner, n: int, context_blocks: int = 250) -> float:
    """`n` requests with `context_blocks`-block prompts, dispatched (each piece of a paced one
    done a millisecond after it is sent) and decoding; the time when they all are."""
    now = 0.0
    for i in range(n):
        keys = tuple(range(10**6 * (i + 1), 10**6 * (i + 1) + context_blocks))
        p.admit(Call(RouteRequest(f"d{i}", "m", prompt_tokens=context_blocks * BS,
                                  block_keys=keys, max_tokens=512)), now)
        while p.state(f"d{i}") is not RequestState.DISPATCHED:
            now += 0.001
            for a in p.release(now):
                if isinstance(a, Warm):
                    p.on_event(TransferDone(a.move_id), now)
        p.on_event(FirstToken(f"d{i}"), now)
    p.release(now)
    return now


def long_call(blocks: int = 250, rid: str = "r") -> Call:
    return Call(RouteRequest(rid, "m", prompt_tokens=blocks * BS, block_keys=tuple(range(blocks)),
                             max_tokens=64))


def test_a_long_prompt_on_a_busy_engine_goes_in_free_pieces_then_the_request() -> None:
    p = planner()
    now = decoding(p, 20)
    before = p.moves.stats.started["warm:pace"]  # the decoding requests' own pieces
    p.admit(long_call(), now)
    done, pieces = 0, []
    actions = p.release(now)
    while actions and isinstance(actions[0], Warm):
        (warm,) = actions
        assert (warm.engine, warm.origin, warm.reason) == ("a", "r", PACE)
        assert warm.block_keys == tuple(range(len(warm.block_keys)))
        assert p.state("r") is RequestState.AWAITING_KV
        # Each piece is what one step of the 20 decoding sequences computes for free.
        free = PROFILE.free_prefill_tokens(20, 250 * BS, done * BS, granule=BS) // BS
        assert len(warm.block_keys) - done == free >= PACE_MIN_BLOCKS
        pieces.append(free)
        done = len(warm.block_keys)
        now += 0.02
        p.on_event(TransferDone(warm.move_id), now)
        actions = p.release(now)
    (d,) = actions
    assert isinstance(d, Dispatch) and d.engine == "a" and d.reason == PACE
    assert d.cached_tokens == done * BS
    assert len(pieces) >= 2 and 250 - done <= pieces[-1]
    assert p.state("r") is RequestState.DISPATCHED
    assert p.moves.stats.started == {"warm:pace": before + len(pieces)}


def test_an_idle_engine_gets_the_prompt_whole() -> None:
    p = planner()
    p.admit(long_call(), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.reason == "load" and not p.moves.stats.started


def test_a_prompt_within_one_free_piece_goes_at_once() -> None:
    p = planner()
    now = decoding(p, 20)
    free = PROFILE.free_prefill_tokens(20, 250 * BS, 0, granule=BS) // BS
    p.admit(long_call(free), now)
    before = dict(p.moves.stats.started)
    (d,) = p.release(now)
    assert isinstance(d, Dispatch) and p.moves.stats.started == before


def test_requests_still_prefilling_are_not_the_decode_batch() -> None:
    p = planner()
    for i in range(3):
        p.admit(long_call(250, f"p{i}"), 0.0)
    assert all(isinstance(a, Dispatch) for a in p.release(0.0))
    p.admit(long_call(250, "r"), 0.0)
    (d,) = p.release(0.0)  # nothing decodes there yet: nothing to stall, nothing free
    assert isinstance(d, Dispatch) and d.request_id == "r"


def test_a_failed_piece_sends_the_request_to_compute_the_rest() -> None:
    p = planner()
    now = decoding(p, 20)
    p.admit(long_call(), now)
    (warm,) = p.release(now)
    assert isinstance(warm, Warm)
    p.on_event(TransferFailed(warm.move_id, "engine gone"), now + 0.05)
    (d,) = p.release(now + 0.05)
    assert isinstance(d, Dispatch) and d.request_id == "r"
    assert p.moves.stats.failed == 1


def test_a_late_piece_is_given_up_at_its_deadline() -> None:
    p = planner()
    now = decoding(p, 20)
    p.admit(long_call(), now)
    (warm,) = p.release(now)
    record = p.moves.get(warm.move_id)
    assert record is not None
    deadline = record.deadline()
    actions: list[object] = []
    t = now
    while not any(isinstance(a, Dispatch) for a in actions):
        wake = p.next_wakeup()  # the next piece sent ahead, then the deadline
        assert wake is not None and t < wake <= deadline
        t = wake
        actions = p.release(t)
    (d,) = [a for a in actions if isinstance(a, Dispatch)]
    assert t == deadline
    assert d.request_id == "r" and p.moves.stats.late == 1
    p.on_event(TransferDone(warm.move_id), deadline + 0.1)
    assert p.release(deadline + 0.1) == []  # neither sent twice nor paced on


def test_the_next_piece_goes_out_while_the_engine_computes_the_one_before() -> None:
    p = planner()
    now = decoding(p, 20)
    p.admit(long_call(), now)
    (first,) = p.release(now)
    record = p.moves.get(first.move_id)
    assert isinstance(first, Warm) and record is not None
    # By one decode step after the first piece was sent its engine has begun computing it.
    ahead = p.next_wakeup()
    assert ahead == pytest.approx(record.eta + PACE_AHEAD_S) and now < ahead < now + 0.1
    (second,) = p.release(ahead)
    assert isinstance(second, Warm) and second.reason == PACE
    assert second.block_keys[:len(first.block_keys)] == first.block_keys
    assert len(second.block_keys) > len(first.block_keys)
    # The first answers: the request waits for the second, already at the engine, and the
    # third goes out a moment later, while the engine computes the second.
    t = ahead + 0.01
    p.on_event(TransferDone(first.move_id), t)
    assert p.release(t) == [] and p.state("r") is RequestState.AWAITING_KV
    assert p.next_wakeup() == pytest.approx(t + PACE_AHEAD_S)
    (third,) = p.release(t + PACE_AHEAD_S)
    assert isinstance(third, Warm) and len(third.block_keys) > len(second.block_keys)
    assert third.block_keys[:len(second.block_keys)] == second.block_keys


def test_calls_that_wait_on_a_paced_prompt_follow_its_pieces_and_send_none_of_their_own(
) -> None:
    # Each call waiting on another's piece used to start a chain of its own over the same
    # blocks when the piece landed (and send its pieces ahead): two siblings of a 250-block
    # prompt sent as many warm-ups as the prompt itself.
    p = planner()
    now = decoding(p, 20)
    before = p.moves.stats.started["warm:pace"]
    p.admit(long_call(), now)
    warms = [a for a in p.release(now) if isinstance(a, Warm)]
    for sibling in ("s1", "s2"):  # the same prompt and one block of their own
        p.admit(Call(RouteRequest(sibling, "m", prompt_tokens=251 * BS,
                                  block_keys=(*range(250), 10**9 + len(sibling)),
                                  max_tokens=64)), now)
    dispatched: dict[str, int] = {}
    t = now
    while len(dispatched) < 3:
        wake = p.next_wakeup()
        pending = [p.moves.get(w.move_id) for w in warms]
        due = [r for r in pending if r is not None and r.eta <= (wake or math.inf)]
        t = max(t, min([wake or math.inf, *(r.eta for r in due)]))
        for r in due:
            if r.eta <= t:
                p.on_event(TransferDone(r.action.move_id), t)
        for a in p.release(t):
            if isinstance(a, Warm):
                warms.append(a)
            elif isinstance(a, Dispatch):
                dispatched[a.request_id] = a.cached_tokens
        assert p.next_wakeup() is None or p.next_wakeup() >= t  # never in the past
    assert {w.origin for w in warms} == {"r"}
    assert p.moves.stats.started["warm:pace"] - before == len(warms)
    # Each holds what the one chain warmed (the prompt's owner computes its last piece).
    warmed = max(len(w.block_keys) for w in warms) * BS
    assert dispatched["s1"] == dispatched["s2"] == dispatched["r"] == warmed


def test_a_finish_reported_for_a_call_waiting_on_a_move_withdraws_it() -> None:
    # It used to drop the call and leave its engine's load entry open for good.
    p = planner()
    now = decoding(p, 20)
    load = p.engines["a"].load
    in_flight, queued = load.in_flight, load.queued_prefill_tokens
    p.admit(long_call(), now)
    p.release(now)
    assert p.state("r") is RequestState.AWAITING_KV and load.in_flight == in_flight + 1
    p.on_event(Finished("r", 0), now + 0.01)
    assert p.state("r") is None
    assert (load.in_flight, load.queued_prefill_tokens) == (in_flight, queued)


@pytest.mark.parametrize("name", ["kvgate-no-pace", "least-loaded", "dynamo-like"])
def test_the_ablation_and_the_baselines_do_not_pace(name: str) -> None:
    p = planner(name)
    now = decoding(p, 20)
    p.admit(long_call(), now)
    (d,) = p.release(now)
    assert isinstance(d, Dispatch) and not p.moves.stats.started


# -- the roofline ----------------------------------------------------------------------------------


def step_is_memory_bound(batch: int, context: int, at: int, t: int) -> bool:
    per_token, per_attended, rate, weights, kv_bytes, bandwidth = PROFILE.step_factors
    flops = (per_token * (batch + t) + per_attended * batch * (context + 1.0)
             + per_attended * t * (at + (t + 1) / 2))
    return flops / rate <= (weights + (batch * (context + 1.0) + at + t) * kv_bytes) / bandwidth


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 60_000), st.integers(0, 60_000),
       st.sampled_from([1, 16, 32]))
def test_free_tokens_are_the_most_a_memory_bound_step_takes(batch: int, context: int, at: int,
                                                           granule: int) -> None:
    t = PROFILE.free_prefill_tokens(batch, context, at, granule)
    assert t % granule == 0 and t <= PROFILE.max_num_batched_tokens
    if batch == 0:
        assert t == 0
        return
    assert t == 0 or step_is_memory_bound(batch, context, at, t)
    assert t + granule > PROFILE.max_num_batched_tokens - batch or \
        not step_is_memory_bound(batch, context, at, t + granule)
    # Riding along with the decodes, such a piece leaves the step as long as the piece's own
    # KV reads make it (what computing the piece reads anywhere).
    if t:
        attended = batch * (context + 1.0) + t * (at + (t + 1) / 2)
        with_piece = PROFILE.step_time_of(batch + t, attended,
                                          batch * (context + 1.0) + at + t, batch + 1)
        alone = PROFILE.decode_step_time(batch, context)
        reads = (at + t) * PROFILE.kv_bytes_per_token / (PROFILE.mem_bandwidth * PROFILE.mbu)
        assert math.isclose(with_piece, alone + reads, rel_tol=1e-9)


def test_a_busier_engine_has_more_free_compute_per_step() -> None:
    free = [PROFILE.free_prefill_tokens(b, 4500, 3500, 16) for b in (1, 8, 32, 64)]
    assert free == sorted(free) and free[0] > 0 and free[-1] > free[0]


# -- the virtual driver ----------------------------------------------------------------------------


def run_debate(policy: str) -> tuple[RunResult, Planner]:
    o = BenchOptions(workload="debate", rate=4.0, workflows=12, engines=2, progress=False)
    prepared = prepare(o)
    run = VirtualRun(policy, prepared.workflows, prepared.load,  # type: ignore[attr-defined]
                     o.engine_profile(), o.engines, prepared.builder)  # type: ignore[attr-defined]
    result = run.run()
    assert not any(w.failed or w.finished_s is None for w in result.workflows)
    return result, run.planner


@pytest.mark.parametrize("policy", ["kvgate", "kvgate-no-pace"])
def test_virtual_runs_carry_the_pieces_out_as_the_requests_own_prefill(policy: str) -> None:
    result, p = run_debate(policy)
    stats = p.moves.stats
    assert (stats.started.get("warm:pace", 0) > 0) == (policy == "kvgate")
    assert stats.failed == 0 and stats.done == sum(stats.started.values())
    assert set(stats.started) <= {"warm:pace"}
    # What the engines computed is what the requests' records say they computed: a request's
    # own pieces count as its prefill, not as cache hits.
    assert result.computed_prompt_tokens == sum(r.prompt_tokens - r.cached_tokens
                                                for r in result.requests)


# -- paced by the engine (`kvgate-engine-pace`) ----------------------------------------------------


def test_paced_by_the_engine_the_request_goes_at_once_with_the_free_piece_as_its_cap() -> None:
    p = planner("kvgate-engine-pace")
    now = decoding(p, 20)
    before = p.moves.stats.started[f"warm:{PACE_IN_ENGINE}"]  # the decoding requests' own
    p.admit(long_call(), now)
    (d,) = p.release(now)
    assert isinstance(d, Dispatch) and d.request_id == "r" and d.engine == "a"
    free = PROFILE.free_prefill_tokens(20, 250 * BS, 0, granule=BS)
    assert d.prefill_cap == free >= PACE_MIN_BLOCKS * BS
    # Its blocks are announced by the engine's KV events as they are computed, not ahead.
    assert d.speculative_keys == ()
    assert p.state("r") is RequestState.DISPATCHED
    # No warm-up goes out: the move stands for the request's own prompt until its first token.
    assert p.moves.stats.started == {f"warm:{PACE_IN_ENGINE}": before + 1}


def test_paced_by_the_engine_the_cap_falls_as_the_prompt_gets_on() -> None:
    # A token further into the prompt attends to more: fewer ride free in a step, so the
    # planner sends the free piece at every PACE_SCHEDULE_TOKENS of the prompt where it
    # changes (`Dispatch.prefill_caps`), which the engine applies by its computed tokens.
    p = planner("kvgate-engine-pace")
    now = decoding(p, 20)
    p.admit(long_call(2500), now)  # 40,000 tokens
    (d,) = p.release(now)
    assert isinstance(d, Dispatch) and d.prefill_cap > 0
    expected, cap = [], d.prefill_cap
    for at in range(PACE_SCHEDULE_TOKENS, 2500 * BS, PACE_SCHEDULE_TOKENS):
        free = max(PACE_MIN_BLOCKS * BS,
                   PROFILE.free_prefill_tokens(20, 250 * BS, at, granule=BS))
        if free != cap:
            expected.append((at, free))
            cap = free
    assert list(d.prefill_caps) == expected and len(expected) >= 2
    assert d.prefill_caps[-1][1] < d.prefill_cap
    # On the wire as vLLM takes a `vllm_xargs` value: one flat list of integers.
    xargs = d.pace_xargs()
    assert all(isinstance(v, int) for v in xargs["kvgate_prefill_caps"])  # type: ignore[union-attr]
    assert read_caps(xargs) == (d.prefill_cap, d.prefill_caps)


def test_the_planner_counts_a_capped_prompts_steps_as_the_engine_takes_them() -> None:
    # The engine model's chunks for these caps (test_engine_model): 256, 256, 128 x 3, 64, 40.
    assert paced_steps(0, 1000, 256, ((500, 128), (800, 64))) == 7
    assert paced_steps(0, 1000, 256, ()) == 4
    assert paced_steps(512, 1000, 256, ((500, 128), (800, 64))) == 5  # 128 x 3, then 64 x 2


def test_paced_by_the_engine_a_call_extending_the_prompt_waits_for_its_first_token() -> None:
    p = planner("kvgate-engine-pace")
    now = decoding(p, 20)
    p.admit(long_call(), now)
    (d,) = p.release(now)
    assert isinstance(d, Dispatch) and d.prefill_cap > 0
    sibling = Call(RouteRequest("s", "m", prompt_tokens=260 * BS,
                                block_keys=(*range(250), *range(-10, 0)), max_tokens=64))
    p.admit(sibling, now + 0.01)
    assert p.release(now + 0.01) == []
    assert p.state("s") is RequestState.AWAITING_KV
    p.on_event(FirstToken("r"), now + 0.5)
    (ds,) = p.release(now + 0.5)
    assert isinstance(ds, Dispatch) and ds.request_id == "s" and ds.engine == "a"
    assert ds.kv_move == PACE_IN_ENGINE and not p.moves


def test_paced_by_the_engine_a_call_that_ends_without_a_token_frees_its_waiters() -> None:
    p = planner("kvgate-engine-pace")
    now = decoding(p, 20)
    p.admit(long_call(), now)
    p.release(now)
    p.admit(long_call(250, "s"), now + 0.01)
    assert p.release(now + 0.01) == []
    p.on_event(Finished("r", output_tokens=0), now + 0.2)
    (ds,) = p.release(now + 0.2)
    assert isinstance(ds, Dispatch) and ds.request_id == "s"
    assert p.moves.stats.failed == 1


def test_paced_by_the_engine_an_idle_engine_gets_no_cap() -> None:
    p = planner("kvgate-engine-pace")
    p.admit(long_call(), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.prefill_cap == 0 and not p.moves


def test_the_default_planner_paces_by_the_engine_where_the_engine_can() -> None:
    """`kvgate` in front of an engine listed in `PolicyContext.paced_engines` (its config
    entry's `scheduler: kvgate-pace`) sends a cap there and pieces elsewhere."""
    ctx = PolicyContext(profiles={}, default_profile=PROFILE, block_size=BS,
                        link=TransferLink(), paced_engines={"a"})
    p = make_planner("kvgate-no-batch", ctx, engine_block_size=lambda _: BS)
    p.on_event(EngineJoined("a", healthy=True, models=frozenset({"m"})), 0.0)
    now = decoding(p, 20)
    p.admit(long_call(), now)
    (d,) = p.release(now)
    assert isinstance(d, Dispatch) and d.prefill_cap > 0
    p.paced_engines.discard("a")  # the engine left and came back without the plugin
    p.admit(Call(RouteRequest("r2", "m", prompt_tokens=250 * BS,
                              block_keys=tuple(range(-1000, -750)), max_tokens=64)), now)
    (warm,) = p.release(now)
    assert isinstance(warm, Warm) and warm.reason == PACE and warm.origin == "r2"
