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
from dataclasses import dataclass

import aiohttp

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

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        makespan = time.perf_counter() - start
    return RunStats(statistics.fmean(r[0] for r in results),
                    statistics.fmean(r[1] for r in results), makespan,
                    sum(r[2] for r in results), sum(r[3] for r in results))


async def reset_prefix_cache(session: aiohttp.ClientSession, url: str) -> None:
    """Start each run with a cold prefix cache (vLLM with VLLM_SERVER_DEV_MODE=1, kvgate sim)."""
    async with session.post(url + "/reset_prefix_cache") as r:
        r.raise_for_status()


def median_stats(runs: list[RunStats]) -> RunStats:
    """Per-statistic medians of several runs of the same workload."""
    return RunStats(statistics.median(r.mean_ttft_s for r in runs),
                    statistics.median(r.mean_e2e_s for r in runs),
                    statistics.median(r.makespan_s for r in runs),
                    runs[0].prompt_tokens, runs[0].completion_tokens)


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
