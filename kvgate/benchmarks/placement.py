"""Placement quality on live simulated engines: prefix-hit ratio and load balance per policy.

Several agents run concurrently, each a ReAct-style loop with its own long system prompt and
tool definitions and a context that grows turn by turn. The same workload runs behind the
gateway with each policy, and once against a single engine with a cache large enough to never
evict: that engine's hit ratio is the ideal ("one engine with infinite cache"). Hits and queries
are read from the engines' own `vllm:prefix_cache_*` counters, load from their request counters.
"""

from __future__ import annotations

import asyncio
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child, start_gateway, start_sim

MODEL = "agent-model"


def agent_system_prompt(agent: int) -> str:
    """A long, agent-specific system prompt (about 1,500 tokens with its tools)."""
    duties = " ".join(f"Duty {agent}.{k}: check source {k * 7 + agent} before citing it."
                      for k in range(60))
    return f"You are agent {agent} of a research team. {duties}"


def agent_tools(agent: int) -> list[dict[str, Any]]:
    """Tool definitions private to one agent."""
    return [{"type": "function", "function": {
        "name": f"tool_{agent}_{t}", "description": f"Agent {agent} tool {t}: looks things up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                       "required": ["q"]}}} for t in range(6)]


async def run_agent(session: aiohttp.ClientSession, url: str, agent: int, turns: int,
                    output_tokens: int) -> list[str]:
    """One agent's loop; returns the engine that served each turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": agent_system_prompt(agent)},
        {"role": "user", "content": f"Investigate topic {agent}."},
    ]
    engines = []
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "tools": agent_tools(agent),
                "max_tokens": output_tokens, "ignore_eos": True}
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            out = await r.json()
            if r.status != 200:
                raise RuntimeError(f"agent {agent} turn {turn}: HTTP {r.status}: {out}")
            engines.append(r.headers.get("x-kvgate-engine", "direct"))
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
        messages.append({"role": "tool", "content": f"result {turn} for agent {agent}"})
    return engines


async def run_workload(url: str, agents: int, turns: int, output_tokens: int) -> list[str]:
    """All agents concurrently; the engine of every request."""
    async with aiohttp.ClientSession() as session:
        per_agent = await asyncio.gather(*(
            run_agent(session, url, a, turns, output_tokens) for a in range(agents)))
    return [e for engines in per_agent for e in engines]


def engine_counters(url: str) -> tuple[float, float, float]:
    """(prefix hits, local and external; prefix queries; finished requests) from an engine's
    /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    hits = queries = requests = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:prefix_cache_hits_total",
                          "vllm:external_prefix_cache_hits_total"):
                # Served from a cache, local or a peer's (KV connector): not computed.
                hits += s.value
            elif s.name == "vllm:prefix_cache_queries_total":
                queries += s.value
            elif s.name == "vllm:request_success_total":
                requests += s.value
    return hits, queries, requests


def engine_metric(url: str, name: str) -> float:
    """One metric's samples summed over labels, from an engine's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


@dataclass(frozen=True)
class PlacementResult:
    """One policy's outcome."""

    policy: str
    hit_ratio: float
    requests_per_engine: tuple[int, ...]

    @property
    def max_over_mean(self) -> float:
        """Most loaded engine's requests over the mean."""
        mean = sum(self.requests_per_engine) / len(self.requests_per_engine)
        return max(self.requests_per_engine) / mean if mean else 0.0


def _measure(sims: list[Child], policy: str) -> PlacementResult:
    counters = [engine_counters(s.url) for s in sims]
    hits = sum(c[0] for c in counters)
    queries = sum(c[1] for c in counters)
    return PlacementResult(policy, hits / queries if queries else 0.0,
                           tuple(int(c[2]) for c in counters))


def run_policy(policy: str, engines: int, agents: int, turns: int, output_tokens: int,
               log_dir: Path, profile: str = "h100-llama3-8b") -> PlacementResult:
    """Fresh engines + gateway with `policy`; run the workload; read the engines' counters."""
    children: list[Child] = []
    try:
        sims = [start_sim(f"{policy}-sim-{i}", log_dir, ["--model", MODEL, "--profile", profile,
                                                         "--seed", str(i)])
                for i in range(engines)]
        children += sims
        gw = start_gateway([s.url for s in sims], log_dir, ["--policy", policy],
                           name=f"{policy}-gateway")
        children.append(gw)
        asyncio.run(run_workload(gw.url, agents, turns, output_tokens))
        return _measure(sims, policy)
    finally:
        for c in children:
            c.stop()


def run_ideal(agents: int, turns: int, output_tokens: int, log_dir: Path,
              profile: str = "h100-llama3-8b") -> PlacementResult:
    """The same workload on one engine whose cache never evicts."""
    sim = start_sim("ideal-sim", log_dir, ["--model", MODEL, "--profile", profile])
    try:
        asyncio.run(run_workload(sim.url, agents, turns, output_tokens))
        return _measure([sim], "ideal (1 engine, infinite cache)")
    finally:
        sim.stop()


def compare(policies: list[str], engines: int = 4, agents: int = 8, turns: int = 6,
            output_tokens: int = 16) -> list[PlacementResult]:
    """The ideal first, then every policy, on fresh processes each."""
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-placement-"))
    results = [run_ideal(agents, turns, output_tokens, log_dir)]
    results += [run_policy(p, engines, agents, turns, output_tokens, log_dir) for p in policies]
    return results


def format_results(results: list[PlacementResult]) -> str:
    """A readable table."""
    ideal = results[0].hit_ratio
    lines = [f"{'policy':<34} {'hit ratio':>9} {'vs ideal':>8} {'max/mean load':>13}  "
             f"requests per engine"]
    for r in results:
        lines.append(f"{r.policy:<34} {r.hit_ratio:>9.3f} {r.hit_ratio / ideal:>8.1%} "
                     f"{r.max_over_mean:>13.2f}  {list(r.requests_per_engine)}")
    return "\n".join(lines)
