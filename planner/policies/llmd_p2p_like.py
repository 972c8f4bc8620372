"""`llmd-p2p-like`: llm-d's experimental P2P KV sharing, load-aware placement plus the pull.

Peer configuration (llm-d/llm-d `guides/p2p-kv-cache-sharing`, the `load + P2P` arm
`benchmarking/epp-load-p2p.yaml`, stored at commit 4dcf3d5; the arm the guide's +143% / +224%
"load-aware + P2P" numbers measure): scheduling profile queue-scorer 3, kv-cache-utilization-scorer
2, `weighted-random-picker`; `precise-prefix-cache-producer` with 64-token blocks and speculative
indexing left at its default (off); `p2p-source-producer` with `minCachedTokenDelta: 2048` (the
guide's RDMA value). Code read at llm-d-router v0.10.0 (2026-08-17; main unchanged in rule through
2026-08-21):
- Destination (`pkg/epp/scheduling/scheduler_profile.go`, `scorer/queuedepth/queue.go`,
  `scorer/kvcacheutilization/kvcache_utilization.go`, `picker/weightedrandom/picker.go`): total =
  sum of weight x clamp(score, 0, 1); queue = (maxQ - q) / (maxQ - minQ) on the scraped waiting
  count (1.0 for all when equal), kv-util = 1 - usage. The picker draws one endpoint with
  probability proportional to its total (A-Res keys U^(1/total)); all totals zero: uniform. No
  prefix scorer, so placement ignores the cache: the pull is what makes scattering affordable.
- Source (`requestcontrol/dataproducer/p2psource/producer.go`, `Produce`, since #2032 "load-aware
  p2p source selection"; before it, #1924 took the argmax): over every candidate endpoint with a
  cached run, take the largest run M; the band is the endpoints with run + block >= M (one 64-token
  block); one is *sampled*, not argmax'd, with weight 1/(1 + waiting), the sampling coordinate
  being FNV-1a-32(request id) / 2^32 walked over the band in endpoint order, so it is
  deterministic per request. The source is chosen before scheduling, over all candidates.
- Pull (`PreRequest`): only if the sampled source is not the destination and its run minus the
  destination's run >= minCachedTokenDelta. Runs are cached blocks x 64 tokens. (A later
  producer README adds an optional `costModel` that replaces this rule; no guide config sets it.)

Readings (the stronger where the code leaves room):
- Runs are the engines' confirmed leading runs (KV events only; no speculative entries on this
  arm), floored to whole 64-token blocks as llm-d's precise index counts them.
- Upstream counts only the source's CPU-tier blocks (pulls are served from the offload tier,
  #2321). Our index reports one run per engine, not per tier, so the whole confirmed run counts as
  pull-servable: vLLM's OffloadingConnector writes every computed block to CPU, so the CPU tier
  holds what the GPU does once the store lands. This can only make a pull more available.
- A sampled source that is the destination never pulls, as upstream; with a delta larger than
  one block this loses nothing, since a destination inside the band is within a block of every
  source.
- The picker's randomness is a `random.Random(context.seed)` (upstream seeds from the clock).
- Without a transfer path (`context.link` disabled) there is no pull: the scorers alone place,
  and the policy reads nothing from the KV index (`reads_index` is then False).
The guide's *shipped default* is the other arm (`epp-affinity-p2p.yaml`: precise prefix 3,
queue 2, kv-util 2, no-hit-lru 2, max-score, speculative indexing on), where the pull "rarely
fires"; this policy is the load arm, the one the guide's P2P gains come from.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from planner.policies.llmd_like import LLMD_BLOCK_TOKENS, clamp, queue_scores
from planner.policy import (
    EngineView,
    Placement,
    PolicyContext,
    RouteRequest,
    StatelessPolicy,
    candidates,
    register,
)
from planner.transfer import Pull

MIN_CACHED_TOKEN_DELTA = 2048
"""The guide's `minCachedTokenDelta` on its RDMA testbed (the pull won at 2,048 tokens)."""


def request_spread_fraction(request_id: str) -> float:
    """FNV-1a-32 of the request id mapped onto [0, 1): the source sampling coordinate, uniform
    across requests and fixed per request."""
    h = 0x811C9DC5
    for byte in request_id.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h / 2**32


def cached_run_tokens(request: RouteRequest, engine: str) -> int:
    """The engine's confirmed leading run of the prompt in tokens, whole 64-token blocks only."""
    match = request.matches.get(engine)
    if match is None:
        return 0
    run = match.confirmed_blocks * request.block_size
    return run - run % LLMD_BLOCK_TOKENS


def p2p_source(request: RouteRequest, engines: Sequence[EngineView]) -> tuple[str, int] | None:
    """The p2p-source-producer's sampled pull source and its run in tokens: among the engines
    within one block of the longest confirmed run, weighted 1/(1 + waiting), sampled at
    `request_spread_fraction`; None when no engine holds a block."""
    runs = [(e, cached_run_tokens(request, e.name)) for e in engines]
    runs = [(e, run) for e, run in runs if run > 0]
    if not runs:
        return None
    longest = max(run for _, run in runs)
    band = [(e, run) for e, run in runs if run + LLMD_BLOCK_TOKENS >= longest]
    weights = [1.0 / (1.0 + e.num_waiting) for e, _ in band]
    target = request_spread_fraction(request.request_id) * sum(weights)
    for (e, run), weight in zip(band, weights, strict=True):
        if target < weight:
            return e.name, run
        target -= weight
    last, run = band[-1]
    return last.name, run


def p2p_placement(request: RouteRequest, eligible: Sequence[EngineView], engine: str,
                  destination_run: int, min_cached_token_delta: int) -> Placement:
    """`engine`, with a pull when the sampled source (`p2p_source`) is another engine whose run
    leads the destination's (`destination_run` tokens) by `min_cached_token_delta`."""
    source = p2p_source(request, eligible)
    if source is None:
        return Placement(engine)
    name, run = source
    if name == engine or run - destination_run < min_cached_token_delta:
        return Placement(engine)
    return Placement(engine, pull=Pull(name, run))


@register("llmd-p2p-like")
class LlmdP2PScheduler(StatelessPolicy):
    """Load-weighted random placement; pull the prefix from a near-best peer that leads by
    `min_cached_token_delta` tokens."""

    name = "llmd-p2p-like"
    moves_kv = True
    metrics_interval_s = 0.05
    """llm-d's metrics refresh interval; drivers scrape this often for this policy."""

    def __init__(
        self,
        context: PolicyContext | None = None,
        *,
        queue_weight: float = 3.0,
        kv_utilization_weight: float = 2.0,
        min_cached_token_delta: int = MIN_CACHED_TOKEN_DELTA,
    ) -> None:
        ctx = context or PolicyContext()
        if min_cached_token_delta < 1:
            raise ValueError(f"min_cached_token_delta must be >= 1, got {min_cached_token_delta}")
        self.queue_weight = queue_weight
        self.kv_utilization_weight = kv_utilization_weight
        self.min_cached_token_delta = min_cached_token_delta
        self.link = ctx.link
        self.reads_index = self.link.enabled
        """Only the pull reads the KV index (placement is by load alone): without a transfer
        path there is no pull, so a driver may skip matching and ingesting for it."""
        self._rng = random.Random(ctx.seed)

    def scores(self, request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
        """Total score per eligible engine, in pool order."""
        eligible = candidates(request, engines)
        queue = queue_scores(eligible)
        return {
            e.name: self.queue_weight * clamp(queue[e.name])
            + self.kv_utilization_weight * clamp(1.0 - e.kv_usage)
            for e in eligible
        }

    def source(
        self, request: RouteRequest, engines: Sequence[EngineView]
    ) -> tuple[str, int] | None:
        """The sampled pull source and its run in tokens (`p2p_source`)."""
        return p2p_source(request, engines)

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> Placement:
        """A load-weighted random engine, with a pull when the sampled source leads it by the
        delta and a transfer path exists."""
        eligible = candidates(request, engines)
        engine = self._pick(self.scores(request, eligible))
        if not self.link.enabled:
            return Placement(engine)
        return p2p_placement(request, eligible, engine, cached_run_tokens(request, engine),
                             self.min_cached_token_delta)

    def _pick(self, totals: Mapping[str, float]) -> str:
        names = list(totals)
        weights = [max(total, 0.0) for total in totals.values()]
        if sum(weights) <= 0:
            return self._rng.choice(names)
        return self._rng.choices(names, weights=weights)[0]
