"""KV events become index entries keyed by the gateway's own chained keys (sans-IO)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.sim.model import EngineConfig, EngineModel, SimRequest, hash_block
from adapters.sim.publisher import encode_events, to_wire, wire_batch
from kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from kvindex.index import InMemoryIndex
from kvindex.ingest import AddKeys, ClearEngine, EventIngestor, RequestReplay, apply_ops_sync
from kvindex.keys import NO_EXTRAS, KeyExtras, block_key, chain_keys
from planner.profiles import get_profile

E = "engine-a"


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int,
           extra_keys: list[Any] | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=extra_keys)


def payload(*events: Any) -> bytes:
    return encode_batch(KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0))


class Harness:
    """An ingestor feeding an in-memory index, the way the gateway wires them."""

    def __init__(self, block_size: int = 16, replay: bool = False) -> None:
        self.ingestor = EventIngestor(block_size, {E} if replay else set())
        self.index = InMemoryIndex()
        self.block_size = block_size

    def feed(self, seq: int, data: bytes) -> RequestReplay | None:
        result = self.ingestor.on_message(E, seq, data)
        apply_ops_sync(self.index, result.ops)
        return result.replay

    def keys(self) -> set[int]:
        return set(self.index.engine_keys_sync(E))

    def held_blocks(self, tokens: list[int], extras: KeyExtras = NO_EXTRAS) -> int:
        keys = chain_keys(tokens, self.block_size, extras)
        match = self.index.match_sync(keys, 0.0).get(E)
        return match.confirmed_blocks if match else 0


TOKENS = list(range(100, 100 + 128))


def test_stored_blocks_get_the_keys_the_gateway_computes_for_the_prompt() -> None:
    h = Harness()
    h.feed(0, payload(stored([11, 12], None, TOKENS[:32], 16)))
    h.feed(1, payload(stored([13], 12, TOKENS[32:48], 16)))
    assert h.keys() == set(chain_keys(TOKENS[:48], 16))
    assert h.held_blocks(TOKENS) == 3


def test_engine_blocks_larger_than_index_blocks_split_into_several_keys() -> None:
    h = Harness(block_size=16)
    h.feed(0, payload(stored([1], None, TOKENS[:32], 32)))
    h.feed(1, payload(stored([2], 1, TOKENS[32:64], 32)))
    assert h.keys() == set(chain_keys(TOKENS[:64], 16))


def test_engine_blocks_smaller_than_index_blocks_carry_their_tail() -> None:
    h = Harness(block_size=32)
    h.feed(0, payload(stored([1], None, TOKENS[:16], 16)))
    assert h.keys() == set()
    h.feed(1, payload(stored([2, 3], 1, TOKENS[16:48], 16)))
    assert h.keys() == set(chain_keys(TOKENS[:48], 32))


def test_removal_drops_the_blocks_keys_and_copies_are_counted() -> None:
    h = Harness()
    h.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16)))
    h.feed(1, payload(stored([2], 1, TOKENS[16:32], 16)))  # a second physical copy of block 2
    h.feed(2, payload(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert h.held_blocks(TOKENS) == 2
    h.feed(3, payload(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert h.held_blocks(TOKENS) == 1


def test_all_blocks_cleared_empties_the_engine() -> None:
    h = Harness()
    h.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16)))
    h.feed(1, payload(AllBlocksCleared()))
    assert h.keys() == set()


def test_cache_salt_from_extra_keys_isolates_keys() -> None:
    h = Harness()
    h.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16, extra_keys=[("tenant-a",), None])))
    assert h.held_blocks(TOKENS[:32], KeyExtras(cache_salt="tenant-a")) == 2
    assert h.held_blocks(TOKENS[:32]) == 0
    assert h.held_blocks(TOKENS[:32], KeyExtras(cache_salt="tenant-b")) == 0


def test_unknown_parent_is_an_orphan_and_is_skipped() -> None:
    h = Harness()
    h.feed(0, payload(stored([5], 999, TOKENS[:16], 16)))
    assert h.keys() == set()
    assert h.ingestor.stats.orphans == 1


def test_gap_with_replay_endpoint_requests_replay_and_holds_live_batches() -> None:
    h = Harness(replay=True)
    b0 = payload(stored([1], None, TOKENS[:16], 16))
    b1 = payload(stored([2], 1, TOKENS[16:32], 16))
    b2 = payload(stored([3], 2, TOKENS[32:48], 16))
    b3 = payload(stored([4], 3, TOKENS[48:64], 16))
    assert h.feed(0, b0) is None
    assert h.feed(2, b2) == RequestReplay(E, 1)
    assert h.feed(3, b3) is None  # held while the replay runs
    assert h.held_blocks(TOKENS) == 1
    for seq, data in ((1, b1), (2, b2)):
        apply_ops_sync(h.index, h.ingestor.on_replayed(E, seq, data))
    apply_ops_sync(h.index, h.ingestor.replay_done(E))
    assert h.held_blocks(TOKENS) == 4
    assert h.ingestor.last_seq(E) == 3


def test_gap_without_replay_resyncs_instead_of_trusting_stale_entries() -> None:
    h = Harness(replay=False)
    h.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16)))
    h.feed(5, payload(stored([7], None, TOKENS[64:80], 16)))
    assert h.keys() == set(chain_keys(TOKENS[64:80], 16))
    assert h.ingestor.stats.gaps == 1 and h.ingestor.stats.resyncs == 1


def test_sequence_going_backwards_means_restart_and_drops_the_engines_entries() -> None:
    h = Harness()
    h.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16)))
    h.feed(1, payload(stored([3], 2, TOKENS[32:48], 16)))
    h.feed(0, payload(stored([9], None, TOKENS[64:80], 16)))
    assert h.keys() == set(chain_keys(TOKENS[64:80], 16))
    assert h.ingestor.stats.restarts == 1


def test_joining_late_asks_for_replay_from_the_start() -> None:
    h = Harness(replay=True)
    assert h.feed(7, payload(stored([1], None, TOKENS[:16], 16))) == RequestReplay(E, 0)


def test_replay_that_no_longer_reaches_back_resyncs() -> None:
    h = Harness(replay=True)
    h.feed(0, payload(stored([1], None, TOKENS[:16], 16)))
    h.feed(5, payload(stored([8], None, TOKENS[64:80], 16)))
    ops = h.ingestor.on_replayed(E, 4, payload(stored([7], None, TOKENS[80:96], 16)))
    assert any(isinstance(op, ClearEngine) for op in ops)
    apply_ops_sync(h.index, ops)
    apply_ops_sync(h.index, h.ingestor.replay_done(E))
    assert h.keys() == set(chain_keys(TOKENS[80:96], 16)) | set(chain_keys(TOKENS[64:80], 16))


def test_a_replay_that_breaks_off_is_asked_again_from_where_it_stopped() -> None:
    h = Harness(replay=True)
    batches = [payload(stored([i + 1], i or None, TOKENS[16 * i:16 * (i + 1)], 16))
               for i in range(6)]
    h.feed(0, batches[0])
    request = h.feed(5, batches[5])
    assert request == RequestReplay(E, 1)
    # The round brings 1 and 2, then jumps to 4 (the sender dropped 3): not a reset, a cut.
    for seq in (1, 2, 4):
        apply_ops_sync(h.index, h.ingestor.on_replayed(E, seq, batches[seq], request.generation))
    assert h.ingestor.replay_cut(E, request.generation) and h.ingestor.stats.resyncs == 0
    again = h.ingestor.resume_replay(E, request.generation)
    assert again == RequestReplay(E, 3, request.generation)
    assert not h.ingestor.replay_cut(E, request.generation)
    for seq in (3, 4):
        apply_ops_sync(h.index, h.ingestor.on_replayed(E, seq, batches[seq], request.generation))
    assert h.ingestor.resume_replay(E, request.generation) is None  # caught up with 5, held
    apply_ops_sync(h.index, h.ingestor.replay_done(E, request.generation))
    assert h.held_blocks(TOKENS[:96]) == 6 and h.ingestor.last_seq(E) == 5
    assert h.ingestor.stats.replay_rounds == 1 and h.ingestor.stats.resyncs == 0


def test_a_replay_round_that_brings_nothing_is_not_asked_again() -> None:
    h = Harness(replay=True)
    h.feed(0, payload(stored([1], None, TOKENS[:16], 16)))
    request = h.feed(5, payload(stored([6], 5, TOKENS[80:96], 16)))
    assert request is not None
    # The round's end marker came with nothing (or it went quiet): held 5 is past 1, but
    # asking again would bring nothing either; the replay ends and 1..4 are lost.
    assert h.ingestor.resume_replay(E, request.generation) is None
    ops = h.ingestor.replay_done(E, request.generation)
    assert any(isinstance(op, ClearEngine) for op in ops)


def test_an_offloaded_copys_removal_leaves_the_gpu_block_indexed() -> None:
    # A KV offloading connector stores a CPU copy under the GPU block's hash. With one table
    # for both, a CPU copy announced by a placeholder the ingestor skips (vLLM 0.32's
    # OffloadingConnector sends block_size 0 and no tokens) had its removal consume the GPU
    # record, and the GPU block's own removal then found nothing: its entry stayed for good.
    h = Harness()
    placeholder = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[],
                              block_size=0, lora_id=None, medium="CPU", lora_name=None)
    h.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16)))
    h.feed(1, payload(placeholder))
    h.feed(2, payload(BlockRemoved(block_hashes=[1, 2], medium="CPU")))
    assert h.index.engine_keys_sync(E) == {k: {"GPU": 1} for k in chain_keys(TOKENS[:32], 16)}
    h.feed(3, payload(BlockRemoved(block_hashes=[1, 2], medium="GPU")))
    assert h.keys() == set()
    # With the copy announced in full, both are kept and go one by one.
    h = Harness()
    gpu = stored([1, 2], None, TOKENS[:32], 16)
    cpu = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS[:32],
                      block_size=16, lora_id=None, medium="CPU", lora_name=None)
    h.feed(0, payload(gpu))
    h.feed(1, payload(cpu))
    assert h.index.engine_keys_sync(E) == {k: {"GPU": 1, "CPU": 1}
                                           for k in chain_keys(TOKENS[:32], 16)}
    h.feed(2, payload(BlockRemoved(block_hashes=[1, 2], medium="CPU")))
    assert h.index.engine_keys_sync(E) == {k: {"GPU": 1} for k in chain_keys(TOKENS[:32], 16)}
    h.feed(3, payload(BlockRemoved(block_hashes=[1, 2], medium="GPU")))
    assert h.keys() == set() and h.ingestor.stats.unknown_removals == 0
    # A block offloaded whose parent is only on GPU chains from it.
    h.feed(4, payload(gpu))
    h.feed(5, payload(BlockStored(block_hashes=[3], parent_block_hash=2,
                                  token_ids=TOKENS[32:48], block_size=16, lora_id=None,
                                  medium="CPU", lora_name=None)))
    assert h.index.engine_keys_sync(E)[chain_keys(TOKENS[:48], 16)[-1]] == {"CPU": 1}
    assert h.ingestor.stats.orphans == 0


def test_older_positional_layout_ingests_identically() -> None:
    positional = msgspec.msgpack.encode(
        [0.0, [["BlockStored", [1, 2], None, TOKENS[:32], 16, None, "GPU", None]], 0])
    a, b = Harness(), Harness()
    a.feed(0, positional)
    b.feed(0, payload(stored([1, 2], None, TOKENS[:32], 16)))
    assert a.keys() == b.keys() != set()


def test_undecodable_payload_is_counted_not_fatal() -> None:
    h = Harness()
    h.feed(0, b"\xc1garbage")
    assert h.ingestor.stats.decode_errors == 1
    h.feed(1, payload(stored([1], None, TOKENS[:16], 16)))
    assert h.held_blocks(TOKENS) == 1


def test_a_batch_with_a_bad_field_is_dropped_whole_and_leaves_nothing_stale() -> None:
    # The removal of block 1 rides with a store whose token ids the index cannot key: the
    # batch is dropped, and the gap it leaves resyncs the engine (no replay endpoint here).
    h = Harness()
    h.feed(0, payload(stored([1], None, TOKENS[:16], 16)))
    bad = msgspec.msgpack.encode([0.0, [
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
         "token_ids": [-1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None}], 0])
    h.feed(1, bad)
    assert h.ingestor.stats.decode_errors == 1
    h.feed(2, payload(stored([3], None, TOKENS[16:32], 16)))
    assert h.held_blocks(TOKENS) == 0  # block 1 is gone
    assert h.held_blocks(TOKENS[16:32]) == 1


def test_events_of_an_unknown_type_are_skipped_and_the_rest_of_their_batch_counts() -> None:
    for layout in ("map", "positional"):
        h = Harness()
        if layout == "map":
            events: list[Any] = [
                {"type": "BlockPinned", "block_hashes": [1]},
                {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": TOKENS[:16], "block_size": 16, "lora_id": None, "medium": "GPU",
                 "lora_name": None}]
        else:
            events = [["BlockPinned", [1]], ["BlockStored", [1], None, TOKENS[:16], 16]]
        h.feed(0, msgspec.msgpack.encode([0.0, events, 0]))
        assert h.ingestor.stats.unknown_events == 1, layout
        assert h.ingestor.stats.decode_errors == 0, layout
        assert h.held_blocks(TOKENS) == 1, layout


def test_malformed_batches_in_every_shape_are_decode_errors() -> None:
    stored_map = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                  "token_ids": TOKENS[:16], "block_size": 16, "lora_id": None,
                  "medium": "GPU", "lora_name": None}
    for bad in ([0.0, [5], 0], ["noon", [["AllBlocksCleared"]], 0],
                [0.0, [{"type": "BlockRemoved"}], 0], [0.0, [stored_map], "rank"],
                [0.0, [{**stored_map, "token_ids": [2**32] * 16}], 0]):
        h = Harness()
        h.feed(0, msgspec.msgpack.encode(bad))
        assert h.ingestor.stats.decode_errors == 1, bad
    h = Harness()
    h.feed(0, msgspec.msgpack.encode([0.0, [stored_map], 0])[:-4])  # truncated
    assert h.ingestor.stats.decode_errors == 1


def test_forgetting_an_engine_clears_it() -> None:
    h = Harness()
    h.feed(0, payload(stored([1], None, TOKENS[:16], 16)))
    apply_ops_sync(h.index, h.ingestor.forget(E))
    assert h.keys() == set() and h.ingestor.last_seq(E) is None


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(8, 120), st.integers(1, 6)),
                     min_size=1, max_size=14),
    num_blocks=st.integers(min_value=6, max_value=40),
    engine_block=st.sampled_from([16, 32]),
    # Index blocks that divide engine blocks are exact; larger ones are approximate by design.
    index_block=st.sampled_from([8, 16]),
)
def test_index_view_equals_the_engines_own_cache(
    prompts: list[tuple[int, int, int]], num_blocks: int, engine_block: int, index_block: int,
) -> None:
    """Drive the real engine model; its events, ingested, must say exactly what it caches."""
    cfg = EngineConfig(block_size=engine_block, num_blocks=num_blocks,
                       max_num_batched_tokens=96, max_num_seqs=8, max_model_len=4096,
                       eos_token_id=3)
    model = EngineModel(cfg, get_profile("h100-llama3-8b"), lambda r: 500 + len(r.output_token_ids))
    h = Harness(block_size=index_block)
    seq = itertools.count()
    sent: list[list[int]] = []
    now = 0.0
    capacity = num_blocks * engine_block
    for i, (family, length, out) in enumerate(prompts):
        length = min(length, capacity - out)
        tokens = [family * 1000 + t for t in range(length)]
        sent.append(tokens)
        model.add_request(SimRequest(f"r{i}", tokens, max_tokens=out, arrival_time=now,
                                     ignore_eos=True))
        while model.has_work():
            step = model.step(now)
            now += step.duration
            if step.kv_events:
                h.feed(next(seq), payload(*(to_wire(e) for e in step.kv_events)))
    # Full token sequences the engine saw (prompt + the sampler's outputs), and how many of
    # their leading tokens it still holds in cached blocks.
    coverage = []
    for tokens, (_, _, out) in zip(sent, prompts, strict=True):
        seq_tokens = tokens + [500 + k for k in range(out)]
        parent = None
        held = 0
        for j in range(len(seq_tokens) // engine_block):
            block = seq_tokens[j * engine_block:(j + 1) * engine_block]
            parent = hash_block(parent, block, None)
            if model.pool.lookup(parent) is None:
                break
            held += engine_block
        coverage.append((seq_tokens, held))
    for tokens in sent:
        covered = 0
        for seq_tokens, held in coverage:
            common = 0
            while (common < min(len(tokens), len(seq_tokens))
                   and tokens[common] == seq_tokens[common]):
                common += 1
            covered = max(covered, min(held, common))
        assert h.held_blocks(tokens) == covered // index_block


def test_probing_a_silent_engine_replays_what_was_published_before_we_subscribed() -> None:
    h = Harness(replay=True)
    probe = h.ingestor.probe(E)
    assert probe.replay == RequestReplay(E, 0)
    assert h.ingestor.probe(E).replay is None  # one replay at a time
    apply_ops_sync(h.index, probe.ops)
    apply_ops_sync(h.index, h.ingestor.on_replayed(E, 0, payload(stored([1], None,
                                                                        TOKENS[:16], 16))))
    apply_ops_sync(h.index, h.ingestor.replay_done(E))
    assert h.held_blocks(TOKENS) == 1
    assert h.ingestor.probe(E).replay is None  # heard from now: no more probes


def test_engines_without_replay_are_never_probed() -> None:
    assert Harness(replay=False).ingestor.probe(E).replay is None


def test_answers_to_a_replay_from_before_a_reset_are_ignored() -> None:
    h = Harness(replay=True)
    old = h.feed(3, payload(stored([1], None, TOKENS[:16], 16)))
    assert old is not None
    apply_ops_sync(h.index, h.ingestor.forget(E, "restarted"))
    new = h.feed(2, payload(stored([5], None, TOKENS[32:48], 16)))
    assert new is not None and new.generation != old.generation
    stale = payload(stored([9], None, TOKENS[64:80], 16))
    assert h.ingestor.on_replayed(E, 0, stale, old.generation) == []
    assert h.ingestor.replay_done(E, old.generation) == []
    apply_ops_sync(h.index, h.ingestor.replay_done(E, new.generation))
    assert h.keys() == set(chain_keys(TOKENS[32:48], 16))


@settings(max_examples=30, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(8, 120), st.integers(1, 6)),
                     min_size=1, max_size=10),
    num_blocks=st.integers(min_value=6, max_value=40),
)
def test_a_batch_handed_over_decoded_gives_the_ops_of_its_payload(
    prompts: list[tuple[int, int, int]], num_blocks: int,
) -> None:
    """The virtual driver skips the wire: `on_batch` must do exactly what `on_message` does."""
    cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_batched_tokens=96,
                       max_num_seqs=8, max_model_len=4096, eos_token_id=3,
                       removal_per_event=False)
    model = EngineModel(cfg, get_profile("h100-llama3-8b"), lambda r: 500 + len(r.output_token_ids))
    wire, decoded = EventIngestor(16), EventIngestor(16)
    seq = itertools.count()
    now = 0.0
    for i, (family, length, out) in enumerate(prompts):
        tokens = [family * 1000 + t for t in range(min(length, num_blocks * 16 - out))]
        model.add_request(SimRequest(f"r{i}", tokens, max_tokens=out, arrival_time=now,
                                     ignore_eos=True))
        while model.has_work():
            step = model.step(now)
            now += step.duration
            if step.kv_events:
                n = next(seq)
                sent = wire.on_message(E, n, encode_events(step.kv_events, now))
                handed = decoded.on_batch(E, n, wire_batch(step.kv_events, now))
                assert handed == sent
    assert decoded.stats == wire.stats


def _batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)


def _added(ingestor: EventIngestor, seq: int, event: BlockStored) -> tuple[int, ...]:
    (op,) = ingestor.on_batch(E, seq, _batch(event)).ops[-1:]
    assert isinstance(op, AddKeys)
    return op.keys


def test_an_engine_that_hashes_as_the_index_keys_gives_its_own_hash_objects() -> None:
    """The virtual driver's engines hash blocks with the index's function: the ingestor takes
    the event's int objects as the keys (the keyer's, so the index's probes match by identity)
    after checking the event's first and last blocks, on a salted chain and its continuation."""
    salt = KeyExtras(cache_salt="tenant-a")
    keys = [int(str(k)) for k in chain_keys(TOKENS, 16, salt)]  # fresh objects, equal values
    ingestor = EventIngestor(16)
    first = _added(ingestor, 0, stored(keys[:3], None, TOKENS[:48], 16,
                                       extra_keys=[("tenant-a",), None, None]))
    assert first == tuple(keys[:3]) and all(a is b for a, b in zip(first, keys, strict=False))
    later = _added(ingestor, 1, stored(keys[3:], keys[2], TOKENS[48:], 16))
    assert later == tuple(keys[3:]) and all(a is b for a, b in zip(later, keys[3:], strict=True))


def test_hashes_that_agree_with_the_index_only_on_the_first_block_are_rekeyed() -> None:
    """An engine that agrees on block 0 but hashes a later block otherwise (here: the salt on
    every block) is not taken at its word: its blocks get the index's own keys."""
    salt = KeyExtras(cache_salt="tenant-a")
    keys = chain_keys(TOKENS[:48], 16, salt)
    # The salt on every block: the chain the engine would announce differs after block 0.
    salted_everywhere = [keys[0]]
    for i in (1, 2):
        salted_everywhere.append(block_key(salted_everywhere[-1], TOKENS[16 * i:16 * (i + 1)],
                                           ("cache_salt", "tenant-a")))
    assert salted_everywhere[1:] != keys[1:]
    added = _added(EventIngestor(16), 0, stored(salted_everywhere, None, TOKENS[:48], 16,
                                                extra_keys=[("tenant-a",), None, None]))
    assert added == tuple(keys)
