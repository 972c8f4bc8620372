"""`llmd-like`: the llm-d inference scheduler (EPP) with its "precise" prefix-cache sample config.

Peer rule: total = sum of weight x clamp(score, 0, 1) over the scorers, highest total wins, ties
broken at random (here a `random.Random(context.seed)`). Scorers and sample weights:
- precise-prefix-cache (2): per engine, the longest run of leading prompt blocks the KV index
  holds, each weighted by its tier (GPU 1.0, CPU 0.8, speculative entries as GPU; the gateway's
  `EngineMatch.weighted_blocks`). Like llm-d's `indexedScoresToNormalizedScoredPods`, the raw
  values are min-max normalised over the engines with a hit (all 1.0 when they are equal) and an
  engine without a hit scores 0.
- kv-cache-utilization (1): 1 - scraped KV usage.
- queue (1): (maxQ - q) / (maxQ - minQ) over the candidates, 1.0 for all when maxQ == minQ.
  llm-d reads `num_requests_waiting` scraped every 50 ms; our scrape is slower, so q is
  max(scraped waiting, gateway in-flight - scraped running): it equals the scrape right after
  one and counts the requests sent since as waiting until the next.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from planner.policy import (
    EngineView,
    PolicyContext,
    RouteRequest,
    StatelessPolicy,
    candidates,
    register,
)


def _clamp(score: float) -> float:
    return min(max(score, 0.0), 1.0)


def precise_prefix_scores(request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
    """Min-max normalised tier-weighted prefix hits; the range spans every engine the index
    reports a hit for, as llm-d's indexer scores all pods it knows."""
    hits = {name: m.weighted_blocks for name, m in request.matches.items() if m.weighted_blocks > 0}
    if not hits:
        return {e.name: 0.0 for e in engines}
    low, high = min(hits.values()), max(hits.values())
    scores: dict[str, float] = {}
    for e in engines:
        raw = hits.get(e.name)
        if raw is None:
            scores[e.name] = 0.0
        elif high == low:
            scores[e.name] = 1.0
        else:
            scores[e.name] = (raw - low) / (high - low)
    return scores


def waiting(engine: EngineView) -> int:
    """Requests waiting at the engine, not blind to the ones sent since the last scrape."""
    return max(engine.num_waiting, engine.in_flight - engine.num_running)


def queue_scores(engines: Sequence[EngineView]) -> dict[str, float]:
    """Shorter queue scores higher, scaled over the candidates' range."""
    queues = {e.name: waiting(e) for e in engines}
    low, high = min(queues.values()), max(queues.values())
    if high == low:
        return dict.fromkeys(queues, 1.0)
    return {name: (high - q) / (high - low) for name, q in queues.items()}


@register("llmd-like")
class LlmdPreciseScheduler(StatelessPolicy):
    """Weighted sum of precise-prefix, KV-utilisation and queue scores; highest wins."""

    name = "llmd-like"

    def __init__(
        self,
        context: PolicyContext | None = None,
        *,
        prefix_weight: float = 2.0,
        kv_utilization_weight: float = 1.0,
        queue_weight: float = 1.0,
    ) -> None:
        ctx = context or PolicyContext()
        self.prefix_weight = prefix_weight
        self.kv_utilization_weight = kv_utilization_weight
        self.queue_weight = queue_weight
        self._rng = random.Random(ctx.seed)

    def scores(self, request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
        """Total score per eligible engine, in pool order."""
        eligible = candidates(request, engines)
        prefix = precise_prefix_scores(request, eligible)
        queue = queue_scores(eligible)
        return {
            e.name: self.prefix_weight * _clamp(prefix[e.name])
            + self.kv_utilization_weight * _clamp(1.0 - e.kv_usage)
            + self.queue_weight * _clamp(queue[e.name])
            for e in eligible
        }

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """Highest total; a seeded random pick among equal totals."""
        return self._pick(self.scores(request, engines))

    def _pick(self, totals: Mapping[str, float]) -> str:
        best = max(totals.values())
        tied = [name for name, total in totals.items() if total == best]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
