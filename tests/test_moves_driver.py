"""The live driver of KV moves (`gateway/moves.py`): however a move ends, the planner hears of it
(`TransferDone` / `TransferFailed`), and a copy keeps its origin's `cache_salt`. Against a real
HTTP server standing in for the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.metrics import GatewayMetrics
from gateway.moves import KvMover
from gateway.tracing import Tracing
from kvgate.procs import free_port
from planner.actions import Warm
from planner.events import Event, TransferDone, TransferFailed


class Engine:
    """Answers `/v1/completions` with `answer` (bytes), keeping each request's body."""

    def __init__(self) -> None:
        self.answer = b'{"id": "c", "choices": []}'
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self.hang = False

    async def complete(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        if self.hang:
            await asyncio.sleep(3600)
        return web.Response(body=self.answer, content_type="application/json")


class Store:
    """A workflow store that has gone away: listing a move in a task's record raises."""

    async def note_move(self, workflow: str, task: str, move: dict[str, Any]) -> None:
        raise ConnectionError("redis is away")


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()
    app = web.Application()
    app.router.add_post("/v1/completions", eng.complete)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # a hanging answer is not waited for
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    eng.url = f"http://127.0.0.1:{port}"
    yield eng
    await runner.cleanup()


async def run_warm(engine: Engine, salt: str | None, workflows: object = None) -> list[Event]:
    events: list[Event] = []
    async with aiohttp.ClientSession() as session:
        state = SimpleNamespace(
            metrics=GatewayMetrics(), tracing=Tracing.off(), session=session,
            pool=SimpleNamespace(engines={"e1": SimpleNamespace(url=engine.url)}),
            workflows=workflows, notify=events.append)
        mover = KvMover(state)  # type: ignore[arg-type]
        mover.remember("r1", "m", tuple(range(64)), ("wf", "t"), salt)
        mover.carry_out(Warm("w1", "e1", "r1", 32, (), "pace"))
        for _ in range(200):
            if events or (engine.hang and engine.bodies):
                break
            await asyncio.sleep(0.01)
        await mover.stop()
    return events


async def test_a_warm_up_keeps_its_origins_salt(engine: Engine) -> None:
    assert await run_warm(engine, "tenant-a") == [TransferDone("w1")]
    assert engine.bodies[0]["cache_salt"] == "tenant-a"
    assert engine.bodies[0]["prompt"] == list(range(32))
    assert await run_warm(engine, None) == [TransferDone("w1")]
    assert "cache_salt" not in engine.bodies[1]


async def test_an_answer_that_is_not_text_fails_the_move(engine: Engine) -> None:
    engine.answer = b"\xff\xfe not utf-8"
    events = await run_warm(engine, None)
    assert len(events) == 1 and isinstance(events[0], TransferFailed)
    assert "invalid JSON" in events[0].reason


async def test_a_store_that_cannot_list_the_move_does_not_keep_it_from_the_planner(
        engine: Engine) -> None:
    assert await run_warm(engine, None, Store()) == [TransferDone("w1")]


async def test_a_move_cut_short_by_a_stopping_gateway_still_ends_in_the_planner(
        engine: Engine) -> None:
    engine.hang = True
    events = await run_warm(engine, None)
    assert len(events) == 1 and isinstance(events[0], TransferFailed)
    assert "the gateway stopped" in events[0].reason
