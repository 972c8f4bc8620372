"""`dynamo-like`: NVIDIA Dynamo's KV router (KV-events mode, temperature 0).

Peer rule (Dynamo `DefaultWorkerSelector`, `ActiveSequences`): for each worker

    logit = overlap_score_weight x potential_prefill_tokens / block_size + potential_active_blocks

and the lowest logit wins (temperature 0), equal logits at random (`minimum_cost_index` in
`lib/kv-router/src/scheduling/selector/default.rs` reservoir-samples the tied workers; upstream
tests it in `test_default_selector_randomizes_zero_temperature_ties`; here
`random.Random(context.seed)`). Until 2026-11-27 ties went to the first in pool order; measured
against that (goodput, seed 0, 8 engines: fanout / tree / debate with 100 workflows at 1%,
and their 32k-context 70B forms with 24 workflows at 10%): 5.149 / 2.012 / 4.873 against
5.055 / 2.050 / 4.844, and 0.7919 / 0.3642 / 0.3294 against 0.7919 / 0.3642 / 0.3088. In the
ANCHORS form: prefill_load_scale x max(active_prefill_blocks + prompt_blocks - overlap_blocks, 0)
+ (active_decode_blocks + prompt_blocks), with Dynamo's "decode" blocks being the blocks of *all*
its active sequences, prefilling or decoding.

How Dynamo's terms map onto what the gateway knows (blocks at `request.block_size`):
- overlap_blocks: `request.matches[engine].confirmed_blocks`, the leading blocks the engine's own
  KV events announced. Dynamo's KV-events indexer has no speculative entries, so the gateway's
  are left out here.
- potential_prefill_tokens = active prefill tokens + new tokens. Dynamo's active prefill tokens
  are the uncached tokens (isl - overlap x block_size) of the worker's sequences still in
  prefill: `EngineView.queued_prefill_tokens`, the gateway's same estimate. New tokens are
  `prompt_tokens - overlap_blocks x block_size`, at least 0.
- potential_active_blocks = unique blocks of the worker's active sequences + the request's blocks
  not among them. `EngineView.active_blocks` sums every in-flight request's prompt blocks; the
  policy remembers the block keys it dispatched to subtract blocks counted more than once, and
  counts as new only the request's blocks no in-flight request at the engine holds.
- overlap_score_weight (default 1.0) is named `prefill_load_scale` here.

Router queue (`lib/kv-router/src/scheduling/queue.rs`, `SchedulerQueue`; `router_queue_threshold`
16.0 in `KvRouterConfig::default`, `lib/kv-router/src/scheduling/config.rs` as of ai-dynamo 1.6,
the release that splits `overlap_score_credit` from `prefill_load_scale`; earlier releases had 4.0,
and no queue before that): while *every* worker's active prefill tokens exceed threshold x its
`max_num_batched_tokens`, the router keeps the request itself (`choose` raises `Hold`; the driver
parks it in a `planner.holding.HoldQueue`). Upstream drains its queue on each prefill completion
and each finish, oldest first (FCFS), scheduling while some worker is under the threshold: the
drivers offer held requests again on the same events (and on metrics scrapes), oldest first,
stopping at the first one held still, for that request's model only: the frontend keeps one
KvRouter, and so one queue, per model (`ModelManager::kv_chooser_for` in
`lib/llm/src/discovery/model_manager.rs`, keyed by the model's endpoint in the releases read,
by its name in earlier ones), so another model's requests are still offered. A new arrival
that finds a worker under the threshold is scheduled at once, as upstream. Active prefill
tokens are `EngineView.queued_prefill_tokens`, as in the cost above; `max_num_batched_tokens`
comes from the engine's profile. `queue_threshold=None` turns the queue off.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Sequence
from itertools import repeat
from operator import sub

from kvindex.index import BlockKey
from planner.policy import (
    EngineView,
    Hold,
    Placement,
    PolicyContext,
    RouteRequest,
    candidates,
    register,
)

LONG_CHAIN_BLOCKS = 1024
"""Requests of at least this many blocks (16k tokens at 16 a block) are kept as whole chains."""


class _ActiveBlocks:
    """Block keys of one engine's in-flight requests, and how many they hold more than once.

    A request's keys are a chain (each key digests its parent's), added and removed whole: two
    requests that share a key share every key before it, so the keys in flight are
    prefix-closed and the blocks a prompt shares with them are a leading run, found by
    bisection. Short chains are counted key by key (`count`: a probe per key in and out, and
    a run is found by bisecting for the first key absent); long ones are kept whole (`long`:
    a prompt's run is its longest common prefix with any of them, bisected), since counting
    a 100k-token prompt's blocks in and out cost a pass over them each way, and a pass over
    the engine's in-flight requests per call would cost more where thousands of short ones
    are in flight.
    """

    def __init__(self, long_blocks: int = LONG_CHAIN_BLOCKS) -> None:
        self.long_blocks = long_blocks
        self.count: Counter[BlockKey] = Counter()
        self.long: list[tuple[BlockKey, ...]] = []
        self.repeats = 0
        """Sum over keys of (requests holding it - 1): how far a plain sum overstates the
        unique blocks."""

    def _held_run(self, keys: Sequence[BlockKey]) -> int:
        """The leading run of `keys` some in-flight request holds."""
        count = self.count
        counted = bisect_left(keys, True, key=lambda k: k not in count) if count else 0
        return max(counted, _shared(keys, self.long)) if self.long else counted

    def add(self, keys: tuple[BlockKey, ...]) -> None:
        self.repeats += self._held_run(keys)
        if len(keys) >= self.long_blocks:
            self.long.append(keys)
        else:
            self.count.update(keys)

    def remove(self, keys: tuple[BlockKey, ...]) -> None:
        if len(keys) >= self.long_blocks:
            for at, c in enumerate(self.long):
                if c is keys:
                    del self.long[at]
                    self.repeats -= self._held_run(keys)
                    return
            return
        # Counts never rise along a chain, so the keys other short requests hold too are a
        # leading run; the long ones' share is their common prefix.
        count = self.count
        get = count.get
        shared = bisect_left(keys, True, key=lambda k: get(k, 0) <= 1)
        if shared:
            lead = keys[:shared]
            dict.update(count, zip(lead, map(sub, map(count.__getitem__, lead), repeat(1)),
                                   strict=True))
        deque(map(count.pop, keys[shared:], repeat(None)), maxlen=0)
        self.repeats -= max(shared, _shared(keys, self.long)) if self.long else shared

    def new_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys` no in-flight request holds: all after the longest held run."""
        return len(keys) - self._held_run(keys)


def _shared(keys: Sequence[BlockKey], chains: list[tuple[BlockKey, ...]]) -> int:
    """The longest common prefix of chained `keys` with any of `chains`."""
    best = 0
    n = len(keys)
    for c in chains:
        m = min(n, len(c))
        # Chained keys: the prefixes agree up to a position exactly where the keys there do.
        if m <= best or c[best] != keys[best]:
            continue
        if c[m - 1] == keys[m - 1]:
            best = m
            if best == n:
                break
            continue
        best = _first_difference(keys, c, best, m - 1)
    return best


def _first_difference(a: Sequence[BlockKey], b: Sequence[BlockKey], lo: int, hi: int) -> int:
    """The first position in [lo, hi] where chained `a` and `b` differ (they agree at `lo` and
    differ at `hi`)."""
    return lo + bisect_left(range(lo, hi + 1), True, key=lambda i: a[i] != b[i])


_NONE_ACTIVE = _ActiveBlocks()


@register("dynamo-like")
class DynamoKvRouter:
    """Lowest prefill-plus-decode block cost, prefill discounted by the confirmed overlap."""

    name = "dynamo-like"
    speculative_entries = False
    moves_kv = False

    def __init__(
        self,
        context: PolicyContext | None = None,
        *,
        prefill_load_scale: float = 1.0,
        queue_threshold: float | None = 16.0,
    ) -> None:
        self.context = context or PolicyContext()
        self.prefill_load_scale = prefill_load_scale
        self.queue_threshold = queue_threshold
        self._active: dict[str, _ActiveBlocks] = {}
        self._routed: dict[str, tuple[str, tuple[BlockKey, ...]]] = {}
        self._rng = random.Random(self.context.seed)

    def costs(self, request: RouteRequest, engines: Sequence[EngineView]) -> dict[str, float]:
        """Dynamo's logit per eligible engine, in pool order."""
        block_size = request.block_size
        costs: dict[str, float] = {}
        for e in candidates(request, engines):
            match = request.matches.get(e.name)
            overlap = match.confirmed_blocks if match is not None else 0
            new_tokens = max(request.prompt_tokens - overlap * block_size, 0)
            prefill_blocks = (e.queued_prefill_tokens + new_tokens) / block_size
            active = self._active.get(e.name, _NONE_ACTIVE)
            decode_blocks = (max(e.active_blocks - active.repeats, 0)
                             + active.new_blocks(request.block_keys))
            costs[e.name] = self.prefill_load_scale * prefill_blocks + decode_blocks
        return costs

    def all_backed_up(self, engines: Sequence[EngineView]) -> bool:
        """Every engine's active prefill tokens exceed the queue threshold's share of its
        batched-token budget (never true with the queue off or no engines)."""
        if self.queue_threshold is None or not engines:
            return False
        return all(
            e.queued_prefill_tokens
            > self.queue_threshold * self.context.profile(e.name).max_num_batched_tokens
            for e in engines)

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """Hold while every engine is backed up on prefill; else the lowest cost, equal costs
        at random."""
        costs = self.costs(request, engines)
        eligible = [e for e in engines if e.name in costs]
        if self.all_backed_up(eligible):
            raise Hold(f"every engine has more than {self.queue_threshold:g} x its batched-token "
                       f"budget of prefill queued")
        best = min(costs.values())
        tied = [name for name, cost in costs.items() if cost == best]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """The request's blocks become active at the engine."""
        engine = placement.engine
        self._active.setdefault(engine, _ActiveBlocks()).add(request.block_keys)
        self._routed[request.request_id] = (engine, request.block_keys)

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Prefill progress is read from `EngineView.queued_prefill_tokens`."""

    def on_finish(
        self, request_id: str, engine: str, now: float, output_tokens: int = 0
    ) -> None:
        """The request's blocks stop being active."""
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            self._active[routed[0]].remove(routed[1])
