"""`llmd-approx-like`: llm-d's default well-lit path (`optimized-baseline`), approximate prefix.

Peer rule: total = sum of weight x clamp(score, 0, 1) over the scorers, the highest total wins,
ties at random (max-score picker). Weights of the default path: prefix-cache 3, queue 2,
kv-cache-utilization 2, no-hit-lru 2. Scorers:
- prefix-cache-scorer (GIE `pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go` and
  `indexer.go`, as shipped with llm-d v0.8.x / GIE v1.x): the prompt is cut into blocks of 16
  tokens (`blockSizeTokens`), at most the first 256 (`maxPrefixBlocksToMatch`), each block's hash
  chained to the previous one (here the gateway's own chained block keys, which are exactly such
  a chain). The plugin keeps its own record, per pod an LRU of block hashes filled *at
  routing time* (PreRequest), as many as the pod's KV cache holds blocks (`autoTune`, true by
  default in GIE v1.5.0: the capacity is the engine's own block count; 31,250,
  `lruCapacityPerServer`, only without it), with every hash of the request
  routed there. To score, it walks the prompt's blocks from the first while any pod holds the
  block and counts, per pod, the blocks it holds; score = that count / the prompt's blocks. It
  never sees the engines' KV events, so it neither learns evictions nor needs speculative entries.
- no-hit-lru-scorer (llm-d-inference-scheduler `pkg/plugins/scorer/no_hit_lru.go`): a request no
  pod has a prefix hit for is "cold". Cold requests score pods by when they last received a cold
  request: never-used pods first (1 - i / (n - 1) in pool order), then the least recently used
  (rank = never-used count + LRU position, oldest first); warm requests score 0.5 everywhere. The
  pod a cold request is routed to moves to the front of that LRU (at most 1,024 pods).
- queue-scorer and kv-cache-utilization-scorer: as in `llmd-like` (scraped waiting count,
  min-max over the candidates; 1 - KV usage), read at llm-d's 50 ms metrics refresh.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvindex.index import BlockKey
from planner.policies.llmd_like import clamp, max_score_pick, queue_scores
from planner.policy import EngineView, Placement, PolicyContext, RouteRequest, candidates, register


class PodBlockLru:
    """One pod's approximate cache: block hashes it was routed, least recently routed first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[BlockKey]) -> None:
        """Record `keys` as most recently used, dropping the oldest beyond capacity."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)


def block_hashes(request: RouteRequest, block_tokens: int, max_blocks: int
                 ) -> tuple[BlockKey, ...]:
    """The prompt's chained hashes in `block_tokens` blocks (every such block's last index key:
    the index's keys chain, so that key digests the whole prefix), at most `max_blocks`."""
    step = max(1, block_tokens // max(1, request.block_size))
    return request.block_keys[step - 1::step][:max_blocks]


def approx_prefix_matches(pods: Mapping[str, PodBlockLru], hashes: Sequence[BlockKey]
                          ) -> dict[str, int]:
    """Per pod with a hit, the blocks its record holds, walking from the first block while any
    pod holds the block (the approximate plugin's `matchLongestPrefix`)."""
    matched: dict[str, int] = {}
    for key in hashes:
        holders = [name for name, lru in pods.items() if key in lru]
        if not holders:
            break
        for name in holders:
            matched[name] = matched.get(name, 0) + 1
    return matched


def record_routing(pods: dict[str, PodBlockLru], engine: str, hashes: Sequence[BlockKey],
                   capacity: int) -> None:
    """The approximate plugin's PreRequest: `engine`'s record learns the prompt's hashes."""
    if hashes:
        pod = pods.get(engine)
        if pod is None:
            pod = pods[engine] = PodBlockLru(capacity)
        pod.add(hashes)


class ColdLru:
    """The no-hit-lru scorer's state: pods that received cold requests (no pod had a prefix
    hit), least recently first, at most `size`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: OrderedDict[str, None] = OrderedDict()

    def scores(self, eligible: Sequence[EngineView]) -> dict[str, float]:
        """Cold-request spreading: never-used pods first, then least recently used."""
        n = len(eligible)
        if n == 1:
            return {eligible[0].name: 1.0}
        position = {name: i for i, name in enumerate(self.order)}
        never_used = [e.name for e in eligible if e.name not in position]
        scores = {name: 1.0 - i / (n - 1) for i, name in enumerate(never_used)}
        for e in eligible:
            if e.name in position:
                rank = len(never_used) + position[e.name]
                scores[e.name] = max(0.0, 1.0 - rank / (n - 1))
        return scores

    def touch(self, engine: str) -> None:
        """A cold request went to `engine`: it becomes the most recently used."""
        self.order[engine] = None
        self.order.move_to_end(engine)
        if len(self.order) > self.size:
            self.order.popitem(last=False)


@register("llmd-approx-like")
class LlmdApproximateScheduler:
    """Weighted sum of approximate-prefix, queue, KV-utilisation and no-hit-LRU scores."""

    name = "llmd-approx-like"
    reads_index = False
    speculative_entries = False
    moves_kv = False
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
        block_tokens: int = 16,
        max_prefix_blocks: int = 256,
        lru_capacity_per_pod: int | None = None,
        cold_lru_size: int = 1024,
    ) -> None:
        ctx = context or PolicyContext()
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_utilization_weight = kv_utilization_weight
        self.no_hit_lru_weight = no_hit_lru_weight
        self.block_tokens = block_tokens
        self.max_prefix_blocks = max_prefix_blocks
        self.lru_capacity_per_pod = lru_capacity_per_pod
        """A fixed capacity (`autoTune: false`); None: each pod's own block count."""
        self._context = ctx
        self.cold_lru_size = cold_lru_size
        self.pods: dict[str, PodBlockLru] = {}
        self.cold = ColdLru(cold_lru_size)
        """Pods that received cold requests, least recently first."""
        self._rng = random.Random(ctx.seed)

    def prompt_hashes(self, request: RouteRequest) -> tuple[BlockKey, ...]:
        """The prompt's chained hashes in `block_tokens` blocks (the index's blocks when those
        are larger), at most `max_prefix_blocks`."""
        return block_hashes(request, self.block_tokens, self.max_prefix_blocks)

    def prefix_matches(self, hashes: Sequence[BlockKey]) -> dict[str, int]:
        """Per pod with a hit, the blocks it holds (`approx_prefix_matches`)."""
        return approx_prefix_matches(self.pods, hashes)

    def no_hit_lru_scores(self, eligible: Sequence[EngineView]) -> dict[str, float]:
        """Cold-request spreading: never-used pods first, then least recently used."""
        return self.cold.scores(eligible)

    def scores(self, request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
        """Total score per eligible engine, in pool order."""
        eligible = candidates(request, engines)
        hashes = self.prompt_hashes(request)
        matched = self.prefix_matches(hashes)
        queue = queue_scores(eligible)
        if matched:
            lru = dict.fromkeys((e.name for e in eligible), 0.5)
        else:
            lru = self.no_hit_lru_scores(eligible)
        total = len(hashes)
        return {
            e.name: self.prefix_weight * clamp(matched.get(e.name, 0) / total if total else 0.0)
            + self.queue_weight * clamp(queue[e.name])
            + self.kv_utilization_weight * clamp(1.0 - e.kv_usage)
            + self.no_hit_lru_weight * clamp(lru[e.name])
            for e in eligible
        }

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """Highest total; a seeded random pick among equal totals."""
        return self._pick(self.scores(request, engines))

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """The prefix record learns the prompt at `engine`; a cold request moves `engine` to the
        front of the no-hit LRU (both the peer's PreRequest hooks)."""
        engine = placement.engine
        hashes = self.prompt_hashes(request)
        if not self.prefix_matches(hashes):
            self.cold.touch(engine)
        record_routing(self.pods, engine, hashes, self.capacity(engine))

    def capacity(self, engine: str) -> int:
        """The pod's LRU capacity: its KV cache's blocks of `block_tokens` (autoTune), unless a
        fixed one was configured."""
        if self.lru_capacity_per_pod is not None:
            return self.lru_capacity_per_pod
        return self._context.profile(engine).num_blocks(self.block_tokens)

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Not used by the peer."""

    def on_finish(
        self, request_id: str, engine: str, now: float, output_tokens: int = 0
    ) -> None:
        """Not used by the peer (its record ages only by LRU capacity)."""

    def _pick(self, totals: Mapping[str, float]) -> str:
        return max_score_pick(totals, self._rng)
