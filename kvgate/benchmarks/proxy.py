"""Gateway overhead, side by side: one `kvgate sim` engine reached directly, through
`kvgate serve`, through the floor of kvgate's stack (kvgate/benchmarks/passthrough.py: aiohttp
and the gateway's upstream client, nothing else) and through the real sglang-router, each
streamed and non-streamed, in one run.

Every target is driven by the same client (one keep-alive aiohttp session per target) against
the same engine. Targets and modes alternate in rounds, with the order rotated each round, so
drift in the engine or the machine affects all of them alike. Warm-up requests are discarded.
The engine is made fast so the gateways' overhead is not drowned in engine time: a short prompt,
4 output tokens, simulated steps at 1/1000 of an H100 (below the event loop's 1 ms timer
resolution, so steps do not sleep).

Reported per mode and target: TTFT (first body byte when non-streamed, first SSE data chunk
when streamed) and end-to-end p50/p99, the latency each gateway adds over direct (difference of
percentiles, and a paired p50 that compares batches of the same round), each process's CPU per
request, and kvgate's added latency as a ratio of sglang-router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, StartupError, free_port, start_gateway, start_sim, wait_healthy

MODEL = "bench-model"
DIRECT, KVGATE, FLOOR, SGLANG = "direct", "kvgate", "aiohttp-floor", "sglang-router"
STREAMED, NON_STREAMED = "streamed", "non-streamed"
STREAM_CHOICES = {"both": (NON_STREAMED, STREAMED), "on": (STREAMED,), "off": (NON_STREAMED,)}
PROMPTS = ("short", "agent")
"""`short`: one short user message, the same on every call of a client. `agent`: an agent's
calls, the 8k-token system prompt and 24 tools of `kvgate microbench index` with a new short
question on every call, as an agent's calls differ in their ends."""
ENGINE_TIME_SCALE = 0.001
OUTPUT_TOKENS = 4
WARMUP_REQUESTS = 10
START_ATTEMPTS = 3


_CALLS = itertools.count()
"""Numbers the agent prompt's calls across targets, rounds and clients (each its own
question)."""


class ProxyBenchError(ValueError):
    """Bad microbench options (the CLI turns it into exit code 2)."""


@dataclass
class Samples:
    """What one target answered in one mode: per-request TTFT and e2e seconds, and failures."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    cpu_s: float = 0.0  # CPU the target's process spent while this target and mode ran
    round_p50: list[float] = field(default_factory=list)  # e2e median of each round's batch

    def fail(self, message: str) -> None:
        """Count a failed request, keeping the first message for the report."""
        self.errors += 1
        if self.first_error is None:
            self.first_error = message


def _body(client: int, streamed: bool, prompt: str = "short", call: int = 0) -> dict[str, Any]:
    # A short prompt keeps the engine's tokenisation and prefill out of the way; per-client
    # text so concurrent clients are distinct requests. An agent's prompt is what gateways
    # key and match in practice: a long system prompt and tool definitions on every call, and
    # a question of its own (`call`), so no gateway answers from a cache of the whole prompt.
    body = {"model": MODEL, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": streamed,
            "messages": [{"role": "user", "content": f"Client {client} asks a short question."}]}
    if prompt == "agent":
        from kvgate.benchmarks.index import _agent_chat

        body["messages"], body["tools"] = _agent_chat(client * 1_000_000 + call)
    return body


async def _streamed(response: aiohttp.ClientResponse, t0: float) -> tuple[float, str | None]:
    """TTFT of an SSE response read to its end; an error message if it is not a whole stream."""
    ttft: float | None = None
    done = False
    async for line in response.content:
        if line.startswith(b"data: {"):
            if ttft is None:
                ttft = time.perf_counter() - t0
        elif line.startswith(b"data: [DONE]"):
            done = True
    if ttft is None or not done:
        return math.nan, "stream ended without a data chunk and [DONE]"
    return ttft, None


async def _non_streamed(response: aiohttp.ClientResponse, t0: float) -> tuple[float, str | None]:
    """Time to the first body byte of a JSON response read whole; an error if it has no choice."""
    first = await response.content.readany()
    ttft = time.perf_counter() - t0
    body = first + await response.content.read()
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        choices = None
    if not choices:
        return ttft, f"response is not a chat completion: {body[:200]!r}"
    return ttft, None


def _ack_now(response: aiohttp.ClientResponse) -> None:
    """ACK what arrived at once (Linux TCP_QUICKACK) instead of delaying the ACK up to 40 ms."""
    if response.connection is not None and response.connection.transport is not None:
        sock = response.connection.transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


async def _client(session: aiohttp.ClientSession, url: str, client: int, streamed: bool,
                  requests: int, quickack: bool, out: Samples | None,
                  prompt: str = "short") -> None:
    """`requests` sequential calls on one keep-alive session; `out` None discards them."""
    same = _body(client, streamed) if prompt == "short" else None
    for _ in range(requests):
        body = same if same is not None else _body(client, streamed, prompt, next(_CALLS))
        t0 = time.perf_counter()
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                if quickack:
                    _ack_now(r)
                if r.status != 200:
                    error: str | None = f"HTTP {r.status}: {(await r.text())[:200]}"
                    ttft = math.nan
                else:
                    ttft, error = await (_streamed(r, t0) if streamed else _non_streamed(r, t0))
        except (aiohttp.ClientError, TimeoutError) as e:
            error, ttft = f"{type(e).__name__}: {e}", math.nan
        e2e = time.perf_counter() - t0
        if out is None:
            continue
        if error is not None:
            out.fail(error)
        else:
            out.ttft.append(ttft)
            out.e2e.append(e2e)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc), all its threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(urls: dict[str, str], modes: tuple[str, ...], concurrency: int, rounds: int,
                  repeats: int, quickack: bool = False,
                  pids: dict[str, int] | None = None,
                  prompt: str = "short") -> dict[str, dict[str, Samples]]:
    """Warm every target and mode up, then alternate them round by round (order rotated).

    With `pids` (target -> process), each target's process CPU is charged to the batch it served.
    """
    samples = {mode: {t: Samples() for t in urls} for mode in modes}
    sessions = {t: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) for t in urls}
    pairs = [(mode, t) for mode in modes for t in urls]
    try:
        for mode, t in pairs:
            await asyncio.gather(*(
                _client(sessions[t], urls[t], c, mode == STREAMED, WARMUP_REQUESTS, quickack,
                        None, prompt)
                for c in range(concurrency)))
        for r in range(rounds):
            shift = r % len(pairs)
            for mode, t in pairs[shift:] + pairs[:shift]:
                out = samples[mode][t]
                pid = (pids or {}).get(t)
                cpu0 = process_cpu_s(pid) if pid is not None else 0.0
                done = len(out.e2e)
                await asyncio.gather(*(
                    _client(sessions[t], urls[t], c, mode == STREAMED, repeats, quickack, out,
                            prompt)
                    for c in range(concurrency)))
                if pid is not None:
                    out.cpu_s += process_cpu_s(pid) - cpu0
                if len(out.e2e) > done:
                    out.round_p50.append(statistics.median(out.e2e[done:]))
    finally:
        for s in sessions.values():
            await s.close()
    return samples


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    v = sorted(values)
    return {"p50_ms": statistics.median(v) * 1e3,
            "p99_ms": v[min(len(v) - 1, int(len(v) * 0.99))] * 1e3}


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def paired_added_p50_ms(target: Samples, direct: Samples) -> float | None:
    """Median over rounds of (target's round median - direct's round median), in ms.

    Batches of one round run back to back, so drift slower than a round cancels out.
    """
    if not target.round_p50 or len(target.round_p50) != len(direct.round_p50):
        return None
    return statistics.median(t - d for t, d in zip(target.round_p50, direct.round_p50,
                                                   strict=True)) * 1e3


def _ratio(kvgate: float | None, sglang: float | None) -> float | None:
    # A ratio over a gateway that added nothing measurable says nothing.
    return None if kvgate is None or sglang is None or sglang <= 0 else kvgate / sglang


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


def sglang_router_version() -> str | None:
    """The installed sglang-router's version, or None without the package."""
    if importlib.util.find_spec("sglang_router") is None:
        return None
    try:
        return importlib.metadata.version("sglang-router")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _mode_report(samples: dict[str, Samples]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for t, s in samples.items():
        sent = len(s.e2e) + s.errors
        targets[t] = {"requests": len(s.e2e), "errors": s.errors, "first_error": s.first_error,
                      "ttft": _pcts(s.ttft), "e2e": _pcts(s.e2e),
                      "process_cpu_ms_per_request": s.cpu_s * 1e3 / sent if sent else None}
    direct = targets[DIRECT]
    for t in targets.keys() - {DIRECT}:
        targets[t]["added"] = {
            f"{metric}_{p}": _minus(targets[t][metric][p], direct[metric][p])
            for metric in ("e2e", "ttft") for p in ("p50_ms", "p99_ms")}
        targets[t]["added"]["e2e_p50_paired_ms"] = paired_added_p50_ms(samples[t],
                                                                     samples[DIRECT])
    report: dict[str, Any] = {"targets": targets}
    if SGLANG in targets:
        for name, target in (("kvgate", KVGATE), ("floor", FLOOR)):
            if target in targets:
                report[f"ratio_{name}_over_sglang"] = {
                    key: _ratio(targets[target]["added"][key], targets[SGLANG]["added"][key])
                    for key in ("e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "e2e_p50_paired_ms")}
    return report


def _engine_and_gateway(log_dir: Path, profile: str) -> tuple[Child, Child]:
    events = f"tcp://127.0.0.1:{free_port()}"
    sim = start_sim("sim", log_dir, ["--model", MODEL, "--profile", profile, "--time-scale",
                                     str(ENGINE_TIME_SCALE), "--kv-events", events])
    try:
        gw = start_gateway([sim.url], log_dir, ["--policy", "kvgate", "--kv-events-bind", events])
    except StartupError:
        sim.stop()
        raise
    return sim, gw


def start_engine_and_gateway(log_dir: Path, profile: str) -> tuple[Child, Child]:
    """The fast engine, publishing KV events to a kvgate gateway in front of it.

    The engine connects to the events port before the gateway binds it, so another socket can
    take the port in between (a loopback reconnect can even self-connect): then start afresh.
    """
    for _ in range(START_ATTEMPTS - 1):
        with contextlib.suppress(StartupError):
            return _engine_and_gateway(log_dir, profile)
    return _engine_and_gateway(log_dir, profile)


def start_floor(engine_url: str, log_dir: Path) -> Child:
    """The pass-through floor (aiohttp + the gateway's upstream client) in front of the engine."""
    port = free_port()
    log_path = log_dir / "floor.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate.benchmarks.passthrough", "--engine", engine_url,
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    child = Child("floor", f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy(child, timeout=60.0)
    except StartupError:
        child.stop()
        raise
    return child


def bench_proxy(concurrency: int = 1, rounds: int = 40, repeats: int = 10, stream: str = "both",
                quickack: bool = False, profile: str = "h100-llama3-8b",
                prompt: str = "short") -> dict[str, Any]:
    """Run the side-by-side comparison; returns a JSON-able report.

    `quickack` makes the client ACK each response's headers at once, removing the delayed-ACK half
    of a Nagle stall (sglang-router 0.3.2 does not set TCP_NODELAY on its client sockets).
    """
    if prompt not in PROMPTS:
        raise ProxyBenchError(f"--prompt must be one of {', '.join(PROMPTS)}, got {prompt!r}")
    if stream not in STREAM_CHOICES:
        raise ProxyBenchError(f"--stream must be one of {', '.join(STREAM_CHOICES)}, "
                              f"got {stream!r}")
    for name, value in (("concurrency", concurrency), ("rounds", rounds), ("repeats", repeats)):
        if value < 1:
            raise ProxyBenchError(f"--{name} must be at least 1, got {value}")
    version = sglang_router_version()
    load_before = os.getloadavg()[0]
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-proxy-bench-"))
    children: list[Child] = []
    try:
        sim, gw = start_engine_and_gateway(log_dir, profile)
        children += [sim, gw]
        floor = start_floor(sim.url, log_dir)
        children.append(floor)
        urls = {DIRECT: sim.url, KVGATE: gw.url, FLOOR: floor.url}
        pids = {DIRECT: sim.proc.pid, KVGATE: gw.proc.pid, FLOOR: floor.proc.pid}
        if version is not None:
            from kvgate.bench.live import start_sglang_router

            router = start_sglang_router([sim.url], log_dir)
            children.append(router)
            urls[SGLANG] = router.url
            pids[SGLANG] = router.proc.pid
        samples = asyncio.run(measure(urls, STREAM_CHOICES[stream], concurrency, rounds, repeats,
                                      quickack, pids, prompt))
        with urllib.request.urlopen(f"{gw.url}/metrics", timeout=10) as r:
            metrics_text = r.read().decode()
    finally:
        for c in reversed(children):
            c.stop()
    if version is None:
        sglang = "not measured: sglang-router is not installed (pip install 'kvgate[bench]')"
    else:
        sglang = f"sglang-router {version}, cache_aware, its defaults"
    return {
        "concurrency": concurrency, "rounds": rounds, "repeats": repeats,
        "requests_per_target_and_mode": concurrency * rounds * repeats,
        "warmup_requests_discarded": concurrency * WARMUP_REQUESTS,
        "client_quickack": quickack,
        # Client, engine and gateways share this machine: a busy one inflates every figure.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0],
                            "cpus": os.cpu_count()},
        "engine": {"profile": profile, "time_scale": ENGINE_TIME_SCALE,
                   "output_tokens": OUTPUT_TOKENS},
        "prompt": prompt,
        "sglang_router": sglang,
        "modes": {mode: _mode_report(by_target) for mode, by_target in samples.items()},
        "kvgate_internal_p50_upper_bound_s": {
            "prefix_lookup": _histogram_p50(metrics_text, "kvgate_prefix_lookup_seconds"),
            "routing_decision": _histogram_p50(metrics_text, "kvgate_routing_decision_seconds"),
        },
    }


def report_errors(report: dict[str, Any]) -> list[str]:
    """One line per target and mode that had failed requests (empty when all succeeded)."""
    return [f"{mode} via {t}: {r['errors']} failed requests, first: {r['first_error']}"
            for mode, m in report["modes"].items() for t, r in m["targets"].items() if r["errors"]]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_report(report: dict[str, Any]) -> str:
    """The report as a table per mode, ratios and notes below."""
    lines = [f"concurrency {report['concurrency']}, {report['requests_per_target_and_mode']} "
             f"requests per target and mode ({report['warmup_requests_discarded']} warm-up "
             f"discarded), engine {report['engine']['profile']} at time scale "
             f"{report['engine']['time_scale']:g}, {report['engine']['output_tokens']} output "
             f"tokens, {report['prompt']} prompt", f"{report['sglang_router']}",
             f"machine load average {report['load_average_1m']['before']:.2f} before, "
             f"{report['load_average_1m']['after']:.2f} after, on "
             f"{report['load_average_1m']['cpus']} CPUs",
             "client ACKs at once (TCP_QUICKACK)" if report["client_quickack"] else
             "client ACKs as the kernel does (delayed ACK), like any Linux HTTP client", ""]
    header = (f"{'mode':<13}{'target':<15}{'TTFT p50/p99 ms':>17}{'e2e p50/p99 ms':>17}"
              f"{'added e2e p50/p99 ms':>22}{'paired p50':>12}{'CPU ms/req':>12}{'errors':>8}")
    lines.append(header)
    for mode, m in report["modes"].items():
        for t, r in m["targets"].items():
            added = r.get("added")
            added_s = ("" if added is None else
                       f"{_ms(added['e2e_p50_ms'])} / {_ms(added['e2e_p99_ms'])}")
            paired_s = "" if added is None else _ms(added["e2e_p50_paired_ms"])
            lines.append(f"{mode:<13}{t:<15}"
                         f"{_ms(r['ttft']['p50_ms']) + ' / ' + _ms(r['ttft']['p99_ms']):>17}"
                         f"{_ms(r['e2e']['p50_ms']) + ' / ' + _ms(r['e2e']['p99_ms']):>17}"
                         f"{added_s:>22}{paired_s:>12}"
                         f"{_ms(r['process_cpu_ms_per_request']):>12}"
                         f"{r['errors']:>8}")
    lines.append("(paired p50: median over rounds of the gap to direct in the same round; "
                 "CPU ms/req: the target's own process, for direct the engine's)")
    lines.append("")
    for mode, m in report["modes"].items():
        for name, target in (("kvgate", KVGATE), ("floor", FLOOR)):
            ratio = m.get(f"ratio_{name}_over_sglang")
            if ratio is not None:
                lines.append(f"{mode}: {target} added / sglang-router added, e2e p50 "
                             f"{_times(ratio['e2e_p50_ms'])} (paired "
                             f"{_times(ratio['e2e_p50_paired_ms'])}), p99 "
                             f"{_times(ratio['e2e_p99_ms'])}")
    internal = report["kvgate_internal_p50_upper_bound_s"]
    lines.append(f"kvgate internal p50 (histogram bucket upper bound): prefix lookup "
                 f"{internal['prefix_lookup']} s, routing decision "
                 f"{internal['routing_decision']} s")
    lines.extend(f"ERROR {e}" for e in report_errors(report))
    return "\n".join(lines)
