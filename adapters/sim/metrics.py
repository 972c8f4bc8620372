"""The `vllm:` Prometheus metrics of vLLM 0.32 (vllm/v1/metrics/loggers.py), fed by the sim."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from adapters.sim.model import EngineModel, FinishReason, SimRequest

# Bucket bounds copied from vllm/v1/metrics/buckets.py so histograms line up with real engines.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

LABELS = ["model_name", "engine"]


class EngineMetrics:
    """One registry holding the engine's metrics, labelled `model_name` and `engine="0"`."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # vLLM serves prometheus_client's default registry, which carries process_* metrics;
        # process_start_time_seconds is how a scraper tells that an engine restarted.
        ProcessCollector(registry=r)
        lv = (model_name, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(*lv)
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(*lv)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            [*LABELS, "reason"],
            registry=r,
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(*lv)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(*lv)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*lv)
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing.",
        ).labels(*lv)
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing.",
        ).labels(*lv)
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
            [*LABELS, "source"], registry=r,
        )
        self.prompt_by_source = {src: by_source.labels(*lv, src) for src in (
            "local_compute", "local_cache_hit", "external_kv_transfer")}
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(*lv)
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*LABELS, "source"], registry=r,
        )
        # Every tier vLLM 0.32 declares (CacheHitSource) is there from the start, as there.
        tiers = {src: cached_by_source.labels(*lv, src)
                 for src in ("device", "host", "disk", "p2p", "external_unspecified")}
        self.cached_device, self.cached_p2p = tiers["device"], tiers["p2p"]
        self.nixl_bytes = histogram(
            "vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL transfer.",
            tuple(float(2 ** (10 + i)) for i in range(1, 24, 2)),
        ).labels(*lv)
        self.nixl_time = histogram(
            "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV cache "
            "transfers.", (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0),
        ).labels(*lv)
        self.nixl_expired = counter(
            "vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire. "
            "NOTE: This metric is tracked on the P instance.").labels(*lv)
        self.nixl_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry", "Number of completion notifications for "
            "requests that were no longer tracked, usually because their KV lease expired. The "
            "KV blocks may have been reused before the transfer finished. Counted per "
            "notification (one per remote rank), not per request.").labels(*lv)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(*lv)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(*lv)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*lv)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(*lv, reason.value) for reason in FinishReason}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(*lv)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(*lv)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        ).labels(*lv)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        self._seen = dict.fromkeys(("queries", "hits", "preempt", "prompt", "gen",
                                    "ext_queries", "ext_hits", "src_compute", "src_cache",
                                    "src_external", "p2p", "expired", "device",
                                    "cached"), 0)

    def after_step(self, engine: EngineModel) -> None:
        """Refresh gauges and advance counters from the engine model's monotonic stats."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        # A request waiting for remote KV is waiting, deferred (vLLM's kv_holding_waiting).
        self.waiting_capacity.set(engine.num_waiting - len(engine.loading))
        self.waiting_deferred.set(len(engine.loading))
        self.kv_usage.set(engine.pool.usage)
        s = engine.stats
        for key, value, metric in (
            ("queries", s.prefix_cache_queries, self.prefix_queries),
            ("hits", s.prefix_cache_hits, self.prefix_hits),
            ("preempt", s.num_preemptions, self.preemptions),
            ("prompt", s.prompt_tokens, self.prompt_tokens),
            ("gen", s.generation_tokens, self.generation_tokens),
            ("ext_queries", s.external_prefix_cache_queries, self.external_queries),
            ("ext_hits", s.external_prefix_cache_hits, self.external_hits),
            ("src_compute", s.prompt_tokens_computed, self.prompt_by_source["local_compute"]),
            ("src_cache", s.prefix_cache_hits, self.prompt_by_source["local_cache_hit"]),
            ("src_external", s.external_prefix_cache_hits,
             self.prompt_by_source["external_kv_transfer"]),
            ("p2p", s.external_prefix_cache_hits, self.cached_p2p),
            ("device", s.prefix_cache_hits, self.cached_device),
            ("cached", s.prefix_cache_hits + s.external_prefix_cache_hits, self.prompt_cached),
            ("expired", s.kv_expired_reqs, self.nixl_expired),
        ):
            delta = value - self._seen[key]
            if delta:
                metric.inc(delta)
                self._seen[key] = value

    def nixl_transfer(self, num_bytes: int, seconds: float) -> None:
        """One pull read from a peer (observed on the consumer, as vLLM's pull mode does)."""
        self.nixl_bytes.observe(num_bytes)
        self.nixl_time.observe(seconds)

    def request_finished(self, req: SimRequest) -> None:
        """Observe a finished request's latencies, as vLLM's logger does at completion."""
        assert req.finish_reason is not None and req.finished_time is not None
        self.success[req.finish_reason].inc()
        self.e2e.observe(req.finished_time - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
            if req.first_token_time is not None:
                self.prefill_time.observe(req.first_token_time - req.first_scheduled_time)
        if req.first_token_time is not None:
            self.decode_time.observe(req.finished_time - req.first_token_time)
