"""A small agent workload for comparing a simulated engine with a real one.

Every task is a streamed chat request sharing one system prompt (the agent's instructions) with
its own user message; `concurrency` tasks are in flight at once. Output lengths are forced
(`ignore_eos`), so both engines do exactly the same token work.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

WORDS = ("agent", "tool", "call", "result", "search", "file", "patch", "test", "error", "plan",
         "read", "write", "shell", "query", "index", "answer", "review", "step", "commit", "diff")


@dataclass(frozen=True)
class Task:
    """One chat request of the workload."""

    user: str
    max_tokens: int


@dataclass(frozen=True)
class RunStats:
    """Means over the tasks and the wall time of the whole run."""

    mean_ttft_s: float
    mean_e2e_s: float
    makespan_s: float
    prompt_tokens: int
    completion_tokens: int
    engine: dict[str, float] = field(default_factory=dict)
    """Means per request of the engine's own latency histograms over the run (ENGINE_PHASES):
    where the client's TTFT and e2e went, as the engine itself measured them."""


ENGINE_PHASES = {
    "engine TTFT": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "engine e2e": "vllm:e2e_request_latency_seconds",
}
"""vLLM's per-request histograms, which `kvgate sim` exports alike."""


async def histogram_totals(session: aiohttp.ClientSession,
                           url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ENGINE_PHASES histogram on the engine's /metrics, over labels."""
    async with session.get(url + "/metrics") as r:
        r.raise_for_status()
        text = await r.text()
    totals = {name: [0.0, 0.0] for name in ENGINE_PHASES.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, total in totals.items():
                if sample.name == name + "_sum":
                    total[0] += sample.value
                elif sample.name == name + "_count":
                    total[1] += sample.value
    return {name: (t[0], t[1]) for name, t in totals.items()}


def phase_means(before: dict[str, tuple[float, float]],
                after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean per request of each phase between two `histogram_totals` readings."""
    out = {}
    for phase, name in ENGINE_PHASES.items():
        count = after[name][1] - before[name][1]
        if count > 0:
            out[phase] = (after[name][0] - before[name][0]) / count
    return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


def make_workload(tasks: int = 12, seed: int = 7) -> tuple[str, list[Task]]:
    """The shared system prompt and the tasks (user messages of varied length and output)."""
    rng = random.Random(seed)
    system = "You are a coding agent. Tools: " + _text(rng, 300)
    return system, [Task(_text(rng, rng.randrange(40, 400)), rng.choice((16, 32, 64)))
                    for _ in range(tasks)]


async def _one(session: aiohttp.ClientSession, url: str, model: str, system: str,
               task: Task) -> tuple[float, float, int, int]:
    body = {"model": model, "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": task.user}],
            "max_tokens": task.max_tokens, "min_tokens": task.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    prompt = completion = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    end = time.perf_counter()
    return (first or end) - start, end - start, prompt, completion


async def run_workload(url: str, model: str, concurrency: int, tasks: int = 12,
                       seed: int = 7) -> RunStats:
    """Run the workload with `concurrency` tasks in flight against one engine."""
    system, work = make_workload(tasks, seed)
    queue = list(work)
    results: list[tuple[float, float, int, int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def worker() -> None:
            while queue:
                results.append(await _one(session, url, model, system, queue.pop(0)))

        before = await histogram_totals(session, url)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        makespan = time.perf_counter() - start
        # vLLM records a request's histograms as its output is processed, after the last
        # chunk may have reached the client: give it a moment.
        await asyncio.sleep(0.2)
        engine = phase_means(before, await histogram_totals(session, url))
    return RunStats(statistics.fmean(r[0] for r in results),
                    statistics.fmean(r[1] for r in results), makespan,
                    sum(r[2] for r in results), sum(r[3] for r in results), engine)


async def reset_prefix_cache(session: aiohttp.ClientSession, url: str) -> None:
    """Start each run with a cold prefix cache (vLLM with VLLM_SERVER_DEV_MODE=1, kvgate sim)."""
    async with session.post(url + "/reset_prefix_cache") as r:
        r.raise_for_status()


def median_stats(runs: list[RunStats]) -> RunStats:
    """Per-statistic medians of several runs of the same workload."""
    phases = set.intersection(*(set(r.engine) for r in runs))
    return RunStats(statistics.median(r.mean_ttft_s for r in runs),
                    statistics.median(r.mean_e2e_s for r in runs),
                    statistics.median(r.makespan_s for r in runs),
                    runs[0].prompt_tokens, runs[0].completion_tokens,
                    {p: statistics.median(r.engine[p] for r in runs) for p in sorted(phases)})


def ratios(sim: RunStats, real: RunStats) -> dict[str, float]:
    """The sim's mean TTFT, mean end-to-end latency and makespan over the real engine's."""
    return {"mean TTFT": sim.mean_ttft_s / real.mean_ttft_s,
            "mean e2e": sim.mean_e2e_s / real.mean_e2e_s,
            "makespan": sim.makespan_s / real.makespan_s}


def breakdown(sim: RunStats, real: RunStats) -> str:
    """Client and engine-side means, sim against real, in ms: where a gap comes from."""
    rows = [("client TTFT", sim.mean_ttft_s, real.mean_ttft_s),
            ("client e2e", sim.mean_e2e_s, real.mean_e2e_s),
            *((p, sim.engine[p], real.engine[p]) for p in ENGINE_PHASES
              if p in sim.engine and p in real.engine)]
    return ", ".join(f"{name} {s * 1e3:.1f}/{r * 1e3:.1f}" for name, s, r in rows) + \
        " (ms, sim/real)"


async def compare(urls: list[str], model: str, concurrency: int,
                  repeats: int) -> list[RunStats]:
    """Cold-cache runs on each engine in turn, `repeats` rounds (so a busy spell on a shared
    machine hits every engine alike); the medians per engine."""
    runs: list[list[RunStats]] = [[] for _ in urls]
    for _ in range(repeats):
        for url, mine in zip(urls, runs, strict=True):
            async with aiohttp.ClientSession() as session:
                await reset_prefix_cache(session, url)
            mine.append(await run_workload(url, model, concurrency))
    return [median_stats(r) for r in runs]
