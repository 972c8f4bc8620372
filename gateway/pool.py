"""The live engine pool: health checks, model lists and `/metrics` scraping for every engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from adapters.vllm.metrics import MetricsParseError, parse_engine_load
from gateway.config import EngineEntry
from planner.ledger import GatewayLoad
from planner.policy import EngineView

log = logging.getLogger(__name__)


@dataclass
class EngineState:
    """Mutable live state of one engine, owned by the pool."""

    name: str
    url: str
    healthy: bool = False
    models: frozenset[str] = frozenset()
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    load: GatewayLoad = field(default_factory=GatewayLoad)
    """What the gateway has outstanding here (a fresh object when the engine is re-added)."""
    start_time: float | None = None
    prefix_queries: float = 0.0

    def view(self, block_size: int = 0) -> EngineView:
        """Immutable snapshot for the planner."""
        return EngineView(
            name=self.name,
            healthy=self.healthy,
            models=self.models,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv_usage,
            in_flight=self.load.in_flight,
            prefilling=self.load.prefilling,
            queued_prefill_tokens=self.load.queued_prefill_tokens,
            active_blocks=self.load.active_blocks,
            block_size=block_size,
        )


class EnginePool:
    """Keeps every engine's health, models and load fresh in the background."""

    def __init__(
        self,
        engines: list[EngineEntry],
        session: aiohttp.ClientSession,
        scrape_interval_s: float,
        health_interval_s: float,
    ) -> None:
        self.engines = {e.engine_name: EngineState(e.engine_name, e.url) for e in engines}
        self._session = session
        self._scrape_interval = scrape_interval_s
        self._health_interval = health_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self.on_restart: Callable[[str], Awaitable[None]] | None = None
        self.block_size_of: Callable[[str], int] = lambda _: 0
        """The engine's KV block size, as learnt from its events."""
        """Called when a scrape shows the engine process restarted (its cache is gone)."""

    def views(self) -> list[EngineView]:
        """Snapshots of every engine, in config order."""
        return [e.view(self.block_size_of(e.name)) for e in self.engines.values()]

    def models(self) -> list[str]:
        """Models served by at least one healthy engine, sorted."""
        return sorted({m for e in self.engines.values() if e.healthy for m in e.models})

    def known_models(self) -> set[str]:
        """Models any engine has ever reported, healthy or not."""
        return {m for e in self.engines.values() for m in e.models}

    def add(self, entry: EngineEntry) -> None:
        """Start tracking a new engine (unhealthy until its first health check passes)."""
        if entry.engine_name in self.engines:
            raise ValueError(f"engine {entry.engine_name!r} is already in the pool")
        self.engines[entry.engine_name] = EngineState(entry.engine_name, entry.url)

    def remove(self, name: str) -> bool:
        """Stop tracking an engine; False if it was not in the pool."""
        return self.engines.pop(name, None) is not None

    async def refresh(self, name: str) -> None:
        """Check one engine's health and load now."""
        state = self.engines.get(name)
        if state is not None:
            await self._check(state)
            if state.healthy:
                await self._scrape(state)

    def mark_failed(self, name: str, reason: str) -> None:
        """Take an engine out of rotation after a connection failure, until a health check."""
        state = self.engines.get(name)
        if state is None:
            return
        if state.healthy:
            log.warning("engine %s marked unhealthy: %s", name, reason)
        state.healthy = False

    async def refresh_all(self) -> None:
        """Check health and models of every engine once, concurrently."""
        await asyncio.gather(*(self._check(e) for e in self.engines.values()))
        await asyncio.gather(*(self._scrape(e) for e in self.engines.values() if e.healthy))

    async def start(self) -> None:
        """Do one refresh, then keep refreshing in the background."""
        await self.refresh_all()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self._health_interval, self._check_all)),
            loop.create_task(self._every(self._scrape_interval, self._scrape_all)),
        ]

    async def stop(self) -> None:
        """Cancel background refreshes."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _every(self, interval: float, job: object) -> None:
        assert callable(job)
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:  # a background refresh must never die
                log.exception("engine pool refresh failed")

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in list(self.engines.values())))

    async def _scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(e) for e in list(self.engines.values()) if e.healthy))

    async def _check(self, state: EngineState) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self._health_interval * 2))
        try:
            async with self._session.get(f"{state.url}/health", timeout=timeout) as r:
                ok = r.status == 200
            if ok:
                # Every time: adapters load at run time and a restarted engine may serve others.
                async with self._session.get(f"{state.url}/v1/models", timeout=timeout) as r:
                    body = await r.json()
                    state.models = frozenset(m["id"] for m in body.get("data", []))
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as e:
            ok = False
            log.debug("health check of %s failed: %r", state.name, e)
        if ok and not state.healthy:
            log.info("engine %s is healthy (models: %s)", state.name, ", ".join(state.models))
        if not ok and state.healthy:
            log.warning("engine %s failed its health check", state.name)
        state.healthy = ok and bool(state.models)

    async def _scrape(self, state: EngineState) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self._scrape_interval * 4))
        try:
            async with self._session.get(f"{state.url}/metrics", timeout=timeout) as r:
                text = await r.text()
            load = parse_engine_load(text)
        except (TimeoutError, aiohttp.ClientError, MetricsParseError) as e:
            log.debug("scrape of %s failed: %r", state.name, e)
            return
        restarted = (
            load.process_start_time is not None
            and state.start_time is not None
            and load.process_start_time != state.start_time
        ) or load.prefix_cache_queries < state.prefix_queries
        state.start_time = load.process_start_time
        state.prefix_queries = load.prefix_cache_queries
        state.num_running = load.num_running
        state.num_waiting = load.num_waiting
        state.kv_usage = load.kv_usage
        if restarted and self.on_restart is not None:
            log.warning("engine %s restarted: its prefix cache is empty again", state.name)
            await self.on_restart(state.name)
