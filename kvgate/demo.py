"""`kvgate demo`: simulated engines + the gateway + a sample agent workflow, with a summary.

The workflow is the shape agent frameworks produce: a planner call, then parallel researcher calls
that all repeat the same long static prefix (system prompt + tool definitions), then a reducer that
joins their outputs. Each call streams through the gateway; the summary shows where each task ran,
its time to first token, how much of its prompt the engine served from cache, and the workflow's
completion time. The calls carry workflow hints, so the gateway records them as one workflow that
its timeline page (`/ui/`) draws; `--keep` leaves the pool running to look at it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp

from kvgate.procs import Child, StartupError, free_port, start_gateway, start_sim
from planner.hints import AFTER_HEADER, TASK_HEADER, WORKFLOW_HEADER

SYSTEM_PROMPT = (
    "You are a meticulous research agent working inside a larger multi-agent system. "
    "You receive one sub-question at a time, use the tools available to gather evidence, "
    "and answer in concise, well-sourced prose. Prefer primary sources, cite every claim, "
    "state uncertainty explicitly, and never invent a citation. "
) * 12

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "max_results": {"type": "integer", "description": "how many results to return"},
        }, "required": ["query"]},
    }}
    for name, desc in (
        ("web_search", "Search the public web and return titles, URLs and snippets."),
        ("read_page", "Fetch a web page and return its main text."),
        ("search_papers", "Search an index of scientific papers by keyword."),
        ("run_python", "Execute a short Python snippet in a sandbox and return stdout."),
    )
]

QUESTION = "How do KV-cache-aware routers change the latency of agentic LLM workloads?"


@dataclass
class TaskResult:
    """What the demo measured for one task."""

    task: str
    engine: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str


async def _call(
    session: aiohttp.ClientSession, url: str, model: str, task: str,
    messages: list[dict[str, Any]], max_tokens: int, workflow: str, after: str = "",
) -> TaskResult:
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-request-id": f"{workflow}/{task}", WORKFLOW_HEADER: workflow,
               TASK_HEADER: task}
    if after:
        headers[AFTER_HEADER] = after
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"task {task}: HTTP {r.status}: {await r.text()}")
        engine = r.headers.get("x-kvgate-engine", "?")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"task {task}: {chunk['error']['message']}")
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return TaskResult(
        task=task, engine=engine, ttft_s=ttft if ttft is not None else float("nan"),
        latency_s=time.perf_counter() - t0, prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        completion_tokens=usage.get("completion_tokens", 0), text="".join(text),
    )


async def run_workflow(url: str, model: str, workers: int,
                       workflow: str = "demo") -> tuple[list[TaskResult], float]:
    """Planner -> `workers` parallel researchers -> reducer, each call hinted as a task of
    `workflow`; returns results and completion time."""
    system = {"role": "system", "content": SYSTEM_PROMPT}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        plan = await _call(session, url, model, "plan", [
            system, {"role": "user", "content": f"Split into {workers} sub-questions: {QUESTION}"},
        ], max_tokens=48, workflow=workflow)
        research = await asyncio.gather(*(
            _call(session, url, model, f"research-{i}", [
                system,
                {"role": "user", "content": f"Plan: {plan.text}\nAnswer sub-question {i}."},
            ], max_tokens=64, workflow=workflow, after="plan")
            for i in range(1, workers + 1)
        ))
        notes = "\n".join(f"[{r.task}] {r.text}" for r in research)
        reduce = await _call(session, url, model, "reduce", [
            system,
            {"role": "user", "content": f"Question: {QUESTION}\nFindings:\n{notes}\nSynthesize."},
        ], max_tokens=96, workflow=workflow, after=",".join(r.task for r in research))
    return [plan, *research, reduce], time.perf_counter() - t0


def format_summary(results: list[TaskResult], completion_s: float, policy: str) -> str:
    """A readable table of the workflow's tasks and totals."""
    lines = [
        f"{'task':<12} {'engine':<18} {'TTFT ms':>8} {'latency ms':>10} {'prompt':>7} "
        f"{'cached':>7} {'hit %':>6} {'out':>5}",
    ]
    for r in results:
        hit = 100.0 * r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        lines.append(
            f"{r.task:<12} {r.engine:<18} {r.ttft_s * 1000:>8.1f} {r.latency_s * 1000:>10.1f} "
            f"{r.prompt_tokens:>7} {r.cached_tokens:>7} {hit:>6.1f} {r.completion_tokens:>5}"
        )
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    per_engine: dict[str, int] = {}
    for r in results:
        per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
    lines += [
        "",
        f"policy: {policy}; tasks per engine: "
        + ", ".join(f"{k}={v}" for k, v in sorted(per_engine.items())),
        f"prefix-hit ratio: {cached}/{prompt} prompt tokens = "
        f"{(cached / prompt if prompt else 0.0):.1%}",
        f"workflow completion time: {completion_s * 1000:.1f} ms",
    ]
    return "\n".join(lines)


def run_demo(engines: int, profile: str, policy: str, workers: int, keep: bool = False) -> int:
    """Start everything, run the workflow, print the summary and where the timeline page shows
    it, then stop everything (with `keep`, only once interrupted: Ctrl-C or SIGTERM)."""

    def terminated(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # as Ctrl-C: the engines and the gateway are stopped

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        return _run_demo(engines, profile, policy, workers, keep)
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_demo(engines: int, profile: str, policy: str, workers: int, keep: bool) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    children: list[Child] = []
    try:
        print(f"starting {engines} simulated engines ({profile}) and the gateway; "
              f"logs in {log_dir}", flush=True)
        # Engines connect their KV-event sockets to the gateway's bound SUB socket (ZMQ retries
        # until it is there); nothing is published before the first request.
        events = f"tcp://127.0.0.1:{free_port()}"
        for i in range(engines):
            children.append(start_sim(
                f"sim-{i}", log_dir, ["--profile", profile, "--seed", str(i),
                                      "--enable-prompt-tokens-details", "--kv-events", events]))
        sims = list(children)
        gateway = start_gateway([s.url for s in sims], log_dir,
                                ["--policy", policy, "--kv-events-bind", events])
        children.append(gateway)
        model = _first_model(gateway.url)
        print(f"gateway {gateway.url} -> engines {', '.join(s.url for s in sims)}; model {model}")
        print(f"workflow: plan -> {workers} parallel researchers -> reduce "
              f"(shared system prompt + {len(TOOLS)} tools)\n", flush=True)
        workflow = f"demo-{uuid.uuid4().hex[:8]}"
        results, completion = asyncio.run(run_workflow(gateway.url, model, workers, workflow))
        print(format_summary(results, completion, policy))
        print(f"\ntimeline: {gateway.url}/ui/#/workflow/{workflow}", flush=True)
        if keep:
            print("the pool keeps running (--keep); Ctrl-C stops it", flush=True)
            try:
                while all(c.proc.poll() is None for c in children):
                    time.sleep(0.5)
            except KeyboardInterrupt:
                return 0
            print("kvgate demo: a process of the pool exited; see the logs")
            return 1
        return 0
    except (StartupError, RuntimeError, aiohttp.ClientError) as e:
        print(f"kvgate demo failed: {e}")
        return 1
    finally:
        for c in reversed(children):
            c.stop()


def _first_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        data = json.load(r)["data"]
    if not data:
        raise RuntimeError("the gateway reports no models")
    return str(data[0]["id"])
