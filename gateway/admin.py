"""Admin API (`/admin/...`): engines join and leave, and a view into the KV index.

Every endpoint needs `Authorization: Bearer <admin_key>`; without a configured key the admin API
is disabled.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from gateway.config import EngineEntry, same_engine
from gateway.errors import GatewayError, InvalidRequest
from gateway.kv_events import BadEndpoint
from gateway.proxy import Proxy, read_json
from gateway.state import GatewayState
from gateway.tenants import bearer


class AdminDisabled(GatewayError):
    """No admin key is configured."""

    status = 403
    err_type = "permission_error"
    code = "admin_disabled"


class Unauthorized(GatewayError):
    """Missing or wrong admin key."""

    status = 401
    err_type = "authentication_error"
    code = "invalid_admin_key"


class EngineNotFound(GatewayError):
    """The named engine is not in the pool."""

    status = 404
    err_type = "invalid_request_error"
    code = "engine_not_found"


class EngineExists(GatewayError):
    """An engine with that name is already in the pool."""

    status = 409
    err_type = "invalid_request_error"
    code = "engine_exists"


class Admin:
    """Handlers of the admin API."""

    def __init__(self, state: GatewayState, proxy: Proxy) -> None:
        self.state = state
        self.proxy = proxy

    def _authorize(self, request: web.Request) -> None:
        key = self.state.config.admin_key
        if not key:
            raise AdminDisabled("the admin API is disabled: set admin_key in the gateway config")
        given = bearer(request.headers) or ""
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   key.encode("utf-8", "surrogateescape")):
            raise Unauthorized("admin endpoints need Authorization: Bearer <admin_key>")

    async def list_engines(self, request: web.Request) -> web.Response:
        """GET /admin/engines: every engine with its state and index figures."""
        self._authorize(request)
        state = self.state
        assert state.pool is not None
        out: list[dict[str, Any]] = []
        for v in state.planner.views():
            # Read before the index is awaited: another admin call may remove the engine
            # meanwhile (it used to be a KeyError, a 500).
            pooled = state.pool.engines.get(v.name)
            if pooled is None:
                continue
            out.append({
                "name": v.name, "url": pooled.url, "healthy": v.healthy,
                "models": sorted(v.models), "running": v.num_running, "waiting": v.num_waiting,
                "kv_usage": v.kv_usage, "in_flight": v.in_flight,
                "process_start_time": pooled.start_time,
                "index_keys": await state.index.engine_key_count(v.name),
                "mapped_engine_blocks": state.ingestor.engine_blocks(v.name),
                "last_event_seq": state.ingestor.last_seq(v.name),
            })
        return web.json_response({"engines": out})

    async def add_engine(self, request: web.Request) -> web.Response:
        """POST /admin/engines {url, name?, profile?, kv_events?, kv_replay?, kv_topic?}."""
        self._authorize(request)
        _, body = await read_json(request, 64 * 1024)
        try:
            entry = EngineEntry.model_validate(body)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                for err in e.errors()
            )
            raise InvalidRequest(f"invalid engine: {problems}") from None
        assert self.state.pool is not None
        if entry.engine_name in self.state.pool.engines:
            raise EngineExists(f"engine {entry.engine_name!r} is already in the pool")
        clash = same_engine(entry.url, [e.url for e in self.state.pool.engines.values()])
        if clash:
            raise EngineExists(clash)
        try:
            await self.state.add_engine(entry)
        except BadEndpoint as e:
            raise InvalidRequest(str(e), param="kv_events") from None
        except ValueError as e:
            raise EngineExists(str(e)) from None
        healthy = self.state.pool.engines[entry.engine_name].healthy
        return web.json_response({"name": entry.engine_name, "healthy": healthy}, status=201)

    async def remove_engine(self, request: web.Request) -> web.Response:
        """DELETE /admin/engines/{name}: stop routing to it and purge its index entries."""
        self._authorize(request)
        name = request.match_info["name"]
        if not await self.state.remove_engine(name):
            raise EngineNotFound(f"no engine named {name!r} in the pool or the index")
        return web.json_response({"removed": name})

    async def engine_index(self, request: web.Request) -> web.Response:
        """GET /admin/index/{name}: the index's confirmed keys for one engine."""
        self._authorize(request)
        name = request.match_info["name"]
        keys = await self.state.index.engine_keys(name)
        assert self.state.pool is not None
        if not keys and name not in self.state.pool.engines:
            # A typo read as "holds nothing"; an engine the pool dropped whose entries are
            # still in the index is answered (and DELETE purges it).
            raise EngineNotFound(f"no engine named {name!r} in the pool or the index")
        return web.json_response({
            "engine": name,
            "keys": {str(k): tiers for k, tiers in keys.items()},
            "mapped_engine_blocks": self.state.ingestor.engine_blocks(name),
            "last_event_seq": self.state.ingestor.last_seq(name),
        })

    async def match(self, request: web.Request) -> web.Response:
        """POST /admin/index/match?route=chat|completions with an OpenAI body: what matches."""
        self._authorize(request)
        _, body = await read_json(request, self.state.config.max_body_bytes)
        route = ("/v1/completions" if request.query.get("route") == "completions"
                 else "/v1/chat/completions")
        body.setdefault("model", "-")
        rr = await self.proxy.route_request(request, route, body, dispatched=False)
        # From the index itself: routing goes on without it while its store is away (and
        # matches nothing then), but this answer says what it holds, or 503.
        matches = await self.state.index.match(rr.block_keys, self.state.now()) \
            if rr.block_keys else {}
        return web.json_response({
            "prompt_tokens": rr.prompt_tokens,
            "blocks": len(rr.block_keys),
            "block_size": rr.block_size,
            "keys": [str(k) for k in rr.block_keys],
            "matches": {e: {"blocks": m.blocks, "confirmed_blocks": m.confirmed_blocks,
                            "weighted_blocks": m.weighted_blocks}
                        for e, m in matches.items()},
        })

    def routes(self, app: web.Application) -> None:
        """Register the admin routes."""
        app.router.add_get("/admin/engines", self.list_engines)
        app.router.add_post("/admin/engines", self.add_engine)
        app.router.add_delete("/admin/engines/{name}", self.remove_engine)
        app.router.add_get("/admin/index/{name}", self.engine_index)
        app.router.add_post("/admin/index/match", self.match)
