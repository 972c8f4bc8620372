"""Read an engine's load from vLLM's Prometheus exposition (`/metrics`)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineLoad:
    """The load figures a router needs, summed over the engine's `engine` label values."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: float
    prefix_cache_hits: float
    process_start_time: float | None
    """`process_start_time_seconds`: changes when the engine process restarts."""


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks vLLM's gauges."""


_WANTED = frozenset({
    "vllm:kv_cache_usage_perc", "process_start_time_seconds", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
})


def _wanted_lines(text: str) -> str:
    """Only the sample lines of the metrics a router reads.

    A vLLM `/metrics` body is tens of KB of histograms; parsing all of it took 5-10 ms on the
    gateway's event loop every scrape, and requests arriving meanwhile waited.
    """
    keep = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        if line[:end] in _WANTED:
            keep.append(line)
    keep.append("")
    return "\n".join(keep)


def parse_engine_load(text: str) -> EngineLoad:
    """Extract running/waiting/KV usage/prefix-cache counters from a `/metrics` body."""
    values: dict[str, float] = {}
    usage: list[float] = []
    try:
        for family in text_string_to_metric_families(_wanted_lines(text)):
            for sample in family.samples:
                if sample.name == "vllm:kv_cache_usage_perc":
                    usage.append(sample.value)
                elif sample.name == "process_start_time_seconds":
                    values[sample.name] = sample.value
                elif sample.name in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:prefix_cache_queries_total",
                    "vllm:prefix_cache_hits_total",
                ):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError as e:
        raise MetricsParseError(f"unparseable metrics: {e}") from None
    if "vllm:num_requests_running" not in values:
        raise MetricsParseError("metrics lack vllm:num_requests_running")
    return EngineLoad(
        num_running=int(values["vllm:num_requests_running"]),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=max(usage) if usage else 0.0,
        prefix_cache_queries=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_cache_hits=values.get("vllm:prefix_cache_hits_total", 0.0),
        process_start_time=values.get("process_start_time_seconds"),
    )
