"""Everything the gateway's handlers share, created at start-up from the config."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp

from adapters.vllm.http import engine_connector
from gateway.config import EngineEntry, GatewayConfig
from gateway.kv_events import EventSource, KVEventListener
from gateway.later import Later
from gateway.metrics import EngineCollector, EngineFigures, GatewayMetrics
from gateway.moves import KvMover
from gateway.pool import EnginePool
from gateway.tenants import Tenancy
from gateway.tracing import Tracing
from gateway.upstream import Upstream
from kvindex.index import (
    BlockKey,
    EngineMatch,
    IndexUnavailable,
    InMemoryIndex,
    KVIndexBackend,
)
from kvindex.ingest import EventIngestor
from kvindex.keys import PromptKeyer
from kvindex.tokenizer import Tokenizer
from planner.core import make_planner
from planner.events import Event
from planner.policy import PolicyContext, RoutingPolicy, scrape_interval

if TYPE_CHECKING:
    from gateway.workflows import WorkflowService

log = logging.getLogger(__name__)

INDEX_RETRY_S = 2.0
"""After an index call fails to reach its store, calls are routed without the index this long."""
INDEX_WARN_EVERY_S = 30.0
"""At most one warning this often while the index's store is away."""


class StartupFailure(Exception):
    """The gateway cannot start (a store it needs is unreachable): the message says which."""


def event_source(entry: EngineEntry) -> EventSource:
    """How the listener recognises (and, in connect mode, reaches) an engine's events."""
    return EventSource(entry.engine_name, entry.topic, entry.kv_events, entry.kv_replay)


def make_index(config: GatewayConfig) -> KVIndexBackend:
    """The configured index backend."""
    settings = config.index
    if settings.backend == "redis":
        from kvindex.redis_index import RedisIndex

        assert settings.redis_url is not None
        return RedisIndex.from_url(settings.redis_url, namespace=settings.namespace)
    return InMemoryIndex()


class GatewayState:
    """Config, engine pool, KV index and its ingestion, prompt keyer, planner, metrics, session."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.policy_context = PolicyContext(
            profiles={e.engine_name: e.engine_profile for e in config.engines},
            block_size=config.index.block_size,
            link=config.kv_transfer.transfer_link(),
            paced_engines={e.engine_name for e in config.engines if e.scheduler == "kvgate-pace"},
        )
        self.metrics = GatewayMetrics()
        self.later = Later()
        """Bookkeeping the answers do not wait for: spans and Prometheus figures of calls
        (gateway/later.py); flushed before anything reads them."""
        self.tracing = Tracing(config.tracing)
        """Spans of calls, KV moves and workflows, and their exporters (gateway/tracing.py)."""
        self.tracing.flush_pending = self.later.flush
        self.tenancy = Tenancy(config.tenants, config.admin_key)
        """Whom each `/v1/` call is from, with tenants configured (gateway/tenants.py)."""
        self.engine_authorization = (f"Bearer {config.engine_api_key}"
                                     if config.engine_api_key else None)
        """What the calls the gateway forwards say to the engines as `Authorization`."""
        self.tokenizer = Tokenizer.load(config.tokenizer)
        self.keyer = PromptKeyer(self.tokenizer, config.index.block_size)
        self.index: KVIndexBackend = make_index(config)
        self.ingestor = EventIngestor(
            config.index.block_size,
            # Only for the engines whose events this replica subscribes to (bind mode takes
            # every engine's; connect mode its `kv_events`): see KVEventListener.add_source.
            replay_available={e.engine_name for e in config.engines
                              if e.kv_replay and (config.kv_events_bind or e.kv_events)},
        )
        self.planner = make_planner(config.policy, self.policy_context,
                                    speculative_ttl_s=config.index.speculative_ttl_s,
                                    engine_block_size=self.ingestor.engine_block_size)
        """The brain: every placement decision and the gateway's ledger (planner/core.py)."""
        self.policy: RoutingPolicy = self.planner.policy
        self._priority_engines = {e.engine_name for e in config.engines
                                  if e.scheduling_policy == "priority"}
        self.pump: Callable[[], None] = lambda: None
        """Runs the planner's `release` and carries out its actions (set by the proxy)."""
        self.mover = KvMover(self)
        """Carries out the planner's KV moves (gateway/moves.py)."""
        self.workflows: WorkflowService | None = None
        """The workflow API (set by `build_app`); the proxy reports hint-mode calls to it."""
        self.listener: KVEventListener | None = None
        self.session: aiohttp.ClientSession | None = None
        self.upstream: Upstream | None = None
        """Forwarded calls' connections (gateway/upstream.py); `session` serves the rest."""
        self.pool: EnginePool | None = None
        self.started = time.monotonic()
        self._index_back_at = 0.0
        """While the index's store is away: when calls look it up again (monotonic s)."""
        self._index_warned_at = -INDEX_WARN_EVERY_S
        self.metrics.registry.register(EngineCollector(self.engine_figures))

    async def match(self, keys: Sequence[BlockKey], now: float) -> dict[str, EngineMatch]:
        """The engines holding a prefix of `keys`; none while the index's store (Redis) cannot
        be reached: calls are then routed without it, for `INDEX_RETRY_S` after each failure
        (a store that does not answer would otherwise hold every call for its timeout)."""
        if time.monotonic() < self._index_back_at:
            return {}
        try:
            return await self.index.match(keys, now)
        except IndexUnavailable as e:
            self.index_failed(e)
            return {}

    async def add_speculative(self, engine: str, keys: Sequence[BlockKey], now: float,
                              ttl_s: float) -> None:
        """Speculative index entries for a placed call; skipped while the store is away."""
        if time.monotonic() < self._index_back_at:
            return
        try:
            await self.index.add_speculative(engine, keys, now, ttl_s)
        except IndexUnavailable as e:
            self.index_failed(e)

    def index_failed(self, error: IndexUnavailable) -> None:
        """Count an index call that could not reach its store, warn (at most every
        `INDEX_WARN_EVERY_S`) and route without the index for `INDEX_RETRY_S`."""
        at = time.monotonic()
        self._index_back_at = at + INDEX_RETRY_S
        self.metrics.index_unavailable.inc()
        if at - self._index_warned_at >= INDEX_WARN_EVERY_S:
            self._index_warned_at = at
            log.warning("%s; routing calls without the KV index (tried again every %g s)",
                        error, INDEX_RETRY_S)

    async def start(self) -> None:
        """Reach the index's store, start listening for KV events first (so nothing is
        missed), then watch the engines."""
        c = self.config
        try:
            await self.index.ping()
        except IndexUnavailable as e:
            raise StartupFailure(f"{e} (index.redis_url {c.index.redis_url})") from None
        self.listener = KVEventListener(
            self.index, self.ingestor, [event_source(e) for e in c.engines], c.kv_events_bind
        )
        await self.listener.start()
        connector = engine_connector(limit=0, ttl_dns_cache=300)
        # Bodies pass through untouched, so never ask engines for a compressed encoding.
        # The gateway's own calls to engines (health checks, /v1/models, KV moves) carry the
        # engines' key when they run with vLLM's --api-key.
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers={"Accept-Encoding"},
            timeout=aiohttp.ClientTimeout(total=None, connect=c.connect_timeout_s),
            headers={"Authorization": f"Bearer {c.engine_api_key}"} if c.engine_api_key else None,
        )
        self.upstream = Upstream(c.connect_timeout_s, self.later.flush)
        self.pool = EnginePool(c.engines, self.session, scrape_interval(self.policy,
                                                                        c.scrape_interval_s),
                               c.health_interval_s, self.notify,
                               health_failure_threshold=c.health_failure_threshold,
                               finished_at=self.planner.finished_at)
        self.pool.on_restart = self.engine_restarted
        await self.pool.start()

    async def stop(self) -> None:
        """Stop background work and close connections."""
        self.later.flush()
        await self.mover.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.listener is not None:
            await self.listener.stop()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            await self.upstream.close()
        await self.index.close()

    def engine_figures(self) -> list[EngineFigures]:
        """Every engine's scraped load and prefix-cache counters, for `/metrics`."""
        engines = self.pool.engines if self.pool is not None else {}
        out = []
        for v in self.planner.views():
            e = engines.get(v.name)
            out.append(EngineFigures(
                v.name, v.num_running, v.num_waiting, v.kv_usage, v.prefilling,
                v.queued_prefill_tokens, e.prefix_queries if e is not None else 0.0,
                e.prefix_hits if e is not None else 0.0))
        return out

    def priority_engine(self, name: str) -> bool:
        """The engine runs `--scheduling-policy priority` (per its config entry)."""
        return name in self._priority_engines

    def notify(self, event: Event) -> None:
        """Tell the planner what happened, and carry out what that lets it decide. The events
        come from the answer's path (a first token, the end of a call): a planner bug there
        is logged, never let through to cut a client's answer."""
        try:
            self.planner.on_event(event, self.now())
        except Exception:
            log.exception("the planner failed on %r; the call goes on", event)
        if self.planner.pending:
            self.pump()

    def now(self) -> float:
        """The clock handed to the planner and the index (seconds since start)."""
        return time.monotonic() - self.started

    async def engine_restarted(self, name: str) -> None:
        """The engine process restarted: whatever the index held for it is gone."""
        assert self.listener is not None
        await self.listener.reset_engine(name, "engine process restarted (seen on /metrics)")

    async def add_engine(self, entry: EngineEntry) -> None:
        """An engine joins the pool at run time."""
        assert self.pool is not None and self.listener is not None
        self.listener.add_source(event_source(entry))  # raises on a topic already in use
        self.pool.add(entry)
        self.metrics.engine_joined(entry.engine_name)
        if entry.scheduling_policy == "priority":
            self._priority_engines.add(entry.engine_name)
        if entry.scheduler == "kvgate-pace":
            self.policy_context.paced_engines.add(entry.engine_name)
        self.policy_context.profiles[entry.engine_name] = entry.engine_profile
        await self.pool.refresh(entry.engine_name)

    async def remove_engine(self, name: str) -> bool:
        """An engine leaves the pool: stop routing to it and purge its index entries; False
        if neither the pool nor the index knows it. The purge of an engine the pool no
        longer holds is done again (one whose purge failed while the index's store was away
        answered 503, then 404 for good, and its entries stayed in the shared index): the
        caller asks again once the store is back."""
        assert self.pool is not None and self.listener is not None
        pooled = self.pool.remove(name)
        if pooled:
            self.policy_context.paced_engines.discard(name)
            self.metrics.forget_engine(name)
            with contextlib.suppress(IndexUnavailable):  # the purge below says so (503)
                await self.listener.remove_source(name)
        elif not await self.index.engine_key_count(name):
            return False
        await self.index.clear_engine(name)
        return True
