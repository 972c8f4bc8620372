"""The gateway's deferred bookkeeping (gateway/later.py): order, when it runs, and that a
failing item costs nothing else."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.later import Later


async def test_items_run_in_order_at_the_backstop_when_nothing_flushes_sooner() -> None:
    later = Later(backstop_s=0.01)
    ran: list[int] = []
    for i in range(3):
        later(ran.append, i)
    assert ran == [] and later.pending == 3
    await asyncio.sleep(0.05)
    assert ran == [0, 1, 2] and later.pending == 0


async def test_a_flush_runs_everything_waiting_and_cancels_the_backstop() -> None:
    later = Later(backstop_s=0.01)
    ran: list[str] = []
    later(ran.append, "a")
    later.flush()
    assert ran == ["a"]
    await asyncio.sleep(0.03)
    assert ran == ["a"]
    later(ran.append, "b")  # a new backstop for what arrives after the flush
    await asyncio.sleep(0.03)
    assert ran == ["a", "b"]


async def test_a_full_queue_runs_at_once() -> None:
    later = Later(backstop_s=60, max_pending=4)
    ran: list[int] = []
    for i in range(9):
        later(ran.append, i)
    assert ran == list(range(8)) and later.pending == 1
    later.flush()
    assert ran == list(range(9))


async def test_an_item_that_fails_is_logged_and_the_rest_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    later = Later(backstop_s=60)
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("exporter down")

    later(ran.append, 1)
    later(boom)
    later(ran.append, 2)
    with caplog.at_level(logging.ERROR, logger="gateway.later"):
        later.flush()
    assert ran == [1, 2]
    assert "deferred bookkeeping failed" in caplog.text and "exporter down" in caplog.text


async def test_an_item_added_while_flushing_runs_later_not_lost() -> None:
    later = Later(backstop_s=0.01)
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        later(ran.append, "second")

    later(first)
    later.flush()
    assert ran == ["first"] and later.pending == 1
    await asyncio.sleep(0.03)
    assert ran == ["first", "second"]


def test_without_an_event_loop_items_run_at_once() -> None:
    later = Later()
    ran: list[int] = []
    later(ran.append, 7)
    assert ran == [7] and later.pending == 0
