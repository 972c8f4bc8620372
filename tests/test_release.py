"""`batch` release's own rules (planner/release.py): headroom, the interval, recent placements.

The Planner's behaviour under batch release (work-conserving, then buffering; priorities) is in
tests/test_planner_core.py; these pin the rules it asks planner/release.py about.
"""

from __future__ import annotations

import pytest

from kvindex.index import EngineMatch
from planner.ledger import GatewayLoad, Outstanding
from planner.policy import EngineView, RouteRequest
from planner.profiles import get_profile
from planner.release import (
    EWMA_ALPHA,
    PREFILL_STEPS_QUEUED,
    RECENT_PLACEMENT_S,
    SMALL_PREFILL,
    BatchRelease,
)

PROFILE = get_profile("h100-llama3-8b")
BUDGET = PROFILE.max_num_batched_tokens


def release() -> BatchRelease:
    return BatchRelease(lambda _: PROFILE)


def view(queued: int = 0, in_flight: int = 0) -> EngineView:
    return EngineView("a", True, frozenset({"m"}), in_flight=in_flight,
                      queued_prefill_tokens=queued, block_size=16)


def route(tokens: int, keys: tuple[int, ...] = (), cached_blocks: int = 0) -> RouteRequest:
    matches = {"a": EngineMatch("a", cached_blocks, cached_blocks, float(cached_blocks))} \
        if cached_blocks else {}
    return RouteRequest("r", "m", prompt_tokens=tokens, block_keys=keys, matches=matches)


def test_an_engine_with_nothing_queued_takes_any_prompt() -> None:
    assert release().fits(route(10 * BUDGET), view(queued=0))


def test_a_prompt_waits_once_it_would_queue_more_than_the_headroom() -> None:
    b = release()
    room = int(PREFILL_STEPS_QUEUED * BUDGET)
    assert b.fits(route(room - BUDGET), view(queued=BUDGET))
    assert not b.fits(route(room - BUDGET + 1), view(queued=BUDGET))


def test_a_small_uncached_part_never_waits() -> None:
    b = release()
    backed_up = view(queued=int(PREFILL_STEPS_QUEUED * BUDGET))
    small = int(SMALL_PREFILL * BUDGET)
    assert b.fits(route(small), backed_up)
    assert not b.fits(route(small + 1), backed_up)
    # What the engine holds does not count: a long prompt whose uncached tail is small goes.
    cached = 4 * BUDGET // 16
    assert b.fits(route(4 * BUDGET + small, cached_blocks=cached), backed_up)


def test_a_full_engine_takes_no_further_sequence() -> None:
    b = release()
    assert not b.fits(route(1), view(in_flight=PROFILE.max_num_seqs))
    assert b.fits(route(1), view(in_flight=PROFILE.max_num_seqs - 1))


def test_the_interval_is_a_prefill_step_until_the_engines_pace_is_observed() -> None:
    b = release()
    assert b.interval("a") == pytest.approx(PROFILE.prefill_time(BUDGET))
    busy = GatewayLoad(prefilling=2)
    b.observe_step(Outstanding("a", busy, 0, 0, 0), 1.0)  # the first one: nothing to compare
    assert b.interval("a") == pytest.approx(PROFILE.prefill_time(BUDGET))
    b.observe_step(Outstanding("a", busy, 0, 0, 0), 1.3)
    assert b.interval("a") == pytest.approx(0.3)
    b.observe_step(Outstanding("a", busy, 0, 0, 0), 1.4)
    assert b.interval("a") == pytest.approx((1 - EWMA_ALPHA) * 0.3 + EWMA_ALPHA * 0.1)
    # A first token with no other prefill waiting says nothing about the engine's pace.
    b.observe_step(Outstanding("a", GatewayLoad(prefilling=0), 0, 0, 0), 5.0)
    assert b.interval("a") == pytest.approx((1 - EWMA_ALPHA) * 0.3 + EWMA_ALPHA * 0.1)
    # The fastest engine sets the interval.
    b.observe_step(Outstanding("b", busy, 0, 0, 0), 2.0)
    b.observe_step(Outstanding("b", busy, 0, 0, 0), 2.05)
    assert b.interval("a") == pytest.approx(0.05)


def test_a_recent_placement_counts_as_held_where_it_went_until_it_expires() -> None:
    b = release()
    b.placed(0.0, "a", (1, 2, 3, 4))
    r = b.with_recent_placements(route(100, keys=(1, 2, 3, 9, 9)), 1.0)
    assert r.matches["a"].blocks == 3
    assert r.matches["a"].confirmed_blocks == 0  # the engine has not said it holds them
    # An index match that already goes further stands.
    held = route(100, keys=(1, 2, 3, 9, 9), cached_blocks=5)
    assert b.with_recent_placements(held, 1.0) is held
    # A different first block shares nothing.
    assert b.with_recent_placements(route(100, keys=(7, 2, 3)), 1.0).matches == {}
    # Past RECENT_PLACEMENT_S the placement no longer counts.
    late = b.with_recent_placements(route(100, keys=(1, 2, 3)), RECENT_PLACEMENT_S + 0.01)
    assert late.matches == {}


def test_a_release_keeps_what_was_not_placed_and_sets_the_next_one() -> None:
    b = release()
    b.release(["x", "y", "z"], lambda rid: rid == "y", 1.0, "a")
    assert b.buffer == ["x", "z"] and len(b) == 2
    assert b.wakeup == pytest.approx(1.0 + PROFILE.prefill_time(BUDGET))
    assert not b.due(1.0) and b.due(b.wakeup)
    assert b.discard("x") and not b.discard("x") and b.buffer == ["z"]
    b.release(b.buffer, lambda rid: True, 2.0, "a")
    assert b.buffer == [] and b.wakeup is None and not b.due(100.0)
