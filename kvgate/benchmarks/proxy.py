"""The gateway's added latency: the same streaming load sent to an engine directly and through
`kvgate serve`, at a given concurrency, on this machine (client, gateway and engine share it).

Modes alternate (direct, gateway, direct, gateway, ...) so drift in the engine affects both.
Reported: TTFT and end-to-end latency percentiles per mode and their differences, plus the
gateway's own per-request work (prompt keying + index match, routing decision) from its metrics.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, start_gateway, start_sim

MODEL = "bench-model"


async def _client(session: aiohttp.ClientSession, url: str, client: int, rounds: int,
                  out: list[tuple[float, float]]) -> None:
    body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "messages": [{"role": "system", "content": "You answer briefly. " * 20},
                         {"role": "user", "content": f"Client {client} asks a question."}]}
    for _ in range(rounds):
        t0 = time.perf_counter()
        ttft = None
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - t0
        out.append((ttft if ttft is not None else float("nan"), time.perf_counter() - t0))


async def _load(url: str, concurrency: int, rounds: int) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(_client(session, url, c, rounds, out)
                               for c in range(concurrency)))
    return out


def _pcts(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"p50_ms": statistics.median(v) * 1e3,
            "p99_ms": v[min(len(v) - 1, int(len(v) * 0.99))] * 1e3}


def _histogram_p50(text: str, name: str) -> float | None:
    """Approximate median from a Prometheus histogram's cumulative buckets."""
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for le, count in sorted(buckets):
        if count >= total / 2:
            return le
    return None


def bench_proxy(concurrency: int = 200, rounds: int = 3, repeats: int = 2,
                profile: str = "h100-llama3-8b") -> dict[str, Any]:
    """Run the comparison; returns a JSON-able dict."""
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-proxy-bench-"))
    children: list[Child] = []
    try:
        sim = start_sim("sim", log_dir, ["--model", MODEL, "--profile", profile])
        children.append(sim)
        gw = start_gateway([sim.url], log_dir, ["--policy", "kvgate"])
        children.append(gw)
        asyncio.run(_load(sim.url, 8, 1))  # warm the engine's cache and connections
        asyncio.run(_load(gw.url, 8, 1))
        results: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
        for _ in range(repeats):
            results["direct"] += asyncio.run(_load(sim.url, concurrency, rounds))
            results["gateway"] += asyncio.run(_load(gw.url, concurrency, rounds))
        with urllib.request.urlopen(f"{gw.url}/metrics", timeout=10) as r:
            metrics_text = r.read().decode()
    finally:
        for c in reversed(children):
            c.stop()
    report: dict[str, Any] = {"concurrency": concurrency, "requests_per_mode":
                              len(results["direct"]), "profile": profile}
    for mode, samples in results.items():
        report[mode] = {"ttft": _pcts([s[0] for s in samples]),
                        "e2e": _pcts([s[1] for s in samples])}
    report["added"] = {
        f"{metric}_{p}": report["gateway"][metric][p] - report["direct"][metric][p]
        for metric in ("ttft", "e2e") for p in ("p50_ms", "p99_ms")
    }
    report["gateway_internal_p50_upper_bound_s"] = {
        "prefix_lookup": _histogram_p50(metrics_text, "kvgate_prefix_lookup_seconds"),
        "routing_decision": _histogram_p50(metrics_text, "kvgate_routing_decision_seconds"),
    }
    return report
