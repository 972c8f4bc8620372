"""The live engine pool: health checks, model lists and `/metrics` scraping for every engine.

The pool does the I/O; what it learns goes to the planner as events (`EngineJoined`,
`EngineHealth`, `EngineScraped`, `EngineLeft`) through `notify`, and the planner's engine views
are what routing reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from adapters.vllm.metrics import MetricsParseError, parse_engine_load
from gateway.config import EngineEntry
from planner.events import EngineHealth, EngineJoined, EngineLeft, EngineScraped, Event

log = logging.getLogger(__name__)


def model_ids(body: object) -> tuple[frozenset[str], frozenset[str]]:
    """The model ids of an engine's `/v1/models` answer, and those of them that are LoRA
    adapters (vLLM names a base model as their `parent`); ValueError naming what is wrong."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ValueError("/v1/models did not answer {\"data\": [{\"id\": ...}, ...]}")
    return (frozenset(m["id"] for m in data),
            frozenset(m["id"] for m in data if m.get("parent") is not None))


@dataclass
class EngineState:
    """Mutable live state of one engine, owned by the pool."""

    name: str
    url: str
    healthy: bool = False
    models: frozenset[str] = frozenset()
    loras: frozenset[str] = frozenset()
    """Those of its models that are LoRA adapters."""
    start_time: float | None = None
    prefix_queries: float = 0.0
    """vLLM's `prefix_cache_queries_total` at the last scrape (tokens)."""
    prefix_hits: float = 0.0
    """vLLM's `prefix_cache_hits_total` at the last scrape."""
    failed_checks: int = 0
    down_reason: str | None = None
    """Why its last health check failed, as last logged (None while it passes)."""
    """Health checks failed in a row."""


class EnginePool:
    """Keeps every engine's health, models and load fresh in the background."""

    def __init__(
        self,
        engines: list[EngineEntry],
        session: aiohttp.ClientSession,
        scrape_interval_s: float,
        health_interval_s: float,
        notify: Callable[[Event], None] = lambda _: None,
        health_failure_threshold: int = 3,
        finished_at: Callable[[str], int | None] = lambda _: None,
    ) -> None:
        self.notify = notify
        """Where what the pool learns goes (the planner, through the gateway state)."""
        self.finished_at = finished_at
        """The planner's count of the gateway's requests finished at an engine, read as a
        scrape is sent (`EngineScraped.finished_before`)."""
        self.engines = {e.engine_name: EngineState(e.engine_name, e.url) for e in engines}
        for name in self.engines:
            notify(EngineJoined(name))
        self._session = session
        self._scrape_interval = scrape_interval_s
        self._health_interval = health_interval_s
        self._failure_threshold = health_failure_threshold
        self._tasks: list[asyncio.Task[None]] = []
        self.on_restart: Callable[[str], Awaitable[None]] | None = None
        """Called when a scrape shows the engine process restarted (its cache is gone)."""
        self.lora_models: frozenset[str] = frozenset()
        """Model ids some engine serves as a LoRA adapter: their KV is keyed with the
        adapter's name, as vLLM hashes it (`kvindex.keys.KeyExtras.lora_name`)."""

    def add(self, entry: EngineEntry) -> None:
        """Start tracking a new engine (unhealthy until its first health check passes)."""
        if entry.engine_name in self.engines:
            raise ValueError(f"engine {entry.engine_name!r} is already in the pool")
        self.engines[entry.engine_name] = EngineState(entry.engine_name, entry.url)
        self.notify(EngineJoined(entry.engine_name))

    def remove(self, name: str) -> bool:
        """Stop tracking an engine; False if it was not in the pool."""
        state = self.engines.pop(name, None)
        if state is None:
            return False
        if state.loras:
            self._refresh_loras()
        self.notify(EngineLeft(name))
        return True

    def _refresh_loras(self) -> None:
        self.lora_models = frozenset().union(*(e.loras for e in self.engines.values()))

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
            self.notify(EngineHealth(name, False))

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
        """One health check. A healthy engine leaves rotation when its port refuses
        connections (the process is gone) or after `health_failure_threshold` failed checks in
        a row (timeouts, error statuses): a busy engine whose API server misses one check's
        deadline keeps its traffic, as behind Kubernetes' `failureThreshold`."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self._health_interval * 2))
        refused = False
        reason = None
        try:
            async with self._session.get(f"{state.url}/health", timeout=timeout) as r:
                ok = r.status == 200
                if not ok:
                    reason = f"GET {state.url}/health answered {r.status}"
            if ok:
                # Every time: adapters load at run time and a restarted engine may serve others.
                async with self._session.get(f"{state.url}/v1/models", timeout=timeout) as r:
                    state.models, loras = model_ids(await r.json())
                if loras != state.loras:
                    state.loras = loras
                    self._refresh_loras()
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            ok = False
            refused = isinstance(e, aiohttp.ClientConnectorError)
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            log.debug("health check of %s failed: %r", state.name, e)
        if not ok and not state.healthy and reason != state.down_reason:
            # An engine that never passed (a URL with a path, a key it refuses) or whose
            # failure changed: said once per reason, not once per check.
            log.warning("engine %s is not in rotation: %s", state.name, reason)
        state.down_reason = None if ok else reason
        state.failed_checks = 0 if ok else state.failed_checks + 1
        if not ok and state.healthy and not refused \
                and state.failed_checks < self._failure_threshold:
            log.info("engine %s missed a health check (%d of %d in a row)", state.name,
                     state.failed_checks, self._failure_threshold)
            return
        if ok and not state.healthy:
            log.info("engine %s is healthy (models: %s)", state.name, ", ".join(state.models))
        if not ok and state.healthy:
            log.warning("engine %s failed its health check", state.name)
        state.healthy = ok and bool(state.models)
        if self.engines.get(state.name) is state:  # not removed while the check ran
            self.notify(EngineHealth(state.name, state.healthy, state.models))

    async def _scrape(self, state: EngineState) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self._scrape_interval * 4))
        finished_before = self.finished_at(state.name)
        try:
            async with self._session.get(f"{state.url}/metrics", timeout=timeout) as r:
                text = await r.text()
            load = parse_engine_load(text)
        except (TimeoutError, aiohttp.ClientError, MetricsParseError, UnicodeDecodeError) as e:
            log.debug("scrape of %s failed: %r", state.name, e)
            return
        restarted = (
            load.process_start_time is not None
            and state.start_time is not None
            and load.process_start_time != state.start_time
        ) or load.prefix_cache_queries < state.prefix_queries
        state.start_time = load.process_start_time
        state.prefix_queries = load.prefix_cache_queries
        state.prefix_hits = load.prefix_cache_hits
        if self.engines.get(state.name) is state:
            self.notify(EngineScraped(state.name, load.num_running, load.num_waiting,
                                      load.kv_usage, finished_before))
        if restarted and self.on_restart is not None:
            log.warning("engine %s restarted: its prefix cache is empty again", state.name)
            await self.on_restart(state.name)
