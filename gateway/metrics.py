"""The gateway's own Prometheus metrics (`kvgate_*`), in a registry per app.

Label values stay bounded: routes, engines of the pool, fixed reason and kind sets, and at
most `TOP_SEGMENTS` static segments.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvindex.index import BlockKey, KVIndexBackend
from planner.actions import Dispatch

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 900.0, 1200.0, 1800.0,
)  # fmt: skip
"""Up to 30 minutes: a call may run `request_timeout_s` (600 s by default) and wait as long
to be placed; with 300 s the top, every such call read as 300 s in a quantile."""


class GatewayMetrics:
    """Counters and histograms describing what the gateway did with each request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "Requests answered, by route and HTTP status.",
            ["route", "status"], registry=r,
        )
        self.routed = Counter(
            "kvgate_routed_requests", "Requests forwarded, by engine.", ["engine"], registry=r
        )
        self.retries = Counter(
            "kvgate_retries", "Requests re-sent to another engine after a connection failure.",
            ["engine"], registry=r,
        )
        self.index_unavailable = Counter(
            "kvgate_index_unavailable", "Index lookups and writes that could not reach the "
            "index's store (Redis): calls were routed without it meanwhile.", registry=r,
        )
        self.hints_clamped = Counter(
            "kvgate_hints_clamped", "Tenants' calls whose priority or deadline asked for more "
            "than the tenant may (raised to its priority_floor / min_deadline_s), by hint.",
            ["tenant", "hint"], registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Engine failures seen by the gateway, by kind.",
            ["engine", "kind"], registry=r,
        )
        self.in_flight = Gauge(
            "kvgate_engine_in_flight", "Requests the gateway has outstanding at each engine.",
            ["engine"], registry=r,
        )
        self.buffered = Gauge(
            "kvgate_planner_buffered", "Requests waiting in the planner's buffer (batch release: "
            "every engine backed up).", registry=self.registry)
        self.held = Gauge(
            "kvgate_planner_held", "Requests the routing policy holds at the gateway.",
            registry=self.registry)
        self.healthy = Gauge(
            "kvgate_engine_healthy", "1 if the engine passes health checks.", ["engine"],
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "kvgate_time_to_first_byte_seconds",
            "From request arrival to the engine's response head (status and headers).",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_to_first_token = Histogram(
            "kvgate_time_to_first_token_seconds",
            "From request arrival to the engine's first streamed event (streamed calls).",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds", "From request arrival to the last byte sent.",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.routed_prompt_tokens = Counter(
            "kvgate_routed_prompt_tokens", "Prompt tokens of requests routed, by engine.",
            ["engine"], registry=r,
        )
        self.routed_cached_tokens = Counter(
            "kvgate_routed_cached_tokens",
            "Prompt tokens the KV index expected the chosen engine to hold, by engine.",
            ["engine"], registry=r,
        )
        self.lookup_time = Histogram(
            "kvgate_prefix_lookup_seconds",
            "Tokenising and keying a prompt plus the index match, per request.",
            # Up to a second: a 100k-token prompt keys in about 0.14 s.
            buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                     0.5, 1.0), registry=r,
        )
        self.kv_moves = Counter(
            "kvgate_kv_moves", "KV moves the planner decided, by kind (transfer, warm), reason "
            "(pull, prefetch, replicate) and outcome (done, failed).",
            ["kind", "reason", "outcome"], registry=r,
        )
        self.kv_move_bytes = Counter(
            "kvgate_kv_move_bytes", "KV bytes the planner moved between engines (its estimate "
            "of the missing part), by reason.", ["reason"], registry=r,
        )
        self.kv_move_seconds = Histogram(
            "kvgate_kv_move_seconds", "From a move's start to its end, by kind.", ["kind"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.routing_time = Histogram(
            "kvgate_routing_decision_seconds", "Time the policy took to choose an engine.",
            buckets=(1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
            registry=r,
        )
        self.planner_wait = Histogram(
            "kvgate_planner_wait_seconds",
            "From a request's admission to the planner's decision to send it: time held or "
            "buffered at the gateway, and waiting for a KV move.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.placements = Counter(
            "kvgate_placements", "Placement decisions, by reason: prefix_hit, load, pull, "
            "disaggregate, prefetch, replicate (planner.actions.Dispatch.reason) or rejected.",
            ["reason"], registry=r,
        )
        self.segments = SegmentWatch()
        """Static segments seen lately, for `kvgate_static_segment_*` (refreshed per scrape)."""
        r.register(self.segments)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        """The series each call counts into, by metric and label values: prometheus_client's
        `labels` checks and converts its arguments and takes a lock on every call, several
        times per proxied call; `forget_engine` drops a removed engine's with its series."""
        self._left: set[str] = set()
        """Engines removed from the pool (until one joins again under the name): calls placed
        on them before they left count into no series, which would come back for good."""
        self._generation: dict[str, int] = {}
        """Per engine, how many times it left the pool (its series start again on return)."""
        self._counted_in: dict[str, int] = {}
        """Per call in flight, the generation of its engine's gauge it was counted in."""

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def dispatched(self, dispatch: Dispatch, prompt_tokens: int, block_keys: Sequence[BlockKey],
                   now: float) -> None:
        """Count a call sent to its engine: in flight there, routed, its prompt and cached
        tokens, its placement's reason, and the static segment its prompt starts with."""
        engine = dispatch.engine
        if engine in self._left:
            # Placed before it left: its series are gone, and stay gone; nor may its end be
            # taken from the gauge of the engine back under the name.
            self._counted_in[dispatch.request_id] = -1
            return
        child = self._child
        child(self.in_flight, engine).inc()
        self._counted_in[dispatch.request_id] = self._generation.get(engine, 0)
        child(self.routed, engine).inc()
        child(self.routed_prompt_tokens, engine).inc(prompt_tokens)
        child(self.routed_cached_tokens, engine).inc(dispatch.cached_tokens)
        child(self.placements, dispatch.reason).inc()
        ranges = dispatch.segments.ranges
        if ranges and ranges[0].kind == "static" and 0 < ranges[0].end <= len(block_keys):
            self.segments.observe(tuple(block_keys[:ranges[0].end]), now)

    def count(self, counter: Counter, *labels: str) -> None:
        """One more in `counter`'s series for `labels` (through the series cache, so
        `forget_engine` finds it); nothing for an engine that left the pool."""
        if labels and labels[0] in self._left:
            return
        self._child(counter, *labels).inc()

    def engine_joined(self, engine: str) -> None:
        """An engine (back) in the pool: its series are counted again."""
        self._left.discard(engine)

    def forget_engine(self, engine: str) -> None:
        """An engine left the pool: every series it labels goes (a pool whose engines come
        and go, as pods do, would otherwise grow them without end; Prometheus reads a counter
        that vanishes as ended, and the totals it scraped stay in its history)."""
        self._left.add(engine)
        self._generation[engine] = self._generation.get(engine, 0) + 1
        with contextlib.suppress(KeyError):
            self.healthy.remove(engine)
        per_engine = {id(m): m for m in (self.in_flight, self.routed, self.retries,
                                         self.routed_prompt_tokens, self.routed_cached_tokens,
                                         self.upstream_errors)}
        for key in [k for k in self._children if k[0] in per_engine and k[1][0] == engine]:
            del self._children[key]
            with contextlib.suppress(KeyError):
                per_engine[key[0]].remove(*key[1])

    def finished(self, engine: str, request_id: str | None = None) -> None:
        """A call at `engine` is over (nothing to count once the engine has left the pool:
        its gauge went with it; nor when it was counted before the engine left and came back,
        in a gauge that is gone: it took the new one below zero)."""
        counted = self._counted_in.pop(request_id, None) if request_id is not None else None
        if counted is not None and counted != self._generation.get(engine, 0):
            return
        child = self._children.get((id(self.in_flight), (engine,)))
        if child is not None:
            child.dec()

    def answered(self, route: str, status: int) -> None:
        """A call on `route` was answered with `status`."""
        self._child(self.requests, route, str(status)).inc()

    def observe(self, histogram: Histogram, route: str, seconds: float) -> None:
        """`seconds` into `histogram`'s series for `route`."""
        self._child(histogram, route).observe(seconds)


class IngestCollector(Collector):
    """Exports KV-event ingestion counters and index size, read at scrape time."""

    def __init__(self, read: Callable[[], tuple[dict[str, int], dict[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        """One counter per ingestion statistic, one gauge per index size figure."""
        counters, gauges = self._read()
        for name, value in counters.items():
            yield CounterMetricFamily(f"kvgate_kv_events_{name}", f"KV-event ingestion: {name}.",
                                      value=value)
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"kvgate_index_{name}", f"KV index size: {name}.",
                                    value=value)


TOP_SEGMENTS = 10
"""Static segments exported (the most called lately): a bound on label values."""

TRACKED_SEGMENTS = 1024
"""Static segments remembered at all (least recently called forgotten first)."""

SEGMENT_WINDOW_S = 300.0
"""Calls older than this no longer count as a segment's demand."""


@dataclass
class _Segment:
    keys: tuple[BlockKey, ...]
    calls: deque[float] = field(default_factory=deque)
    replicas: int = 0


class SegmentWatch(Collector):
    """How many engines hold each hot static segment (system prompt and tools), by the KV
    index: `refresh` matches the `TOP_SEGMENTS` most called segments against the index before
    each scrape (the index may be remote, so it is awaited there, not in `collect`)."""

    def __init__(self) -> None:
        self._segments: OrderedDict[BlockKey, _Segment] = OrderedDict()
        self._top: list[tuple[BlockKey, _Segment]] = []

    def observe(self, keys: tuple[BlockKey, ...], now: float) -> None:
        """A call whose prompt starts with the static segment `keys` was placed."""
        seg = self._segments.pop(keys[-1], None) or _Segment(keys)
        self._segments[keys[-1]] = seg
        calls = seg.calls
        calls.append(now)
        horizon = now - SEGMENT_WINDOW_S  # trimmed here too: /metrics may never be scraped
        while calls[0] < horizon:
            calls.popleft()
        while len(self._segments) > TRACKED_SEGMENTS:
            self._segments.popitem(last=False)

    async def refresh(self, index: KVIndexBackend, now: float) -> None:
        """Pick the most called segments of the window and count the engines whose own KV
        events confirm every block of each."""
        horizon = now - SEGMENT_WINDOW_S
        for key in list(self._segments):
            calls = self._segments[key].calls
            while calls and calls[0] < horizon:
                calls.popleft()
            if not calls:
                del self._segments[key]
        top = sorted(self._segments.items(), key=lambda kv: -len(kv[1].calls))[:TOP_SEGMENTS]
        for _, seg in top:
            matches = await index.match(seg.keys, now)
            seg.replicas = sum(1 for m in matches.values()
                               if m.confirmed_blocks >= len(seg.keys))
        self._top = top

    def collect(self) -> Iterator[Metric]:
        """Per hot segment (labelled by its last block key in hex): replicas, calls, blocks."""
        replicas = GaugeMetricFamily(
            "kvgate_static_segment_replicas", "Engines whose KV events confirm every block of "
            f"a static segment; the {TOP_SEGMENTS} most called segments.", labels=["segment"])
        calls = GaugeMetricFamily(
            "kvgate_static_segment_calls", f"Calls placed in the last {SEGMENT_WINDOW_S:g} s "
            "whose prompt starts with the static segment.", labels=["segment"])
        blocks = GaugeMetricFamily(
            "kvgate_static_segment_blocks", "Index blocks of the static segment.",
            labels=["segment"])
        for key, seg in self._top:
            label = [f"{key & (2**64 - 1):016x}"]
            replicas.add_metric(label, seg.replicas)
            calls.add_metric(label, len(seg.calls))
            blocks.add_metric(label, len(seg.keys))
        yield replicas
        yield calls
        yield blocks


@dataclass(frozen=True)
class EngineFigures:
    """One engine's load as the gateway sees it at scrape time."""

    engine: str
    running: int
    """vLLM's `num_requests_running` at the last scrape."""
    waiting: int
    kv_usage: float
    prefilling: int
    """The gateway's requests at the engine awaiting their first token."""
    queued_prefill_tokens: int
    prefix_cache_queries: float
    """vLLM's `prefix_cache_queries_total` (tokens) at the last scrape."""
    prefix_cache_hits: float


class EngineCollector(Collector):
    """Per-engine load and prefix-cache counters as last scraped from each engine."""

    def __init__(self, read: Callable[[], list[EngineFigures]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        """Gauges for load, counters re-exported from the engines' own prefix-cache counters
        (so `rate(hits) / rate(queries)` is each engine's prefix-hit ratio)."""
        label = ["engine"]
        gauges = {
            "running": GaugeMetricFamily(
                "kvgate_engine_running", "Requests running at the engine (scraped).", labels=label),
            "waiting": GaugeMetricFamily(
                "kvgate_engine_waiting", "Requests waiting in the engine's queue (scraped).",
                labels=label),
            "kv_usage": GaugeMetricFamily(
                "kvgate_engine_kv_usage", "Share of the engine's KV cache in use, 0-1 (scraped).",
                labels=label),
            "prefilling": GaugeMetricFamily(
                "kvgate_engine_prefilling", "The gateway's requests at the engine that have "
                "no first token yet.", labels=label),
            "queued_prefill_tokens": GaugeMetricFamily(
                "kvgate_engine_queued_prefill_tokens", "Uncached prompt tokens of those "
                "requests (the gateway's estimate).", labels=label),
        }
        queries = CounterMetricFamily(
            "kvgate_engine_prefix_cache_queries", "Prompt tokens the engine looked up in its "
            "prefix cache (vLLM's prefix_cache_queries, as last scraped).", labels=label)
        hits = CounterMetricFamily(
            "kvgate_engine_prefix_cache_hits", "Prompt tokens the engine found in its prefix "
            "cache (vLLM's prefix_cache_hits, as last scraped).", labels=label)
        for f in self._read():
            for name, family in gauges.items():
                family.add_metric([f.engine], getattr(f, name))
            queries.add_metric([f.engine], f.prefix_cache_queries)
            hits.add_metric([f.engine], f.prefix_cache_hits)
        yield from gauges.values()
        yield queries
        yield hits
