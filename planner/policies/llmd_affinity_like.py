"""`llmd-affinity-like` and `llmd-approx-affinity-like`: llm-d's current default scheduling,
prefix-cache affinity with a load gate, then the token-load scorer; and
`llmd-p2p-tokenaware-like`, the token-aware arm of llm-d's P2P guide (the token-load scorer
alone, plus the P2P pull).

Both llm-d guides that route by prefix now deploy one scheduling profile of two plugins (the
max-score picker is added by the loader): `prefix-cache-affinity-filter`, then
`token-load-scorer`, fed by `inflight-load-producer`. They differ in the prefix producer:
- `llmd-affinity-like`: llm-d/llm-d `guides/precise-prefix-cache-routing/router/
  precise-prefix-cache-routing.values.yaml` (8052f22): `precise-prefix-cache-producer` with
  64-token blocks and `speculativeIndexing: true`, the filter's `peakPrefillThroughput` 15926.
- `llmd-approx-affinity-like`: `guides/optimized-baseline/router/optimized-baseline.values.yaml`
  (0a3b0c9), llm-d's default path: `approx-prefix-cache-producer` with
  `maxPrefixTokensToMatch: 40960`, the filter's `affinityThreshold` 0.80 and
  `maxTokensInFlightPenalty` 286720.

Code read at llm-d-router v0.10.0 (71f4f09; main at ebab687, 2026-08-22, the same in these
rules), paths under `pkg/epp/framework/plugins/`:
- Filter (`scheduling/filter/prefixcacheaffinity/plugin.go` L165-276): with one candidate, keep
  it; an endpoint is sticky when its prefix score (matched blocks / the prompt's blocks) is at
  least `affinityThreshold` 0.80; no sticky endpoint keeps all; otherwise keep the sticky ones
  unless the lowest in-flight tokens among them, as a TTFT at `peakPrefillThroughput`
  (tokens x 1000 / peak, ms), exceeds the lowest among the others by more than
  `maxTTFTPenaltyMs` (18000 by default), when all are kept. `explorationProbability` is 0.
- Scorer (`scheduling/scorer/tokenload/token_load.go` L93-130): score = 1 - min(tokens, T) / T
  with T = `queueThresholdTokens` 4,194,304, tokens = the endpoint's in-flight tokens plus this
  request's uncached prompt tokens there (1.0 when that is 0); weight 1, so the least such load
  wins.
- In-flight load (`requestcontrol/dataproducer/inflightload/producer.go` L373-549): a request
  adds its uncached prompt tokens at the endpoint it is sent to, (prompt blocks - matched
  blocks) x block size plus the prompt's tail beyond its blocks, fixed when it is routed, and
  releases them at the first response chunk the router sees (`releaseTokensEarly`); output
  tokens are not counted (`addEstimatedOutputTokens` false). A streamed answer's first chunk
  is its first token; a non-streamed answer's is its end, so for non-streaming clients (as
  many agent frameworks call) the count holds every request until it finishes. Both happen in
  deployments; the policy releases at the end by default, the stronger reading here: it lets
  the scorer see the requests still decoding, where the first-token reading sees only prefill
  (fanout, 32k contexts, 4 agent types, 24 workflows on 8 x `h100x4-llama3-70b`, seed 0: mean
  JCT 1.40x the bound at 0.488 workflows/s against 1.78x, and 1.38x against 2.09x at 0.244/s).
  `release_at_first_token=True` gives the streamed reading.
- Picker (`scheduling/picker/maxscore/picker.go` L87-115): shuffle, then stable sort, one
  endpoint: equal scores at random (here `random.Random(context.seed)`).
- Precise producer (`requestcontrol/dataproducer/preciseprefixcache/producer.go` L327-392,
  llm-d-kv-cache `kvblock_scorer.go`): the prompt's whole 64-token blocks; an endpoint's match is
  its leading run of them, confirmed entries weighted by tier (GPU 1.0, CPU 0.8) and speculative
  ones 1.0, truncated to an integer (`weighted_match_blocks`); a prompt under one block has no
  prefix information (nothing is sticky, the whole prompt is uncached). Speculative entries are
  entered for the chosen endpoint at routing and expire after 2 s: the policy declares
  `speculative_entries` and the drivers add the gateway's own with that TTL.
- Approximate producer (`requestcontrol/dataproducer/approximateprefix/plugin.go` L258-375,
  `prefixhash/hashing.go`): its own record, per endpoint an LRU of the block hashes routed there
  (capacity `lruCapacityPerServer` 31,250, as `llmd-approx-like`), filled when a request is
  routed; blocks of max(64, the engine's block size) tokens, at most 40960 / 64 = 640 of them;
  the match walks the blocks from the first while any endpoint holds the block, counting each
  endpoint's. It never sees the engines' KV events (`reads_index` False).

The P2P guide's token-aware arm (llm-d/llm-d `guides/p2p-kv-cache-sharing/benchmarking/
epp-tokenaware-p2p.yaml`, f64e6a8; on the guide's document Q&A benchmark it read 6.28 requests/s
against 4.43 for the load arm `llmd-p2p-like` follows): the precise producer (64-token blocks,
`speculativeIndexing: false`, CPU tier weight 0.9: the engines here have no CPU tier), the
in-flight load discounted by that producer's match, `token-load-scorer` over every endpoint (no
affinity filter), `max-score-picker`, and `p2p-source-producer` with `minCachedTokenDelta` 2048:
the same pull rule as `llmd-p2p-like` (`p2p_placement`), the destination's run counted in whole
64-token blocks (`held_run_tokens`).

Readings (the stronger where the guides leave room):
- The optimized-baseline file sets `maxTokensInFlightPenalty`, which no tagged router accepts
  (added on main 2026-05-20, removed 2026-06-11 in favour of `peakPrefillThroughput`; plugin
  parameters are decoded strictly since 2026-05-24), beside `maxTTFTPenaltyMs: 0` (which alone
  would mean "always stick", no load gate at all). We read it as its author meant it
  (llm-d/llm-d#1651): stickiness breaks when the in-flight gap exceeds 286,720 tokens, within 16
  tokens of the default gate (18000 ms x 15928 tokens/s), exploration off.
- The approximate producer estimates tokens from the text (about 4 bytes each, no tokenizer in
  that guide) and hashes the prompt's partial last block too; here both producers see the
  prompt's real tokens in whole blocks (the gateway's block keys, whose every fourth key chains
  a 64-token block).
- The gate and the scorer see every request this router sent (one EPP replica, as both guides
  deploy); requests from other clients are invisible to both, as to the peer.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from kvindex.index import BlockKey
from planner.policies.llmd_approx_like import (
    PodBlockLru,
    approx_prefix_matches,
    block_hashes,
    record_routing,
)
from planner.policies.llmd_like import LLMD_BLOCK_TOKENS, max_score_pick
from planner.policies.llmd_p2p_affinity_like import held_run_tokens, weighted_match_blocks
from planner.policies.llmd_p2p_like import MIN_CACHED_TOKEN_DELTA, p2p_placement
from planner.policy import (
    EngineView,
    Placement,
    PolicyContext,
    RouteRequest,
    candidates,
    register,
)

AFFINITY_THRESHOLD = 0.80
"""`affinityThreshold`: the prefix score that makes an endpoint sticky."""
MAX_TTFT_PENALTY_MS = 18000.0
"""`maxTTFTPenaltyMs` default (llm-d-router #1639, 2026-06-13)."""
PRECISE_PEAK_PREFILL_THROUGHPUT = 15926.0
"""`peakPrefillThroughput` the precise guide sets (tokens/s)."""
APPROX_GATE_TOKENS = 286720
"""The optimized-baseline guide's in-flight token gate (`maxTokensInFlightPenalty`)."""
QUEUE_THRESHOLD_TOKENS = 4194304
"""`queueThresholdTokens`: the token-load scorer's cap."""
APPROX_MAX_PREFIX_TOKENS = 40960
"""`maxPrefixTokensToMatch` in the optimized-baseline guide."""


class InflightTokens:
    """The inflight-load producer: per endpoint, the uncached prompt tokens of the requests this
    router sent there that have not released them yet (at their first response chunk: the end
    of a non-streamed answer, the first token of a streamed one)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self._requests: dict[str, tuple[str, int]] = {}

    def load(self, engine: str) -> int:
        """In-flight tokens at `engine`."""
        return self.tokens.get(engine, 0)

    def add(self, request_id: str, engine: str, tokens: int) -> None:
        """A request was sent to `engine` with `tokens` uncached prompt tokens."""
        self.release(request_id)
        self._requests[request_id] = (engine, tokens)
        self.tokens[engine] = self.tokens.get(engine, 0) + tokens

    def release(self, request_id: str) -> None:
        """The request's first response chunk (or its end): its tokens leave the count."""
        held = self._requests.pop(request_id, None)
        if held is not None:
            engine, tokens = held
            self.tokens[engine] = max(0, self.tokens.get(engine, 0) - tokens)


def affinity_filter(eligible: Sequence[EngineView], prefix: Mapping[str, float],
                    inflight: InflightTokens, threshold: float, gate_tokens: float
                    ) -> list[EngineView]:
    """The prefix-cache-affinity filter: the endpoints whose prefix score reaches `threshold`,
    unless none does or the least loaded of them carries more than `gate_tokens` in-flight
    tokens beyond the least loaded of the rest (then every endpoint)."""
    if len(eligible) <= 1 or threshold <= 0:
        return list(eligible)
    sticky = [e for e in eligible if prefix.get(e.name, 0.0) >= threshold]
    if not sticky:
        return list(eligible)
    others = [e for e in eligible if prefix.get(e.name, 0.0) < threshold]
    if others:
        gap = (min(inflight.load(e.name) for e in sticky)
               - min(inflight.load(e.name) for e in others))
        if gap > gate_tokens:
            return list(eligible)
    return sticky


def token_load_score(inflight_tokens: int, uncached_tokens: int) -> float:
    """The token-load scorer: 1 - min(tokens, cap) / cap over in-flight plus this request's
    uncached tokens at the endpoint."""
    tokens = inflight_tokens + uncached_tokens
    if tokens <= 0:
        return 1.0
    return 1.0 - min(tokens, QUEUE_THRESHOLD_TOKENS) / QUEUE_THRESHOLD_TOKENS


class _AffinityScheduler(ABC):
    """The shared profile: affinity filter, token-load scorer, max-score picker, in-flight load
    from the requests' uncached tokens. Subclasses supply the prefix producer."""

    name = "llmd-affinity"
    speculative_entries = False
    moves_kv = False

    def __init__(self, context: PolicyContext | None, threshold: float, gate_tokens: float,
                 release_at_first_token: bool) -> None:
        ctx = context or PolicyContext()
        self.threshold = threshold
        self.gate_tokens = gate_tokens
        self.release_at_first_token = release_at_first_token
        self.inflight = InflightTokens()
        self._rng = random.Random(ctx.seed)
        self._uncached: tuple[str, dict[str, int]] = ("", {})
        """The last request routed and its uncached tokens per candidate."""

    @abstractmethod
    def prefix(self, request: RouteRequest, eligible: Sequence[EngineView]
               ) -> tuple[dict[str, int], int, int]:
        """The prefix producer: per candidate, the matched blocks; the prompt's blocks; tokens
        per block."""

    def uncached(self, request: RouteRequest, matched: int, total: int, block: int) -> int:
        """Uncached prompt tokens at an endpoint matching `matched` of the prompt's `total`
        blocks: the unmatched blocks and the tail beyond the blocks."""
        return (max(0, (total - matched) * block)
                + max(0, request.prompt_tokens - total * block))

    def scores(self, request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
        """Token-load score per endpoint the affinity filter keeps."""
        eligible = candidates(request, engines)
        matched, total, block = self.prefix(request, eligible)
        prefix = {name: m / total for name, m in matched.items()} if total else {}
        uncached = {e.name: self.uncached(request, matched.get(e.name, 0), total, block)
                    for e in eligible}
        self._uncached = (request.request_id, uncached)
        kept = affinity_filter(eligible, prefix, self.inflight, self.threshold, self.gate_tokens)
        return {e.name: token_load_score(self.inflight.load(e.name), uncached[e.name])
                for e in kept}

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float
               ) -> str | Placement:
        """The kept endpoint with the least in-flight plus uncached tokens; ties at random."""
        return max_score_pick(self.scores(request, engines), self._rng)

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """The in-flight producer's PreRequest: the request's uncached tokens at its endpoint,
        as scored."""
        rid, uncached = self._uncached
        engine = placement.engine
        tokens = uncached.get(engine) if rid == request.request_id else None
        if tokens is None:
            matched, total, block = self.prefix(request, [])
            tokens = self.uncached(request, matched.get(engine, 0), total, block)
        self.inflight.add(request.request_id, engine, tokens)

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """A streamed answer's first chunk releases the request's tokens (with
        `release_at_first_token`)."""
        if self.release_at_first_token:
            self.inflight.release(request_id)

    def on_finish(self, request_id: str, engine: str, now: float, output_tokens: int = 0
                  ) -> None:
        """A non-streamed answer's first chunk is its end: the tokens leave now (and those of a
        request that failed before its first token)."""
        self.inflight.release(request_id)


@register("llmd-affinity-like")
class LlmdAffinityScheduler(_AffinityScheduler):
    """The precise guide: KV-event prefix with speculative entries, affinity filter with the
    18 s TTFT gate at 15,926 tokens/s, token-load scorer."""

    name = "llmd-affinity-like"
    speculative_entries = True

    def __init__(self, context: PolicyContext | None = None, *,
                 threshold: float = AFFINITY_THRESHOLD,
                 max_ttft_penalty_ms: float = MAX_TTFT_PENALTY_MS,
                 peak_prefill_throughput: float = PRECISE_PEAK_PREFILL_THROUGHPUT,
                 release_at_first_token: bool = False) -> None:
        if max_ttft_penalty_ms <= 0:
            gate = float("inf")  # upstream: a penalty of 0 turns the gate off
        else:
            if peak_prefill_throughput <= 0:
                raise ValueError("peak_prefill_throughput must be positive with a TTFT penalty")
            gate = max_ttft_penalty_ms * peak_prefill_throughput / 1000.0
        super().__init__(context, threshold, gate, release_at_first_token)

    def prefix(self, request: RouteRequest, eligible: Sequence[EngineView]
               ) -> tuple[dict[str, int], int, int]:
        """Whole 64-token blocks matched per endpoint (speculative entries included), and the
        prompt's whole blocks."""
        total = request.prompt_tokens // LLMD_BLOCK_TOKENS
        if total <= 0:
            return {}, 0, LLMD_BLOCK_TOKENS
        names = [e.name for e in eligible] if eligible else list(request.matches)
        return ({name: min(total, weighted_match_blocks(request, request.matches.get(name)))
                 for name in names}, total, LLMD_BLOCK_TOKENS)


@register("llmd-approx-affinity-like")
class LlmdApproxAffinityScheduler(_AffinityScheduler):
    """The optimized-baseline guide: an approximate prefix record of its own routing, affinity
    filter with a 286,720-token in-flight gate, token-load scorer."""

    name = "llmd-approx-affinity-like"
    reads_index = False

    def __init__(self, context: PolicyContext | None = None, *,
                 threshold: float = AFFINITY_THRESHOLD,
                 gate_tokens: float = APPROX_GATE_TOKENS,
                 max_prefix_tokens: int = APPROX_MAX_PREFIX_TOKENS,
                 lru_capacity_per_pod: int = 31250,
                 release_at_first_token: bool = False) -> None:
        super().__init__(context, threshold, gate_tokens, release_at_first_token)
        self.max_prefix_tokens = max_prefix_tokens
        self.lru_capacity_per_pod = lru_capacity_per_pod
        self.pods: dict[str, PodBlockLru] = {}

    def block_tokens(self, request: RouteRequest) -> int:
        """max(64, the engines' block size), as a whole number of index blocks."""
        size = max(LLMD_BLOCK_TOKENS, request.block_size)
        return size - size % request.block_size if request.block_size > 0 else size

    def hashes(self, request: RouteRequest) -> tuple[BlockKey, ...]:
        """The prompt's chained hashes per producer block, at most `max_prefix_tokens` worth."""
        block = self.block_tokens(request)
        return block_hashes(request, block, self.max_prefix_tokens // block)

    def prefix(self, request: RouteRequest, eligible: Sequence[EngineView]
               ) -> tuple[dict[str, int], int, int]:
        """Per endpoint with a hit, the blocks its record holds, walking from the first block
        while any endpoint holds it; the prompt's blocks."""
        hashes = self.hashes(request)
        return approx_prefix_matches(self.pods, hashes), len(hashes), self.block_tokens(request)

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """Charge the in-flight tokens, then record the prompt's blocks for the endpoint."""
        super().on_dispatch(request, placement, now)
        record_routing(self.pods, placement.engine, self.hashes(request),
                       self.lru_capacity_per_pod)


@register("llmd-p2p-tokenaware-like")
class LlmdP2PTokenAwareScheduler(LlmdAffinityScheduler):
    """The P2P guide's token-aware arm: the least in-flight plus uncached tokens over every
    endpoint (the precise index's confirmed blocks), then a pull from a near-best peer that leads
    the chosen endpoint by `min_cached_token_delta` tokens."""

    name = "llmd-p2p-tokenaware-like"
    speculative_entries = False
    moves_kv = True

    def __init__(self, context: PolicyContext | None = None, *,
                 min_cached_token_delta: int = MIN_CACHED_TOKEN_DELTA,
                 release_at_first_token: bool = False) -> None:
        if min_cached_token_delta < 1:
            raise ValueError(f"min_cached_token_delta must be >= 1, got {min_cached_token_delta}")
        super().__init__(context, threshold=0.0, release_at_first_token=release_at_first_token)
        self.min_cached_token_delta = min_cached_token_delta
        self.link = (context or PolicyContext()).link

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float
               ) -> str | Placement:
        """The least loaded endpoint by tokens, with a pull when a transfer path exists and the
        sampled source leads it by the delta."""
        eligible = candidates(request, engines)
        engine = max_score_pick(self.scores(request, eligible), self._rng)
        if not self.link.enabled:
            return engine
        return p2p_placement(request, eligible, engine, held_run_tokens(request, engine),
                             self.min_cached_token_delta)
