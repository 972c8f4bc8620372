"""A policy that holds requests (dynamo-like's router queue) holds them in the live gateway."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from gateway.errors import EngineTimeout
from gateway.later import Later
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.tracing import Tracing
from kvgate.procs import Child, wait_healthy
from planner.core import Planner
from planner.events import EngineJoined, EngineScraped
from planner.policies.dynamo_like import DynamoKvRouter
from planner.policy import Hold, RouteRequest
from planner.profiles import get_profile
from tests.conftest import ThreadedServer

# Two 40,000-token prompts put more than dynamo's queue threshold (16) x cpu-tiny's 4,096 batched
# tokens of prefill on the only engine: every engine is backed up, so the next request is held.
PROMPT_TOKENS = 40_000


class GatedEngine:
    """An OpenAI-speaking upstream that answers the first `gated` requests only when told."""

    def __init__(self, gated: int) -> None:
        self.gated = gated
        self.arrived: list[str] = []
        self.gate = threading.Event()
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/v1/completions", self.complete)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "gated", "object": "model"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def complete(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.arrived.append(body["user"])
        if len(self.arrived) <= self.gated:
            await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, 30)
        return web.json_response({"id": body["user"], "object": "text_completion",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})


def send(url: str, name: str, token: int = 7) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": "gated", "prompt": [token] * PROMPT_TOKENS, "max_tokens": 1,
                       "user": name}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


@pytest.fixture
def gated_gateway(
    threaded_server: Callable[[web.Application], ThreadedServer],
    spawn_gateway: Callable[[dict[str, Any]], Child],
) -> Callable[..., tuple[GatedEngine, Child]]:
    def start(request_timeout_s: float, policy: str = "dynamo-like") -> tuple[GatedEngine, Child]:
        engine = GatedEngine(gated=2)
        server = threaded_server(engine.app)
        gw = spawn_gateway({"engines": [{"url": server.url, "profile": "cpu-tiny"}],
                            "policy": policy, "request_timeout_s": request_timeout_s})
        wait_healthy(gw)
        return engine, gw

    threshold = DynamoKvRouter().queue_threshold
    assert threshold is not None
    budget = get_profile("cpu-tiny").max_num_batched_tokens
    assert 2 * PROMPT_TOKENS > threshold * budget > PROMPT_TOKENS
    return start


def test_held_request_reaches_the_engine_only_once_another_finishes(
    gated_gateway: Callable[..., tuple[GatedEngine, Child]],
) -> None:
    engine, gw = gated_gateway(60.0)
    with ThreadPoolExecutor(3) as pool:
        first: list[Future[tuple[int, dict[str, Any]]]] = [
            pool.submit(send, gw.url, name) for name in ("a", "b")]
        wait_for(lambda: len(engine.arrived) == 2)
        held = pool.submit(send, gw.url, "c")
        time.sleep(1.0)
        assert sorted(engine.arrived) == ["a", "b"] and not held.done()
        engine.gate.set()
        status, body = held.result(30)
        assert (status, body["id"]) == (200, "c")
        assert [f.result(30)[0] for f in first] == [200, 200]
    assert engine.arrived[2] == "c"


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def test_kvgate_buffers_in_the_gateway_while_every_engine_is_backed_up(
    gated_gateway: Callable[..., tuple[GatedEngine, Child]],
) -> None:
    # Batch release: one 40,000-token prompt is more than 2 full prefill steps (cpu-tiny's
    # 4,096 batched tokens) waiting at the only engine, so the next ones wait in the buffer and
    # go out in arrival order as the engine drains. (Three different prompts: a repeat of one
    # just sent would be a cached continuation, which never waits.)
    engine, gw = gated_gateway(60.0, "kvgate")
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(send, gw.url, "a", 7)]
        wait_for(lambda: len(engine.arrived) == 1)
        futures.append(pool.submit(send, gw.url, "b", 8))
        wait_for(lambda: metric(gw.url, "kvgate_planner_buffered") == 1.0)
        futures.append(pool.submit(send, gw.url, "c", 9))
        wait_for(lambda: metric(gw.url, "kvgate_planner_buffered") == 2.0)
        assert engine.arrived == ["a"] and not any(f.done() for f in futures)
        engine.gate.set()
        results = [f.result(30) for f in futures]
    assert [(status, body["id"]) for status, body in results] == [
        (200, "a"), (200, "b"), (200, "c")]
    assert engine.arrived == ["a", "b", "c"]
    assert metric(gw.url, "kvgate_planner_buffered") == 0.0


# The live engine's own reads are bounded by the same request_timeout_s, so an engine that stays
# backed up longer than a held request may wait cannot be staged end to end: the wait itself is
# checked on the proxy.

class _AlwaysHold:
    """A policy that holds every request (every engine backed up, for as long as it takes)."""

    name = "always-hold"
    speculative_entries = False

    def choose(self, request: RouteRequest, engines: Any, now: float) -> str:
        raise Hold("every engine is backed up")

    def on_dispatch(self, request: RouteRequest, placement: Any, now: float) -> None:
        pytest.fail("a held request was dispatched")

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Nothing to learn."""

    def on_finish(self, request_id: str, engine: str, now: float, output_tokens: int = 0) -> None:
        """Nothing to forget."""


class _State:
    """The slice of GatewayState the proxy's placing uses, around a real Planner."""

    def __init__(self, request_timeout_s: float) -> None:
        self.config = SimpleNamespace(request_timeout_s=request_timeout_s)
        self.planner = Planner(_AlwaysHold())
        self.planner.on_event(EngineJoined("e", healthy=True, models=frozenset({"m"})), 0.0)
        self.metrics = GatewayMetrics()
        self.tracing = Tracing.off()
        self.later = Later()
        self.pump: Callable[[], None] = lambda: None

    def now(self) -> float:
        return 0.0

    def notify(self, event: Any) -> None:
        self.planner.on_event(event, 0.0)
        if self.planner.pending:
            self.pump()


def held_proxy(request_timeout_s: float) -> tuple[Proxy, Planner]:
    state = _State(request_timeout_s)
    return Proxy(state), state.planner  # type: ignore[arg-type]


def test_held_request_times_out_with_a_504_naming_the_hold() -> None:
    proxy, planner = held_proxy(0.05)
    route_req = RouteRequest(request_id="r", model="m")
    with pytest.raises(EngineTimeout, match=r"held at the gateway for request_timeout_s=0\.05"):
        asyncio.run(proxy._place(route_req, set()))
    assert planner.held == 0 and not planner.knows("r")


def test_client_hang_up_removes_its_held_request() -> None:
    proxy, planner = held_proxy(60.0)
    route_req = RouteRequest(request_id="r", model="m")

    async def hang_up() -> None:
        waiting = asyncio.create_task(proxy._place(route_req, set()))
        await asyncio.sleep(0)
        assert planner.held == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(hang_up())
    assert planner.held == 0 and not planner.knows("r")
    # Load changes: nothing is offered to the policy any more (it would fail the test).
    planner.on_event(EngineScraped("e", 0, 0, 0.0), 1.0)
    assert planner.release(1.0) == []


class _HoldUntilFreed(_AlwaysHold):
    """Holds every request until `freed`, then places it on the one engine."""

    freed = False

    def choose(self, request: RouteRequest, engines: Any, now: float) -> str:
        if not self.freed:
            raise Hold("every engine is backed up")
        return "e"

    def on_dispatch(self, request: RouteRequest, placement: Any, now: float) -> None:
        """Placed."""


def test_a_call_released_as_its_client_hangs_up_is_undone() -> None:
    # The client hangs up (its handler is cancelled, and so is the future it awaits) and,
    # before the handler runs again, a release places the call: the placement is undone,
    # not left at the engine forever, and the release goes on with the other calls.
    state = _State(60.0)
    policy = _HoldUntilFreed()
    state.planner = Planner(policy)  # type: ignore[arg-type]
    state.planner.on_event(EngineJoined("e", healthy=True, models=frozenset({"m"})), 0.0)
    proxy = Proxy(state)  # type: ignore[arg-type]
    planner = state.planner

    async def race() -> str:
        gone = asyncio.create_task(proxy._place(RouteRequest(request_id="gone", model="m"),
                                                set()))
        stays = asyncio.create_task(proxy._place(RouteRequest(request_id="stays", model="m"),
                                                 set()))
        await asyncio.sleep(0)
        assert planner.held == 2
        gone.cancel()
        policy.freed = True
        planner.on_event(EngineScraped("e", 0, 0, 0.0), 1.0)
        proxy._pump()  # before `gone`'s handler has run again
        with pytest.raises(asyncio.CancelledError):
            await gone
        return (await stays).engine

    assert asyncio.run(race()) == "e"
    assert not planner.knows("gone") and planner.knows("stays")
    [view] = planner.views()
    assert view.in_flight == 1  # `stays` alone

