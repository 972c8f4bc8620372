"""The gateway's aiohttp application: proxy, admin API, health and metrics."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.admin import Admin
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, IndexAway
from gateway.metrics import IngestCollector
from gateway.proxy import PROXIED, Proxy, expect_within
from gateway.state import GatewayState
from gateway.tenants import TENANT_KEY, NotPermitted
from gateway.tracing import TRACE_SINCE_KEY
from gateway.ui import TimelineUI
from gateway.workflow_store import make_store
from gateway.workflows import LoopbackExecutor, TaskExecutor, WorkflowService, loopback_url
from kvindex.index import IndexStats, IndexUnavailable

log = logging.getLogger(__name__)

STATE_KEY = web.AppKey("state", GatewayState)


def _route_label(request: web.Request) -> str:
    """The route a request matched, as declared (`/v1/workflows/{id}`): a label value from a
    bounded set, whatever path a client sends."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


_OPERATOR_READS = ("/v1/workflows", "/v1/traces", "/v1/models")


@web.middleware
async def _tenants(request: web.Request, handler: Any) -> web.StreamResponse:
    """With tenants configured: whom each `/v1/` call is from (gateway/tenants.py)."""
    path = request.path
    if path.startswith("/v1/"):
        state = request.app[STATE_KEY]
        tenant = state.tenancy.resolve(request.headers)
        if tenant.operator:
            if not path.startswith(_OPERATOR_READS) or (
                    request.method == "POST" and path == "/v1/workflows"):
                raise NotPermitted("the admin key reads and cancels workflows and reads "
                                   "traces; calls need a tenant's key")
        else:
            # By the route matched (its id decoded), not the path's text: an id may hold `/`.
            route = _route_label(request)
            if route.startswith("/v1/traces"):
                raise NotPermitted("traces show every tenant's calls: they need the admin key")
            if route == "/v1/workflows/{id}/trace" and state.workflows is not None:
                # A workflow's own trace holds its own calls: its tenant may read it. Only
                # this workflow's: a hint-mode id another tenant used before (its record long
                # expired) names that tenant's spans too.
                snap = await state.workflows.snapshot(request.match_info["id"], tenant)
                created = snap.get("created_s")
                if isinstance(created, int | float):
                    request[TRACE_SINCE_KEY] = int(created * 1e9)
        request[TENANT_KEY] = tenant
    resp: web.StreamResponse = await handler(request)
    return resp


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every answer counted in `kvgate_requests_total` (the proxy counts its own calls'
    answers, which it may cut short mid-stream), and every error an OpenAI-shaped body."""
    state = request.app[STATE_KEY]
    try:
        resp: web.StreamResponse = await handler(request)
    except GatewayError as e:
        state.metrics.requests.labels(_route_label(request), str(e.status)).inc()
        return e.response()
    except web.HTTPException as e:
        state.metrics.requests.labels(_route_label(request), str(e.status)).inc()
        if e.status < 400:
            raise
        err = GatewayError(e.reason or "error")
        err.status = e.status
        err.err_type = "invalid_request_error" if e.status < 500 else "server_error"
        return err.response()
    except IndexUnavailable as e:  # an admin read of the index while Redis is away
        state.index_failed(e)
        state.metrics.requests.labels(_route_label(request), "503").inc()
        return IndexAway(str(e)).response()
    except Exception:
        log.exception("unhandled error on %s", request.path)
        state.metrics.requests.labels(_route_label(request), "500").inc()
        return GatewayError("internal gateway error; see the gateway log").response()
    if PROXIED not in request:
        state.metrics.requests.labels(_route_label(request), str(resp.status)).inc()
    return resp


def build_app(config: GatewayConfig, executor: TaskExecutor | None = None) -> web.Application:
    """The gateway application for a validated config; workflow tasks go through `executor`
    (default: the gateway's own `/v1/chat/completions`)."""
    state = GatewayState(config)
    proxy = Proxy(state)
    wf = config.workflows
    workflows = WorkflowService(
        wf, make_store(wf.store, wf.redis_url, wf.namespace),
        executor or LoopbackExecutor(loopback_url(config.host, config.port),
                                     config.connect_timeout_s, config.request_timeout_s),
        replica=wf.replica or f"{socket.gethostname()}:{config.port}",
        known_models=state.planner.models, notify=state.notify, tracing=state.tracing,
        call_limit=config.max_body_bytes,
    )
    state.workflows = workflows
    # The proxy enforces max_body_bytes itself with a clear error; aiohttp's own limit stays off.
    middlewares = [_errors, _tenants] if state.tenancy.enabled else [_errors]
    app = web.Application(middlewares=middlewares, client_max_size=0)
    app[STATE_KEY] = state
    index_stats = IndexStats(keys=0, entries=0, speculative_entries=0, engines=0)

    def ingest_figures() -> tuple[dict[str, int], dict[str, int]]:
        counters = dict(asdict(state.ingestor.stats))
        if state.listener is not None:
            counters["malformed_messages"] = state.listener.malformed_messages
            counters["unknown_topic_messages"] = state.listener.unknown_topic_messages
        return counters, {k: v for k, v in asdict(index_stats).items()}

    state.metrics.registry.register(IngestCollector(ingest_figures))

    async def models(_: web.Request) -> web.Response:
        assert state.pool is not None
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvgate"}
                for m in state.planner.models()]
        return web.json_response({"object": "list", "data": data})

    async def health(_: web.Request) -> web.Response:
        assert state.pool is not None
        engines = {v.name: v.healthy for v in state.planner.views()}
        ok = any(engines.values())
        return web.json_response(
            {"status": "ok" if ok else "no healthy engine", "engines": engines},
            status=200 if ok else 503,
        )

    async def livez(_: web.Request) -> web.Response:
        # Alive while the event loop answers: no I/O and no key (a liveness probe that read
        # an engine or Redis would restart the gateway during their outages, and one on a
        # `/v1/` route gets 401 once tenants are configured).
        return web.json_response({"status": "alive"})

    async def metrics(_: web.Request) -> web.Response:
        nonlocal index_stats
        assert state.pool is not None
        state.later.flush()
        for v in state.planner.views():
            state.metrics.healthy.labels(v.name).set(1 if v.healthy else 0)
        state.metrics.buffered.set(state.planner.buffered)
        state.metrics.held.set(state.planner.held)
        try:
            index_stats = await state.index.stats()
            await state.metrics.segments.refresh(state.index, state.now())
        except IndexUnavailable as e:  # the figures of the index stay as last read
            state.index_failed(e)
        return web.Response(body=generate_latest(state.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def counted(request: web.Request, status: int) -> None:
        state.metrics.requests.labels(_route_label(request), str(status)).inc()

    calls = expect_within(lambda: config.max_body_bytes, counted)
    app.router.add_post("/v1/chat/completions", proxy.handle, expect_handler=calls)
    app.router.add_post("/v1/completions", proxy.handle, expect_handler=calls)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/livez", livez)
    app.router.add_get("/metrics", metrics)
    Admin(state, proxy).routes(app)
    workflows.routes(app, expect_within(lambda: config.workflows.max_body_bytes, counted))
    TimelineUI().routes(app)
    state.tracing.routes(app)

    async def on_startup(_: web.Application) -> None:
        await state.start()
        await workflows.start()

    async def on_shutdown(_: web.Application) -> None:
        # Before the server waits for the requests in flight: a workflow's task calls are
        # among them, and they end only when the workflow stops (or is handed over).
        await workflows.stop_runs()

    async def on_cleanup(_: web.Application) -> None:
        await workflows.stop()
        await state.stop()
        state.later.flush()
        await asyncio.to_thread(state.tracing.shutdown)  # sends the spans still buffered

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def exposure_warnings(config: GatewayConfig) -> list[str]:
    """What a bind beyond this machine opens up, said at start-up (the default binds
    127.0.0.1; another address is a choice, but one to make knowingly)."""
    out = []
    if not _loopback(config.host) and not config.tenants:
        out.append(f"listening on {config.host} with no tenants configured: anyone who reaches "
                   "it can call the engines and read or cancel every workflow and trace "
                   "(configure tenants, or bind 127.0.0.1)")
    bind = config.kv_events_bind
    if bind is not None and bind.startswith("tcp://") and not _loopback(
            bind[len("tcp://"):].rpartition(":")[0].strip("[]")):
        out.append(f"KV events are taken from anyone who reaches {bind}: a sender can make "
                   "the index claim blocks no engine holds (bind it on a private network)")
    return out


def run(config: GatewayConfig) -> None:
    """Serve the gateway until interrupted."""

    def make() -> web.Application:
        log.info("kvgate gateway on http://%s:%d, policy %s, %d engines", config.host,
                 config.port, config.policy, len(config.engines))
        for warning in exposure_warnings(config):
            log.warning("%s", warning)
        return build_app(config)

    serve(make, config.host, config.port)


def serve(make: Callable[[], web.Application], host: str, port: int) -> None:
    """Build an app on a fresh event loop (uvloop when available) and serve it until
    interrupted, as the gateway serves: a client that hangs up cancels its handler, which
    closes the upstream connection, so the engine aborts the request instead of generating
    for nobody."""
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    app = make()
    # What start-up loaded (the tokenizer, transformers, the config) lives as long as the
    # process: freezing it keeps the collector's full passes to what requests allocate (one
    # full pass over the start-up heap took 80-200 ms here, a stall every call in flight felt).
    gc.collect()
    gc.freeze()
    web.run_app(app, host=host, port=port, print=None, access_log=None, loop=loop,
                handler_cancellation=True)
