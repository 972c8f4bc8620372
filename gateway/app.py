"""The gateway's aiohttp application: OpenAI-compatible proxy, health and metrics.

Bodies are forwarded byte for byte (unknown fields survive) and responses are streamed back chunk
by chunk as the engine produces them. A request whose engine fails before answering is re-sent to
another engine; one whose engine dies mid-stream ends with an OpenAI-shaped error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.config import GatewayConfig
from gateway.errors import (
    BodyTooLarge,
    EngineFailed,
    EngineTimeout,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyEngine,
)
from gateway.metrics import GatewayMetrics
from gateway.pool import EnginePool
from planner.policy import NoEngineAvailable, RouteRequest, RoutingPolicy, make_policy

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and ones aiohttp recomputes are never forwarded.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Accept-Encoding",
        "Content-Encoding",
    )
)  # fmt: skip

ENGINE_HEADER = "x-kvgate-engine"



class GatewayState:
    """Everything the request handlers share: config, pool, policy, metrics, upstream session."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.policy: RoutingPolicy = make_policy(config.policy)
        self.metrics = GatewayMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.pool: EnginePool | None = None
        self.started = time.monotonic()

    async def start(self) -> None:
        """Open the upstream session and start watching the engines."""
        c = self.config
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=c.connect_timeout_s),
        )
        self.pool = EnginePool(c.engines, self.session, c.scrape_interval_s, c.health_interval_s)
        await self.pool.start()

    async def stop(self) -> None:
        """Stop background work and close upstream connections."""
        if self.pool is not None:
            await self.pool.stop()
        if self.session is not None:
            await self.session.close()

    def now(self) -> float:
        """The clock handed to the planner."""
        return time.monotonic() - self.started


STATE_KEY = web.AppKey("state", GatewayState)


def _forward_headers(headers: Any) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _HOP_BY_HOP:
            out.add(k, v)
    return out


async def _read_json(request: web.Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(
            f"request body is {request.content_length} bytes; the limit is {limit} bytes"
        )
    chunks = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return raw, body


class Proxy:
    """Forwards OpenAI calls to the engine the policy picks."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def _choose(self, route_req: RouteRequest, exclude: set[str]) -> str:
        pool = self.state.pool
        assert pool is not None
        views = [v for v in pool.views() if v.name not in exclude]
        t0 = time.perf_counter()
        try:
            name = self.state.policy.choose(route_req, views, self.state.now())
        except NoEngineAvailable as e:
            healthy_models = pool.models()
            if healthy_models and route_req.model not in pool.known_models():
                raise ModelNotFound(
                    f"The model `{route_req.model}` does not exist. Available models: "
                    f"{', '.join(healthy_models)}",
                    param="model",
                ) from None
            raise NoHealthyEngine(str(e)) from None
        finally:
            self.state.metrics.routing_time.observe(time.perf_counter() - t0)
        return name

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Validate, route and forward one OpenAI request."""
        state = self.state
        route = request.path
        arrived = time.monotonic()
        raw, body = await _read_json(request, state.config.max_body_bytes)
        model = body.get("model")
        if model is None:
            raise InvalidRequest("you must provide a model parameter", param="model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("`model` must be a non-empty string", param="model")
        # The client's x-request-id is forwarded untouched; vLLM uses it as its request id.
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        route_req = RouteRequest(request_id=request_id, model=model)
        headers = _forward_headers(request.headers)
        tried: set[str] = set()
        last_error = ""
        for _ in range(state.config.retries + 1):
            engine = self._choose(route_req, tried)
            tried.add(engine)
            try:
                return await self._forward(request, route, engine, raw, headers, arrived)
            except _RetryableFailure as e:
                last_error = str(e)
                state.metrics.retries.labels(engine).inc()
                log.warning("request %s: engine %s failed before answering (%s); retrying",
                            request_id, engine, e)
        raise NoHealthyEngine(
            f"every engine tried failed before answering ({', '.join(sorted(tried))}); "
            f"last error: {last_error}"
        )

    async def _forward(
        self,
        request: web.Request,
        route: str,
        engine: str,
        raw: bytes,
        headers: CIMultiDict[str],
        arrived: float,
    ) -> web.StreamResponse:
        state = self.state
        assert state.pool is not None and state.session is not None
        target = state.pool.engines[engine]
        metrics = state.metrics
        target.in_flight += 1
        metrics.in_flight.labels(engine).inc()
        metrics.routed.labels(engine).inc()
        timeout = aiohttp.ClientTimeout(
            total=None, connect=state.config.connect_timeout_s,
            sock_read=state.config.request_timeout_s,
        )
        try:
            try:
                upstream = await state.session.post(
                    f"{target.url}{route}", data=raw, headers=headers, timeout=timeout
                )
            except (TimeoutError, aiohttp.ClientConnectionError) as e:
                metrics.upstream_errors.labels(engine, "connect").inc()
                state.pool.mark_failed(engine, repr(e))
                raise _RetryableFailure(f"{engine}: {e!r}") from None
            try:
                return await self._relay(request, route, engine, upstream, arrived)
            finally:
                # Closing (not releasing) an unfinished response drops the connection, so the
                # engine sees the disconnect and aborts the request.
                upstream.close()
        finally:
            target.in_flight -= 1
            metrics.in_flight.labels(engine).dec()
            metrics.duration.labels(route).observe(time.monotonic() - arrived)

    async def _relay(
        self,
        request: web.Request,
        route: str,
        engine: str,
        upstream: aiohttp.ClientResponse,
        arrived: float,
    ) -> web.StreamResponse:
        state = self.state
        metrics = state.metrics
        metrics.time_to_first_byte.labels(route).observe(time.monotonic() - arrived)
        out_headers = _forward_headers(upstream.headers)
        out_headers[ENGINE_HEADER] = engine
        resp = web.StreamResponse(status=upstream.status, headers=out_headers)
        is_sse = upstream.content_type == "text/event-stream"
        try:
            await resp.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (TimeoutError, aiohttp.ClientPayloadError,
                        aiohttp.ClientConnectionError) as e:
                    await self._engine_died(resp, engine, e, is_sse)
                    metrics.requests.labels(route, "502").inc()
                    return resp
                if not chunk:
                    break
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("client went away during a response from %s", engine)
            metrics.requests.labels(route, "499").inc()
            return resp
        metrics.requests.labels(route, str(upstream.status)).inc()
        return resp

    async def _engine_died(
        self, resp: web.StreamResponse, engine: str, error: BaseException, is_sse: bool
    ) -> None:
        """The engine failed after the response started: tell the client as clearly as we can."""
        assert self.state.pool is not None
        kind = "timeout" if isinstance(error, asyncio.TimeoutError) else "mid-stream"
        self.state.metrics.upstream_errors.labels(engine, kind).inc()
        self.state.pool.mark_failed(engine, repr(error))
        log.warning("engine %s failed mid-response: %r", engine, error)
        if not is_sse:
            # A JSON body cannot carry an error after it started; a truncated body is the signal.
            resp.force_close()
            return
        err: GatewayError = (
            EngineTimeout(f"engine {engine} timed out mid-response")
            if kind == "timeout"
            else EngineFailed(f"engine {engine} failed mid-stream: {error!r}")
        )
        await resp.write(err.sse_event())
        await resp.write_eof()


class _RetryableFailure(Exception):
    """The engine failed before a single response byte reached the client."""


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except GatewayError as e:
        state.metrics.requests.labels(request.path, str(e.status)).inc()
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = GatewayError(e.reason or "error")
        err.status = e.status
        err.err_type = "invalid_request_error" if e.status < 500 else "server_error"
        return err.response()
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return GatewayError("internal gateway error; see the gateway log").response()


def build_app(config: GatewayConfig) -> web.Application:
    """The gateway application for a validated config."""
    state = GatewayState(config)
    proxy = Proxy(state)
    # The proxy enforces max_body_bytes itself with a clear error; aiohttp's own limit stays off.
    app = web.Application(middlewares=[_errors], client_max_size=0)
    app[STATE_KEY] = state

    async def models(_: web.Request) -> web.Response:
        assert state.pool is not None
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvgate"}
                for m in state.pool.models()]
        return web.json_response({"object": "list", "data": data})

    async def health(_: web.Request) -> web.Response:
        assert state.pool is not None
        engines = {v.name: v.healthy for v in state.pool.views()}
        ok = any(engines.values())
        return web.json_response(
            {"status": "ok" if ok else "no healthy engine", "engines": engines},
            status=200 if ok else 503,
        )

    async def metrics(_: web.Request) -> web.Response:
        assert state.pool is not None
        for v in state.pool.views():
            state.metrics.healthy.labels(v.name).set(1 if v.healthy else 0)
        return web.Response(body=generate_latest(state.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def on_startup(_: web.Application) -> None:
        await state.start()

    async def on_cleanup(_: web.Application) -> None:
        await state.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def run(config: GatewayConfig) -> None:
    """Serve the gateway until interrupted (uvloop when available)."""
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    app = build_app(config)
    log.info("kvgate gateway on http://%s:%d, policy %s, %d engines", config.host, config.port,
             config.policy, len(config.engines))
    # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream
    # connection, so the engine aborts the request instead of generating for nobody.
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                loop=loop, handler_cancellation=True)
