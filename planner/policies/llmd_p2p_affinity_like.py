"""`llmd-p2p-affinity-like`: the arm llm-d's P2P guide deploys by default, precise prefix
affinity with speculative indexing, plus the P2P pull.

Peer configuration (llm-d/llm-d `guides/p2p-kv-cache-sharing/router/
p2p-kv-cache-sharing.values.yaml`, the deployed config, identical to the benchmarked arm
`benchmarking/epp-affinity-p2p.yaml`):
`precise-prefix-cache-producer` with 64-token blocks and `speculativeIndexing: true`;
`p2p-source-producer` with `minCachedTokenDelta: 2048`; scheduling profile prefix-cache-scorer 3
(fed by the precise producer), queue-scorer 2, kv-cache-utilization-scorer 2, no-hit-lru-scorer 2
(fed by the precise producer), `max-score-picker`. The guide says the pull "is usually inert"
under this arm (a peer rarely leads the scheduled pod by the delta) and that it is the default
"because affinity is the safer placement in the capacity-driven regime"; `llmd-p2p-like` is the
load arm its P2P gains are measured on. Code read at llm-d-router v0.10.0 (71f4f09, 2026-08-17;
main at ebab687 unchanged in these rules):
- Prefix score (`requestcontrol/dataproducer/preciseprefixcache/producer.go`,
  `kvcache/kvblock_scorer.go`, `scheduling/scorer/prefix/plugin.go`): per endpoint, the run of
  consecutive full 64-token blocks from the first that it holds, each block weighted by the best
  tier holding it there (GPU 1.0, CPU 0.8, a speculative entry, whose tier is empty, 1.0),
  truncated to an integer; score = that / the prompt's full 64-token blocks. No min-max
  normalisation (unlike v0.8.x's precise scorer, which `llmd-like` follows).
- Speculative indexing (`preciseprefixcache/prerequest.go`): after each decision every full-block
  key of the prompt is entered for the chosen endpoint, expiring after 2 s
  (`defaultSpeculativeTTL`); the policy declares speculative entries, so the drivers add the
  gateway's own (same keys, same 2 s TTL: `index.speculative_ttl_s`).
- no-hit-lru (`scheduling/scorer/nohitlru/no_hit_lru.go`): a request is cold when no candidate's
  match (the integer above) is positive; cold requests score as in `llmd-approx-like`'s
  `ColdLru`, warm ones 0.5 everywhere; the endpoint a cold request goes to becomes the most
  recently used.
- queue (`scorer/queuedepth/queue.go`) and kv-cache-utilization: as in `llmd-like`; all scores
  clamped to [0, 1], weighted and summed; the highest total wins, ties at random
  (`picker/maxscore/picker.go` shuffles, then stable-sorts; here `random.Random(context.seed)`).
- Pull (`requestcontrol/dataproducer/p2psource/producer.go`): the source is sampled as in
  `llmd-p2p-like` (`p2p_placement`) and pulled from when it is not the destination and leads it by
  at least `minCachedTokenDelta`; the destination's run counts every tier, speculative entries
  included, unweighted (`CachedBlockCount`), in whole 64-token blocks.

Readings (the stronger where the code leaves room): upstream pulls only from a source's CPU-tier
run; our index reports one confirmed run per engine, which counts whole as pull-servable (as in
`llmd-p2p-like`: vLLM's OffloadingConnector stores every computed block to CPU). The tier weight
of a run is the index's `weighted_blocks / blocks`, spread evenly over the run (exact when the
run sits in one tier, as in every workload here).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvindex.index import EngineMatch
from planner.policies.llmd_approx_like import ColdLru
from planner.policies.llmd_like import LLMD_BLOCK_TOKENS, clamp, max_score_pick, queue_scores
from planner.policies.llmd_p2p_like import MIN_CACHED_TOKEN_DELTA, p2p_placement
from planner.policy import (
    EngineView,
    Placement,
    PolicyContext,
    RouteRequest,
    StatelessPolicy,
    candidates,
    register,
)


def weighted_match_blocks(request: RouteRequest, match: EngineMatch | None) -> int:
    """The precise producer's match length: the engine's leading run (speculative entries
    included) in whole 64-token blocks, tier-weighted, truncated to an integer."""
    if match is None or match.blocks <= 0:
        return 0
    run = match.blocks * request.block_size // LLMD_BLOCK_TOKENS
    return int(run * match.weighted_blocks / match.blocks)


def held_run_tokens(request: RouteRequest, engine: str) -> int:
    """The destination's run for the pull rule: every tier and speculative entries, unweighted,
    in whole 64-token blocks."""
    match = request.matches.get(engine)
    if match is None:
        return 0
    run = match.blocks * request.block_size
    return run - run % LLMD_BLOCK_TOKENS


@register("llmd-p2p-affinity-like")
class LlmdP2PAffinityScheduler(StatelessPolicy):
    """Precise prefix 3 / queue 2 / kv-util 2 / no-hit-lru 2, highest wins; pull the prefix from
    a near-best peer that leads the chosen engine by `min_cached_token_delta` tokens."""

    name = "llmd-p2p-affinity-like"
    speculative_entries = True
    moves_kv = True
    metrics_interval_s = 0.05
    """llm-d's metrics refresh interval; drivers scrape this often for this policy."""

    def __init__(
        self,
        context: PolicyContext | None = None,
        *,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_utilization_weight: float = 2.0,
        no_hit_lru_weight: float = 2.0,
        min_cached_token_delta: int = MIN_CACHED_TOKEN_DELTA,
        cold_lru_size: int = 1024,
    ) -> None:
        ctx = context or PolicyContext()
        if min_cached_token_delta < 1:
            raise ValueError(f"min_cached_token_delta must be >= 1, got {min_cached_token_delta}")
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_utilization_weight = kv_utilization_weight
        self.no_hit_lru_weight = no_hit_lru_weight
        self.min_cached_token_delta = min_cached_token_delta
        self.link = ctx.link
        self.cold = ColdLru(cold_lru_size)
        self._cold: tuple[str, bool] = ("", False)
        """The last request scored, and whether it was cold (no candidate matched)."""
        self._rng = random.Random(ctx.seed)

    def matches(self, request: RouteRequest, eligible: Sequence[EngineView]) -> dict[str, int]:
        """The producer's integer match length per candidate."""
        return {e.name: weighted_match_blocks(request, request.matches.get(e.name))
                for e in eligible}

    def scores(self, request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
        """Total score per eligible engine, in pool order."""
        eligible = candidates(request, engines)
        matched = self.matches(request, eligible)
        total_blocks = request.prompt_tokens // LLMD_BLOCK_TOKENS
        queue = queue_scores(eligible)
        cold = not any(matched.values())
        self._cold = (request.request_id, cold)
        lru = self.cold.scores(eligible) if cold else dict.fromkeys(matched, 0.5)
        return {
            e.name: self.prefix_weight * clamp(matched[e.name] / total_blocks
                                               if total_blocks else 0.0)
            + self.queue_weight * clamp(queue[e.name])
            + self.kv_utilization_weight * clamp(1.0 - e.kv_usage)
            + self.no_hit_lru_weight * clamp(lru[e.name])
            for e in eligible
        }

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> Placement:
        """The highest total, with a pull when the sampled source leads it by the delta and a
        transfer path exists."""
        eligible = candidates(request, engines)
        engine = self._pick(self.scores(request, eligible))
        if not self.link.enabled:
            return Placement(engine)
        return p2p_placement(request, eligible, engine, held_run_tokens(request, engine),
                             self.min_cached_token_delta)

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """A cold request moves its engine to the front of the no-hit LRU (the scorer's
        PreRequest); the speculative entries are the drivers' (`speculative_entries`)."""
        if self._cold == (request.request_id, True):
            self.cold.touch(placement.engine)

    def _pick(self, totals: Mapping[str, float]) -> str:
        return max_score_pick(totals, self._rng)
