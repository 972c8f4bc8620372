"""The gateway's own Prometheus metrics (`kvgate_*`), in a registry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


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
            "From request arrival to the first response byte from the engine.",
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
            buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1), registry=r,
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
            buckets=(1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2), registry=r,
        )


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
