"""Each `Dispatch` says why the request goes where it goes (`kvgate_placements_total{reason}`):
where its prompt is cached, where a KV move brings it, or by load alone."""

from __future__ import annotations

from planner.actions import Dispatch, Transfer
from planner.core import Planner
from planner.events import EngineJoined, TransferDone
from planner.transfer import TransferLink
from tests.test_kv_moves import PROFILE, PullFrom, long_call, pulling_planner


def planner_placing_on(engine: str) -> Planner:
    p = Planner(PullFrom(engine, None), profile_of=lambda _: PROFILE)  # type: ignore[arg-type]
    for e in ("a", "b"):
        p.on_event(EngineJoined(e, healthy=True, models=frozenset({"m"})), 0.0)
    return p


def test_a_request_sent_where_its_prompt_is_cached_is_a_prefix_hit() -> None:
    p = planner_placing_on("a")  # the call's matches: "a" holds the whole prompt
    p.admit(long_call(), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.cached_tokens > 0 and d.reason == "prefix_hit"


def test_a_request_sent_where_nothing_is_cached_is_placed_by_load() -> None:
    p = planner_placing_on("b")
    p.admit(long_call(), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.cached_tokens == 0 and d.reason == "load"


def test_a_request_that_waited_for_a_pull_says_so() -> None:
    p = pulling_planner()
    p.admit(long_call(), 0.0)
    (move,) = p.release(0.0)
    assert isinstance(move, Transfer)
    p.on_event(TransferDone(move.move_id), 0.5)
    (d,) = p.release(0.5)
    assert isinstance(d, Dispatch) and d.reason == "pull"


def test_without_a_link_the_pull_is_not_made_and_the_reason_is_load() -> None:
    p = pulling_planner(TransferLink())
    p.admit(long_call(), 0.0)
    (d,) = p.release(0.0)
    assert isinstance(d, Dispatch) and d.reason == "load"
