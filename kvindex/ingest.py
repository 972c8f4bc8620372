"""Turn engines' KV-event streams into index operations (sans-IO).

Per engine this keeps the sequence number and a map from the engine's block hashes to the
index's own keys, computed from the `token_ids` each BlockStored carries, chained from the
parent's keys. It never needs to reproduce vLLM's digest, and the engine's block size may be any
size: index keys are cut from the token stream at the index block size, carrying a partial tail
from block to block when the index block is larger.

It detects sequence gaps (asks for a replay, buffers live batches meanwhile), engine restarts
(sequence goes backwards: the engine's entries are dropped) and unknown parents (orphans, which
are counted and skipped). The caller performs the returned operations on a `KVIndexBackend` and
the replays on the engine's replay socket.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
)
from kvindex.index import DEFAULT_TIER, BlockKey, InMemoryIndex
from kvindex.keys import KeyExtras, block_key, chain_keys

log = logging.getLogger(__name__)

EngineHash = int | bytes


@dataclass(frozen=True)
class AddKeys:
    """The engine now holds one more copy of each key."""

    engine: str
    keys: tuple[BlockKey, ...]
    tier: str


@dataclass(frozen=True)
class RemoveKeys:
    """The engine dropped one copy of each key."""

    engine: str
    keys: tuple[BlockKey, ...]
    tier: str


@dataclass(frozen=True)
class ClearEngine:
    """Forget everything the index holds for the engine."""

    engine: str
    reason: str


IndexOp = AddKeys | RemoveKeys | ClearEngine


@dataclass(frozen=True)
class RequestReplay:
    """Ask the engine's replay endpoint for every batch from `from_seq` on."""

    engine: str
    from_seq: int
    generation: int = field(default=0, compare=False)
    """Identifies this replay run: answers for an older run (the engine was reset since) are
    ignored."""


@dataclass
class IngestResult:
    """What the caller must do after feeding one message."""

    ops: list[IndexOp] = field(default_factory=list)
    replay: RequestReplay | None = None


@dataclass(slots=True)
class _Chain:
    """Where an engine block leaves the index chain (the uncommon, non-compact form)."""

    keys: tuple[BlockKey, ...]
    tail: BlockKey | None
    pending: tuple[int, ...]
    blocks: int
    salt: str | None
    copies: int
    tier: str


# The common case (index block == engine block or divides it, GPU tier, one copy) is stored as
# just the block's last index key, which is also where its children continue the chain.
_BlockState = int | _Chain


MAX_REPLAY_ROUNDS = 64
"""Times one replay is asked again from where it broke off (each round gets at least one batch
further; vLLM's buffer of 10,000 batches takes about ten)."""


@dataclass
class IngestStats:
    """Counters for metrics and tests."""

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    orphans: int = 0
    unknown_removals: int = 0
    gaps: int = 0
    replays_requested: int = 0
    replay_rounds: int = 0
    """Replays asked again from where one broke off (the engine's send queue dropped the rest)."""
    restarts: int = 0
    resyncs: int = 0
    decode_errors: int = 0
    unknown_events: int = 0
    """Events of a type this release does not know (a later vLLM's), skipped one by one."""


@dataclass
class _EngineState:
    last_seq: int | None = None
    block_size: int = 0
    blocks: dict[EngineHash, _BlockState] = field(default_factory=dict)
    """The engine's GPU blocks (vLLM's default medium)."""
    offloaded: dict[str, dict[EngineHash, _BlockState]] = field(default_factory=dict)
    """Per other medium (CPU, DISK: a KV offloading connector's copies), its blocks: a copy
    offloaded under the same hash is another record, so its removal takes nothing of the GPU
    block's (one table for all made the CPU copy's removal consume the GPU record, and the GPU
    block's own removal then found nothing: its index entry stayed for good)."""

    def table(self, tier: str) -> dict[EngineHash, _BlockState]:
        """The records of `tier`'s blocks."""
        if tier == DEFAULT_TIER:
            return self.blocks
        return self.offloaded.setdefault(tier, {})

    def clear(self) -> None:
        """Forget every block, in every medium."""
        self.blocks.clear()
        self.offloaded.clear()
    replaying: bool = False
    replay_target: int = 0
    replay_generation: int = -1
    # This round of the replay: batches it applied, and whether it broke off (a jump).
    round_applied: int = 0
    round_cut: bool = False
    rounds: int = 0
    # Live batches that arrived while a replay was running, by sequence number.
    held: dict[int, KVEventBatch] = field(default_factory=dict)
    # When (the ingestor's clock) the events showed a new process (sequence went backwards).
    restarted_at: float | None = None


class EventIngestor:
    """Maps every engine's KV events to index operations at one index block size."""

    def __init__(self, index_block_size: int, replay_available: set[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if index_block_size <= 0:
            raise ValueError("index block size must be positive")
        self._clock = clock
        self.block_size = index_block_size
        self.replay_available = set(replay_available or ())
        self.stats = IngestStats()
        self._engines: dict[str, _EngineState] = {}
        self._replay_generation = 0
        self._unknown_tags: set[str] = set()

    def engine_blocks(self, engine: str) -> int:
        """Engine block hashes currently mapped for `engine`."""
        state = self._engines.get(engine)
        return len(state.blocks) if state else 0

    def engine_block_size(self, engine: str) -> int:
        """The engine's KV block size as its events report it (0 before any BlockStored)."""
        state = self._engines.get(engine)
        return state.block_size if state else 0

    def last_seq(self, engine: str) -> int | None:
        """Last sequence number applied for `engine`."""
        state = self._engines.get(engine)
        return state.last_seq if state else None

    def restart_seen(self, engine: str, within_s: float) -> bool:
        """Whether the engine's events showed it restarting in the last `within_s` seconds (so
        what is held for it now is the new process's)."""
        state = self._engines.get(engine)
        return (state is not None and state.restarted_at is not None
                and self._clock() - state.restarted_at <= within_s)

    def forget(self, engine: str, reason: str = "engine left the pool") -> list[IndexOp]:
        """The engine left the pool: drop its state and its index entries."""
        self._engines.pop(engine, None)
        return [ClearEngine(engine, reason)]

    # -- live stream ----------------------------------------------------------------------------

    def _state(self, engine: str, result: IngestResult) -> _EngineState:
        state = self._engines.get(engine)
        if state is None:
            # First contact (gateway start, engine added, or after forget): whatever a shared
            # index holds for this engine was counted without us and cannot be reconciled.
            state = self._engines[engine] = _EngineState()
            result.ops.append(ClearEngine(engine, "first contact with this engine's events"))
        return state

    def probe(self, engine: str) -> IngestResult:
        """Ask an engine we have not heard from for its buffered events.

        PUB/SUB drops what is published before the subscription reaches the engine, and an
        engine that then stays quiet would never reveal the loss; a replay from 0 recovers it.
        """
        result = IngestResult()
        if engine not in self.replay_available:
            return result
        state = self._state(engine, result)
        if state.replaying or state.last_seq is not None:
            return result
        result.replay = self._begin_replay(state, engine, 0)
        return result

    def on_message(self, engine: str, seq: int, payload: bytes) -> IngestResult:
        """One live `[topic, seq, payload]` message from `engine`."""
        batch = self._decode(payload)
        if batch is None:
            return IngestResult()
        return self.on_batch(engine, seq, batch)

    def on_batch(self, engine: str, seq: int, batch: KVEventBatch) -> IngestResult:
        """`on_message` for a payload already decoded (an in-process engine's events)."""
        result = IngestResult()
        state = self._state(engine, result)
        if state.replaying:
            state.held[seq] = batch
            return result
        last = state.last_seq
        if last is not None and seq <= last:
            self.stats.restarts += 1
            self._reset(state, engine, "engine restarted (sequence went backwards)", result)
            state.restarted_at = self._clock()
            last = None
        if last is None and seq > 0 and engine in self.replay_available:
            # We joined late: fetch what the engine still buffers so its cache is known.
            return self._start_replay(state, engine, 0, seq, batch, result)
        if last is not None and seq > last + 1:
            self.stats.gaps += 1
            if engine in self.replay_available:
                return self._start_replay(state, engine, last + 1, seq, batch, result)
            self._reset(state, engine, f"sequence gap {last}->{seq} and no replay endpoint",
                        result)
        self._apply(state, engine, seq, batch, result.ops)
        return result

    # -- replay ---------------------------------------------------------------------------------

    def _start_replay(
        self, state: _EngineState, engine: str, from_seq: int, seq: int,
        batch: KVEventBatch, result: IngestResult,
    ) -> IngestResult:
        state.held[seq] = batch
        result.replay = self._begin_replay(state, engine, from_seq)
        return result

    def _begin_replay(self, state: _EngineState, engine: str, from_seq: int) -> RequestReplay:
        self._replay_generation += 1
        state.replaying = True
        state.replay_target = from_seq
        state.replay_generation = self._replay_generation
        state.round_applied, state.round_cut, state.rounds = 0, False, 0
        self.stats.replays_requested += 1
        return RequestReplay(engine, from_seq, self._replay_generation)

    def _replaying(self, engine: str, generation: int | None) -> _EngineState | None:
        state = self._engines.get(engine)
        if state is None or not state.replaying:
            return None
        if generation is not None and generation != state.replay_generation:
            return None
        return state

    def on_replayed(
        self, engine: str, seq: int, payload: bytes, generation: int | None = None
    ) -> list[IndexOp]:
        """One batch answered by the replay endpoint (in order, before `replay_done`).

        `generation` is the RequestReplay's; None skips the check (single-threaded callers).
        """
        ops: list[IndexOp] = []
        state = self._replaying(engine, generation)
        if state is None:
            return ops
        batch = self._decode(payload)
        if batch is None:
            return ops
        expected = state.replay_target if state.last_seq is None else state.last_seq + 1
        if seq < expected or state.round_cut:
            return ops
        if seq > expected and state.last_seq is not None:
            if state.round_applied > 0:
                # The round jumped after it had begun: vLLM sends the whole buffer at once on
                # a ROUTER socket whose send queue (1,000 messages) drops the rest. What is
                # missing is still in its buffer: the round ends here (`replay_cut`) and the
                # driver asks again from `expected` (`resume_replay`).
                state.round_cut = True
                return ops
            # The round's first batch is past what we need: the buffer no longer reaches back
            # far enough, so what we held is unreliable.
            self._reset(state, engine, f"replay started at {seq}, needed {expected}",
                        IngestResult(ops))
        state.round_applied += 1
        self._apply(state, engine, seq, batch, ops)
        return ops

    def replay_cut(self, engine: str, generation: int | None = None) -> bool:
        """This round of the replay broke off (a jump in it): read no more of it."""
        state = self._replaying(engine, generation)
        return state is not None and state.round_cut

    def resume_replay(self, engine: str, generation: int | None = None) -> RequestReplay | None:
        """A round of the replay ended (it broke off, its end came, or it went quiet): the
        request to ask again from where it stopped, when something is still missing (the
        round broke off, or the live batches held start past the last one applied) and the
        round got somewhere; None to finish with `replay_done`."""
        state = self._replaying(engine, generation)
        if state is None or state.last_seq is None:
            return None
        missing = state.round_cut or (bool(state.held) and min(state.held) > state.last_seq + 1)
        progressed = state.round_applied > 0
        if not (missing and progressed and state.rounds < MAX_REPLAY_ROUNDS):
            return None
        state.round_applied, state.round_cut = 0, False
        state.rounds += 1
        self.stats.replay_rounds += 1
        return RequestReplay(engine, state.last_seq + 1, state.replay_generation)

    def replay_done(self, engine: str, generation: int | None = None) -> list[IndexOp]:
        """The replay ended (end marker, timeout or error): apply the batches held meanwhile."""
        ops: list[IndexOp] = []
        state = self._replaying(engine, generation)
        if state is None:
            return ops
        state.replaying = False
        held, state.held = state.held, {}
        for seq in sorted(held):
            last = state.last_seq
            if last is not None and seq <= last:
                continue
            if last is not None and seq > last + 1:
                self._reset(state, engine, f"events {last}..{seq} lost", IngestResult(ops))
            self._apply(state, engine, seq, held[seq], ops)
        return ops

    # -- applying -------------------------------------------------------------------------------

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        unknown: list[str] = []
        try:
            batch = decode_batch(payload, unknown)
        except KVEventDecodeError as e:
            self.stats.decode_errors += 1
            log.warning("KV event batch dropped: %s", e)
            return None
        if unknown:
            self.stats.unknown_events += len(unknown)
            for tag in unknown:
                if tag not in self._unknown_tags and len(self._unknown_tags) < 100:
                    self._unknown_tags.add(tag)
                    log.warning("KV events of unknown type %s skipped", tag)
        return batch

    def _reset(self, state: _EngineState, engine: str, reason: str, result: IngestResult) -> None:
        self.stats.resyncs += 1
        state.clear()
        state.last_seq = None
        result.ops.append(ClearEngine(engine, reason))

    def _apply(
        self, state: _EngineState, engine: str, seq: int, batch: KVEventBatch, ops: list[IndexOp]
    ) -> None:
        self.stats.batches += 1
        state.last_seq = seq
        # vLLM sends one BlockRemoved per evicted block: consecutive ones become one operation.
        removed: list[BlockKey] = []
        removed_tier = DEFAULT_TIER
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                tier = (event.medium or DEFAULT_TIER).upper()
                if removed and tier != removed_tier:
                    ops.append(RemoveKeys(engine, tuple(removed), removed_tier))
                    removed = []
                removed_tier = tier
                self._removed(state, event, removed)
                continue
            if removed:
                ops.append(RemoveKeys(engine, tuple(removed), removed_tier))
                removed = []
            if isinstance(event, BlockStored):
                self._stored(state, engine, event, ops)
            elif isinstance(event, AllBlocksCleared):
                state.clear()
                ops.append(ClearEngine(engine, "engine reset its prefix cache"))
        if removed:
            ops.append(RemoveKeys(engine, tuple(removed), removed_tier))

    def _stored(
        self, state: _EngineState, engine: str, ev: BlockStored, ops: list[IndexOp]
    ) -> None:
        n = len(ev.block_hashes)
        bs = ev.block_size
        if n == 0 or bs <= 0 or len(ev.token_ids) != n * bs:
            self.stats.decode_errors += 1
            return
        tier = (ev.medium or DEFAULT_TIER).upper()
        state.block_size = bs
        parent = ev.parent_block_hash
        if parent is None:
            first_extra = ev.extra_keys[0] if ev.extra_keys else None
            salt = KeyExtras.from_event(ev.lora_name, first_extra).cache_salt
            tail: BlockKey | None = None
            pending: tuple[int, ...] = ()
            blocks = 0
        else:
            prev = state.table(tier).get(parent)
            if prev is None and tier != DEFAULT_TIER:
                prev = state.blocks.get(parent)  # an offloaded block's parent still on GPU
            if prev is None:
                self.stats.orphans += n
                return
            if isinstance(prev, int):
                tail, pending, blocks, salt = prev, (), 1, None
            else:
                tail, pending, blocks, salt = prev.tail, prev.pending, prev.blocks, prev.salt
        B = self.block_size
        added: list[BlockKey] = []
        if not pending and bs % B == 0:
            # Common case: index blocks tile engine blocks, so the whole event chains at once.
            extras = KeyExtras(lora_name=ev.lora_name, cache_salt=salt)
            per = bs // B
            own = _keyed_as_index(ev, B, extras, tail, blocks) if per == 1 else None
            added = own if own is not None else chain_keys(
                ev.token_ids, B, extras, parent=tail, first_block_index=blocks)
            compact = per == 1 and ev.lora_name is None and tier == DEFAULT_TIER
            if compact and self._remember_new(state, ev.block_hashes, added):
                ops.append(AddKeys(engine, tuple(added), tier))
                return
            for j, h in enumerate(ev.block_hashes):
                keys = added[j * per:(j + 1) * per]
                blocks += per
                if compact:
                    self._remember(state, h, keys[0])
                else:
                    self._remember(state, h, _Chain(tuple(keys), keys[-1], (), blocks, None, 1,
                                                    tier), tier)
            if added:
                ops.append(AddKeys(engine, tuple(added), tier))
            return
        for j, h in enumerate(ev.block_hashes):
            tokens = pending + tuple(ev.token_ids[j * bs:(j + 1) * bs])
            full = len(tokens) // B
            extras = KeyExtras(lora_name=ev.lora_name, cache_salt=salt)
            keys = chain_keys(tokens[:full * B], B, extras, parent=tail, first_block_index=blocks)
            if keys:
                tail = keys[-1]
            pending = tokens[full * B:]
            blocks += full
            added.extend(keys)
            self._remember(state, h, _Chain(tuple(keys), tail, pending, blocks,
                                            salt if blocks == 0 else None, 1, tier), tier)
            if blocks > 0:
                salt = None
        if added:
            ops.append(AddKeys(engine, tuple(added), tier))

    def _remember(self, state: _EngineState, h: EngineHash, new: _BlockState,
                  tier: str = DEFAULT_TIER) -> None:
        """Record a stored engine block in `tier`; a hash already known there is one more
        physical copy."""
        self.stats.blocks_stored += 1
        table = state.table(tier)
        existing = table.get(h)
        if existing is None:
            table[h] = new
        else:
            chain = _as_chain(existing)
            chain.copies += 1
            table[h] = chain

    def _remember_new(
        self, state: _EngineState, hashes: Sequence[EngineHash], keys: Sequence[BlockKey]
    ) -> bool:
        """`_remember` each hash with its compact key in one pass, if none is known yet (the
        usual BlockStored); False, with nothing recorded, if any is (a copy: one at a time)."""
        fresh = dict(zip(hashes, keys, strict=True))
        if len(fresh) != len(hashes) or not state.blocks.keys().isdisjoint(fresh):
            return False
        state.blocks.update(fresh)
        self.stats.blocks_stored += len(fresh)
        return True

    def _removed(self, state: _EngineState, ev: BlockRemoved, removed: list[BlockKey]) -> None:
        """Collect the index keys of the removed blocks (of the event's medium) into
        `removed`."""
        blocks = state.table((ev.medium or DEFAULT_TIER).upper())
        hashes = ev.block_hashes
        found = list(map(blocks.get, hashes))
        if set(map(type, found)) == _COMPACT_ONLY and len(set(hashes)) == len(hashes):
            # The usual eviction: every block known, one copy each, keyed compactly (an int):
            # the loop below at C speed.
            removed.extend(cast("list[BlockKey]", found))
            deque(map(blocks.__delitem__, hashes), maxlen=0)
            self.stats.blocks_removed += len(hashes)
            return
        unknown = 0
        keep = removed.append
        for h in ev.block_hashes:
            existing = blocks.get(h)
            if existing is None:
                unknown += 1
                continue
            if isinstance(existing, int):
                keep(existing)
                del blocks[h]
                continue
            removed.extend(existing.keys)
            existing.copies -= 1
            if existing.copies <= 0:
                del blocks[h]
        self.stats.unknown_removals += unknown
        self.stats.blocks_removed += len(ev.block_hashes) - unknown


_COMPACT_ONLY = {int}
"""The value types of a removal whose blocks are all known with one compact key each."""


def _keyed_as_index(
    ev: BlockStored, block_size: int, extras: KeyExtras, parent: BlockKey | None, blocks: int
) -> list[BlockKey] | None:
    """The event's own hashes, if its engine hashes blocks as the index keys them; else None.

    The virtual driver's engines are seeded with the index's keys and hash the rest with the
    index's function, so their hashes are the keys; a real vLLM engine's (sha256 or xxhash of
    its own encoding) never agree. Agreement on the event's first block (the chain's parent and
    block-0 extras) and on its last (a later block's extras) shows which kind sent it, at the
    cost of two blocks' hashing instead of the whole event's. Keeping the engine's int objects,
    which are the keyer's, also lets the index's dict lookups of a prompt's keys find their own
    objects (no value comparison).
    """
    hashes = ev.block_hashes
    tokens = ev.token_ids
    n = len(hashes)
    if block_key(parent, tokens[:block_size], extras.for_block(blocks)) != hashes[0]:
        return None
    if n > 1:
        before = hashes[n - 2]
        if not isinstance(before, int) or block_key(
                before, tokens[(n - 1) * block_size:],
                extras.for_block(blocks + n - 1)) != hashes[n - 1]:
            return None
    return cast("list[BlockKey]", list(hashes))


def _as_chain(state: _BlockState) -> _Chain:
    if isinstance(state, _Chain):
        return state
    return _Chain((state,), state, (), 1, None, 1, DEFAULT_TIER)


def apply_ops_sync(index: InMemoryIndex, ops: Sequence[IndexOp]) -> None:
    """Apply operations to an in-memory index synchronously (benchmarks, virtual time)."""
    for op in ops:
        if isinstance(op, AddKeys):
            index.add_sync(op.engine, op.keys, op.tier)
        elif isinstance(op, RemoveKeys):
            index.remove_sync(op.engine, op.keys, op.tier)
        else:
            index.clear_engine_sync(op.engine)
