"""`llmd-like`: the llm-d inference scheduler (EPP) on its precise well-lit path.

Peer rule (llm-d-inference-scheduler v0.8.x, `pkg/plugins/scorer/precise_prefix_cache.go` and
`scorer/preciseprefixcache/utils.go`; GIE `scheduling/framework/plugins/scorer/queue.go`,
`kvcache_utilization.go`, `picker/max_score_picker.go`): total = sum of weight x clamp(score, 0, 1),
the highest total wins, ties at random (the picker shuffles, then stable-sorts; here a
`random.Random(context.seed)`). The precise well-lit path's weights:
- precise-prefix-cache (2): prompt blocks of 64 tokens (that path's block size). A pod that holds
  the prompt's first block scores its longest consecutive run of leading blocks, each weighted by
  its tier (GPU 1.0, CPU 0.8; `EngineMatch.weighted_blocks`); the runs are min-max normalised over
  those pods (all 1.0 when equal) and a pod without the first block scores 0. Only the engines'
  own KV events count: speculative indexing is opt-in upstream and off on this path, so the
  policy declares no speculative entries and reads confirmed blocks.
- kv-cache-utilization (1): 1 - scraped KV usage.
- queue (1): (maxQ - q) / (maxQ - minQ) over the candidates on the scraped waiting count
  (`vllm:num_requests_waiting`), 1.0 for all when maxQ == minQ.
llm-d refreshes those metrics every 50 ms; the policy declares that interval
(`metrics_interval_s`) and both drivers scrape that often for it, so the queue scorer reads what
the peer reads, as fresh as the peer has it, and nothing the peer does not have (no gateway
in-flight counts).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvindex.index import EngineMatch
from planner.policy import (
    EngineView,
    PolicyContext,
    RouteRequest,
    StatelessPolicy,
    candidates,
    register,
)


def clamp(score: float) -> float:
    """A scorer's output clamped to [0, 1], as the EPP's weighted sum does."""
    return min(max(score, 0.0), 1.0)


LLMD_BLOCK_TOKENS = 64
"""Tokens per block on llm-d's precise well-lit path."""


def _weighted_run(request: RouteRequest, match: EngineMatch) -> float:
    """The confirmed leading run in 64-token blocks, tier-weighted as the index weighs it."""
    if match.blocks <= 0:
        return 0.0
    run = match.confirmed_blocks * request.block_size // LLMD_BLOCK_TOKENS
    return run * match.weighted_blocks / match.blocks


def precise_prefix_scores(request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
    """Min-max normalised tier-weighted runs over the engines holding the first block; the range
    spans every engine the index reports, as llm-d's indexer scores all pods it knows."""
    runs = {name: _weighted_run(request, m) for name, m in request.matches.items()}
    hits = {name: run for name, run in runs.items() if run > 0}
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


def max_score_pick(totals: Mapping[str, float], rng: random.Random) -> str:
    """The max-score picker: the highest total; equal totals broken at random (upstream
    shuffles, then stable-sorts)."""
    best = max(totals.values())
    tied = [name for name, total in totals.items() if total == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def queue_scores(engines: Sequence[EngineView]) -> dict[str, float]:
    """Shorter scraped waiting queue scores higher, scaled over the candidates' range."""
    queues = {e.name: e.num_waiting for e in engines}
    low, high = min(queues.values()), max(queues.values())
    if high == low:
        return dict.fromkeys(queues, 1.0)
    return {name: (high - q) / (high - low) for name, q in queues.items()}


@register("llmd-like")
class LlmdPreciseScheduler(StatelessPolicy):
    """Weighted sum of precise-prefix, KV-utilisation and queue scores; highest wins."""

    name = "llmd-like"
    metrics_interval_s = 0.05
    """llm-d's metrics refresh interval; drivers scrape this often for this policy."""

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
            e.name: self.prefix_weight * clamp(prefix[e.name])
            + self.kv_utilization_weight * clamp(1.0 - e.kv_usage)
            + self.queue_weight * clamp(queue[e.name])
            for e in eligible
        }

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """Highest total; a seeded random pick among equal totals."""
        return self._pick(self.scores(request, engines))

    def _pick(self, totals: Mapping[str, float]) -> str:
        return max_score_pick(totals, self._rng)
