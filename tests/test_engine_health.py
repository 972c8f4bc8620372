"""The pool's health checks: a busy engine that misses a check keeps its traffic, one that keeps
failing leaves rotation after `health_failure_threshold` checks, a refused connection at once.

A real aiohttp engine stub on 127.0.0.1 answers `/health` as the test sets it (200, 500, or too
late for the check's deadline); `gateway.pool.EnginePool` checks it over a real socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from gateway.config import EngineEntry
from gateway.pool import EnginePool
from kvgate.procs import free_port
from planner.events import EngineHealth, EngineScraped, Event


class Stub:
    """`/health` and `/v1/models` of an engine whose health answer the test chooses."""

    def __init__(self) -> None:
        self.answer = "ok"  # "ok", "error" or "slow"
        self.port = free_port()
        self.runner: web.AppRunner | None = None
        self.on_scrape: Callable[[], None] = lambda: None
        """Runs while the engine answers a scrape (the test's gateway work in between)."""

    async def health(self, _: web.Request) -> web.Response:
        if self.answer == "slow":
            await asyncio.sleep(3.0)  # past the check's 1 s deadline
        return web.Response(status=200 if self.answer == "ok" else 500)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        self.on_scrape()
        return web.Response(text="vllm:num_requests_running 2\nvllm:num_requests_waiting 0\n")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    s = Stub()
    await s.start()
    yield s
    if s.runner is not None:
        await s.stop()


def pool_of(stub: Stub, session: aiohttp.ClientSession, threshold: int,
            notify: Callable[[Event], None] = lambda _: None) -> EnginePool:
    """A pool checking the stub alone, as engine "e"."""
    return EnginePool([EngineEntry(url=f"http://127.0.0.1:{stub.port}", name="e")], session,
                      scrape_interval_s=10.0, health_interval_s=0.5, notify=notify,
                      health_failure_threshold=threshold)


async def checked(pool: EnginePool, times: int) -> list[bool]:
    """Health after each of `times` checks."""
    seen = []
    for _ in range(times):
        await pool.refresh("e")
        seen.append(pool.engines["e"].healthy)
    return seen


@pytest.mark.parametrize("answer", ["error", "slow"])
async def test_an_engine_leaves_rotation_after_the_threshold_of_failed_checks(
        stub: Stub, answer: str) -> None:
    events: list[EngineHealth] = []
    async with aiohttp.ClientSession() as session:
        pool = pool_of(stub, session, 3, lambda e: events.append(e)
                       if isinstance(e, EngineHealth) else None)
        assert await checked(pool, 1) == [True]
        stub.answer = answer
        assert await checked(pool, 3) == [True, True, False]
        assert [e.healthy for e in events] == [True, False]
        # One good answer brings it back and starts the count again.
        stub.answer = "ok"
        assert await checked(pool, 1) == [True]
        stub.answer = answer
        assert await checked(pool, 2) == [True, True]


async def test_a_refused_connection_takes_an_engine_out_at_once(stub: Stub) -> None:
    async with aiohttp.ClientSession() as session:
        pool = pool_of(stub, session, 3)
        assert await checked(pool, 1) == [True]
        await stub.stop()
        stub.runner = None
        assert await checked(pool, 1) == [False]


async def test_a_threshold_of_one_takes_out_an_engine_on_its_first_miss(stub: Stub) -> None:
    async with aiohttp.ClientSession() as session:
        pool = pool_of(stub, session, 1)
        assert await checked(pool, 1) == [True]
        stub.answer = "error"
        assert await checked(pool, 1) == [False]


async def test_an_engine_that_never_passes_is_named_once_per_reason(
        stub: Stub, caplog: pytest.LogCaptureFixture) -> None:
    # An engine that was never healthy (a URL the checks miss, a key it refuses) used to be
    # said only at debug level: the pool sat empty with nothing in the log.
    stub.answer = "error"
    async with aiohttp.ClientSession() as session:
        pool = pool_of(stub, session, 3)
        with caplog.at_level(logging.WARNING, logger="gateway.pool"):
            assert await checked(pool, 3) == [False, False, False]
            stub.answer = "ok"
            assert await checked(pool, 1) == [True]
            stub.answer = "error"
            assert await checked(pool, 4) == [True, True, False, False]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"engine e is not in rotation: GET http://127.0.0.1:{stub.port}/health "
                    "answered 500", "engine e failed its health check"], said


async def test_a_scrape_carries_the_planners_finish_count_from_when_it_was_sent(
        stub: Stub) -> None:
    # A request of the gateway's that finishes while the scrape is on its way may still be
    # counted as running in it; the planner tells it from other clients' load by the count
    # of finishes read as the scrape went out (planner/core.py, EngineScraped).
    finished = {"e": 3}
    stub.on_scrape = lambda: finished.update(e=4)
    events: list[EngineScraped] = []
    async with aiohttp.ClientSession() as session:
        pool = EnginePool([EngineEntry(url=f"http://127.0.0.1:{stub.port}", name="e")], session,
                          scrape_interval_s=10.0, health_interval_s=0.5,
                          notify=lambda e: events.append(e) if isinstance(e, EngineScraped)
                          else None, finished_at=finished.get)
        await pool.refresh("e")
    assert [(e.num_running, e.finished_before) for e in events] == [(2, 3)]
