"""Cache-blind baselines: round-robin and least-loaded.

Yardsticks, not a peer's router: neither reads prompts or KV state. Round-robin is what vLLM
production-stack's `RoundRobinRouter` does (`src/vllm_router/routers/routing_logic.py`, main
008a23b: the next endpoint in turn), here in pool order over the eligible engines."""

from __future__ import annotations

from collections.abc import Sequence

from planner.policy import (
    EngineView,
    PolicyContext,
    RouteRequest,
    StatelessPolicy,
    candidates,
    register,
)


@register("round-robin")
class RoundRobin(StatelessPolicy):
    """Cycle through the eligible engines."""

    name = "round-robin"
    reads_index = False

    def __init__(self, context: PolicyContext | None = None) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """Next eligible engine in turn."""
        eligible = candidates(request, engines)
        pick = eligible[self._next % len(eligible)]
        self._next += 1
        return pick.name


@register("least-loaded")
class LeastLoaded(StatelessPolicy):
    """Fewest requests at the engine (scraped running + waiting, or the gateway's in-flight)."""

    name = "least-loaded"
    reads_index = False

    def __init__(self, context: PolicyContext | None = None) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """Least load, then least KV usage; ties rotate so equal engines share the work."""
        eligible = candidates(request, engines)
        best = min((e.load, e.kv_usage) for e in eligible)
        tied = [e for e in eligible if (e.load, e.kv_usage) == best]
        pick = tied[self._turn % len(tied)]
        self._turn += 1
        return pick.name
