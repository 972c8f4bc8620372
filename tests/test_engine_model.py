"""The sans-IO engine model behaves like a miniature vLLM v1 engine core."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.sim import model
from adapters.sim.model import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineModel,
    FinishReason,
    SimRequest,
)
from planner.profiles import PROFILES, ScheduledChunk, get_profile

PROFILE = get_profile("h100-llama3-8b")
PER_SEQUENCE = dataclasses.replace(get_profile("cpu-tiny"), name="cpu-tiny-per-seq",
                                   step_overhead_s=1e-3, seq_overhead_s=3e-5)
"""A fitted CPU profile's shape: each sequence in a step adds to its cost."""
ALL_PROFILES = [*PROFILES.values(), PER_SEQUENCE]
EOS = 3


def make_engine(num_blocks: int = 1024, block_size: int = 16, budget: int = 8192) -> EngineModel:
    cfg = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=64,
        max_model_len=32768,
        eos_token_id=EOS,
    )
    return EngineModel(cfg, PROFILE, sampler=lambda req: 100 + len(req.output_token_ids))


def request(rid: str, prompt: list[int], max_tokens: int = 4, now: float = 0.0) -> SimRequest:
    return SimRequest(rid, list(prompt), max_tokens=max_tokens, arrival_time=now, ignore_eos=True)


def run_to_completion(engine: EngineModel, now: float = 0.0) -> float:
    while engine.has_work():
        out = engine.step(now)
        now += out.duration
    return now


def test_prefix_hit_skips_prefill_of_cached_blocks() -> None:
    engine = make_engine()
    prompt = list(range(1000, 1000 + 320))
    engine.add_request(request("a", prompt))
    run_to_completion(engine)
    engine.add_request(request("b", [*prompt, 7, 8, 9]))
    out = engine.step(10.0)
    # 320 tokens = 20 full blocks cached; b computes only its 3 new tokens.
    assert out.num_scheduled_tokens == 3
    assert engine.stats.prefix_cache_hits == 320
    assert engine.stats.prefix_cache_queries == 320 + 323


def test_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    engine = make_engine()
    prompt = list(range(5000, 5000 + 64))
    engine.add_request(request("a", prompt))
    run_to_completion(engine)
    engine.add_request(request("b", prompt))
    out = engine.step(1.0)
    assert out.num_scheduled_tokens == 16
    assert engine.stats.prefix_cache_hits == 48
    # As in vLLM, the recomputed copy of the last block is announced again.
    stored = [e for e in out.kv_events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [1]
    assert stored[0].token_ids == tuple(prompt[48:])


def test_requests_in_the_same_step_share_blocks_cached_at_schedule_time() -> None:
    engine = make_engine()
    prompt = list(range(7000, 7000 + 160))
    engine.add_request(request("a", prompt))
    engine.add_request(request("b", [*prompt, 1, 2]))
    out = engine.step(0.0)
    # b is scheduled after a in the same step and already reuses a's 10 blocks.
    assert out.num_scheduled_tokens == 160 + 2
    assert engine.stats.prefix_cache_hits == 160


def test_cache_salt_isolates_prefixes() -> None:
    engine = make_engine()
    prompt = list(range(2000, 2000 + 160))
    a = request("a", prompt)
    a.cache_salt = "tenant-a"
    engine.add_request(a)
    run_to_completion(engine)
    b = request("b", prompt)
    b.cache_salt = "tenant-b"
    engine.add_request(b)
    out = engine.step(1.0)
    assert out.num_scheduled_tokens == 160
    assert engine.stats.prefix_cache_hits == 0


def test_prefix_hit_makes_first_token_faster() -> None:
    prompt = list(range(3000, 3000 + 4096))
    cold = make_engine()
    cold.add_request(request("a", prompt, max_tokens=1))
    cold_ttft = cold.step(0.0).duration
    cold.add_request(request("b", [*prompt, 1], max_tokens=1))
    warm_ttft = cold.step(cold_ttft).duration
    assert warm_ttft < cold_ttft / 5


def test_chunked_prefill_respects_token_budget() -> None:
    engine = make_engine(budget=512)
    engine.add_request(request("a", list(range(2000))))
    steps = []
    now = 0.0
    while engine.has_work():
        out = engine.step(now)
        steps.append(out.num_scheduled_tokens)
        now += out.duration
    assert max(steps) <= 512
    assert steps[:4] == [512, 512, 512, 464]


def test_eviction_takes_least_recently_freed_blocks_first() -> None:
    engine = make_engine(num_blocks=8, block_size=16)
    first = list(range(100, 164))  # 4 blocks
    second = list(range(200, 264))  # 4 blocks
    engine.add_request(request("a", first, max_tokens=1))
    run_to_completion(engine)
    engine.add_request(request("b", second, max_tokens=1))
    run_to_completion(engine)
    # Both prompts are cached in 8 blocks; a third prompt needing 3 blocks evicts from `first`,
    # freed earlier, and within it the tail blocks first (freed in reverse order).
    engine.add_request(request("c", list(range(300, 340)), max_tokens=1))
    out = engine.step(5.0)
    removed = [h for e in out.kv_events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored_a = engine_first_hashes(first)
    assert removed[:3] == [stored_a[3], stored_a[2], stored_a[1]]


def test_without_removal_per_event_an_allocations_evictions_come_in_one_event() -> None:
    one_each, merged = BlockPool(4), BlockPool(4, removal_per_event=False)
    for pool in (one_each, merged):
        blocks = pool.allocate(4)
        pool.cache_all(blocks, [11, 12, 13, 14])
        pool.free(blocks)
        pool.drain_events()
        pool.allocate(3)
    assert one_each.drain_events() == [BlockRemoved((14,)), BlockRemoved((13,)),
                                       BlockRemoved((12,))]
    assert merged.drain_events() == [BlockRemoved((14, 13, 12))]


def engine_first_hashes(prompt: list[int]) -> list[int]:
    probe = make_engine()
    probe.add_request(request("x", prompt, max_tokens=1))
    out = probe.step(0.0)
    return [h for e in out.kv_events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_block_stored_carries_chained_parent_and_token_ids() -> None:
    engine = make_engine(budget=32)
    prompt = list(range(400, 400 + 70))
    engine.add_request(request("a", prompt, max_tokens=1))
    first = engine.step(0.0)
    second = engine.step(1.0)
    (e1,) = [e for e in first.kv_events if isinstance(e, BlockStored)]
    (e2,) = [e for e in second.kv_events if isinstance(e, BlockStored)]
    assert e1.parent_block_hash is None
    assert e1.token_ids == tuple(prompt[:32])
    assert e2.parent_block_hash == e1.block_hashes[-1]
    assert e2.token_ids == tuple(prompt[32:64])


def test_generation_stops_at_max_tokens_or_eos() -> None:
    engine = make_engine()
    engine.add_request(request("len", list(range(50)), max_tokens=5))
    eos_req = SimRequest("eos", list(range(60)), max_tokens=100, arrival_time=0.0)
    eos_req.natural_output_len = 3
    engine.add_request(eos_req)
    finished: dict[str, SimRequest] = {}
    now = 0.0
    while engine.has_work():
        out = engine.step(now)
        now += out.duration
        finished.update((r.request_id, r) for r in out.finished)
    assert finished["len"].finish_reason == FinishReason.LENGTH
    assert len(finished["len"].output_token_ids) == 5
    assert finished["eos"].finish_reason == FinishReason.STOP
    assert finished["eos"].output_token_ids[-1] == EOS
    assert len(finished["eos"].output_token_ids) == 3


def test_min_tokens_delays_eos() -> None:
    engine = make_engine()
    req = SimRequest("m", list(range(20)), max_tokens=100, arrival_time=0.0, min_tokens=9)
    req.natural_output_len = 2
    engine.add_request(req)
    run_to_completion(engine)
    assert len(req.output_token_ids) == 9


def test_preemption_under_memory_pressure_completes_everything() -> None:
    engine = make_engine(num_blocks=12, block_size=16)
    for i in range(4):
        engine.add_request(request(f"r{i}", list(range(i * 1000, i * 1000 + 40)), max_tokens=40))
    run_to_completion(engine)
    assert not engine.requests
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("reserve", [True, False])
def test_a_request_is_admitted_only_when_its_whole_prompt_fits(reserve: bool) -> None:
    """vLLM 0.32's `--scheduler-reserve-full-isl` (its default): the second 200-token prompt
    waits while the first holds 13 of the pool's 20 blocks, though its first 64-token chunk
    would fit; with `--no-scheduler-reserve-full-isl` that chunk is admitted, and one of the
    two is preempted once the pool runs out."""
    cfg = EngineConfig(block_size=16, num_blocks=20, max_num_batched_tokens=64,
                       max_num_seqs=8, max_model_len=320, eos_token_id=EOS,
                       reserve_full_isl=reserve)
    engine = EngineModel(cfg, PROFILE, sampler=lambda req: 100 + len(req.output_token_ids))
    reqs = [request("a", list(range(1000, 1200)), max_tokens=40),
            request("b", list(range(2000, 2200)), max_tokens=40)]
    for r in reqs:
        engine.add_request(r)
    run_to_completion(engine)
    assert not engine.requests and all(len(r.output_token_ids) == 40 for r in reqs)
    assert (sum(r.num_preemptions for r in reqs) == 0) is reserve


def test_abort_releases_blocks() -> None:
    engine = make_engine()
    engine.add_request(request("a", list(range(100)), max_tokens=50))
    engine.step(0.0)
    assert engine.pool.num_free < engine.pool.num_blocks
    engine.abort_request("a", 1.0)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_work()


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(min_value=1, max_value=64),
    context=st.integers(min_value=0, max_value=16000),
    extra_batch=st.integers(min_value=1, max_value=64),
    extra_context=st.integers(min_value=1, max_value=16000),
)
def test_step_time_is_monotonic_in_batch_and_length(
    batch: int, context: int, extra_batch: int, extra_context: int
) -> None:
    for profile in ALL_PROFILES:
        base = profile.step_time([ScheduledChunk(1, context)] * batch)
        more_seqs = profile.step_time([ScheduledChunk(1, context)] * (batch + extra_batch))
        longer = profile.step_time([ScheduledChunk(1, context + extra_context)] * batch)
        assert more_seqs >= base
        assert longer >= base
        assert profile.step_time([ScheduledChunk(context + 1, 0)]) <= profile.step_time(
            [ScheduledChunk(context + 1 + extra_context, 0)]
        )


def test_profiles_match_their_hardware_anchors() -> None:
    p = get_profile("h100-llama3-8b")
    assert p.kv_bytes_per_token == 128 * 1024
    assert get_profile("h100x4-llama3-70b").kv_bytes_per_token == 320 * 1024
    # ANCHORS.md: recomputing an 8k-token Llama-8B prefix on an H100 takes about 0.2 s.
    assert 0.1 < p.prefill_time(8192) < 0.4


@settings(max_examples=30, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 200), st.integers(1, 12)),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(min_value=16, max_value=64),
)
def test_pool_invariants_hold_for_any_workload(
    prompts: list[tuple[int, int, int]], num_blocks: int
) -> None:
    engine = make_engine(num_blocks=num_blocks, block_size=16, budget=256)
    ids = itertools.count()
    for family, length, max_tokens in prompts:
        prompt = [family * 10000 + t for t in range(length)]
        engine.add_request(request(f"r{next(ids)}", prompt, max_tokens=max_tokens))
    now = 0.0
    # Copies per hash: vLLM announces (and removes) every physical block, duplicates included.
    live: Counter[int] = Counter()
    for _ in range(10000):
        if not engine.has_work():
            break
        out = engine.step(now)
        now += out.duration
        for e in out.kv_events:
            if isinstance(e, BlockStored):
                live.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert live[h] > 0
                    live[h] -= 1
        referenced = sum(1 for b in engine.pool.blocks if b.ref_cnt > 0)
        assert referenced + engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_work()
    # The announced multiset is exactly what the pool caches: events are a faithful account.
    cached = Counter(b.block_hash for b in engine.pool.blocks if b.block_hash is not None)
    assert +live == cached


def test_block_pool_refuses_to_overallocate() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    try:
        pool.allocate(1)
    except ValueError as e:
        assert "cannot allocate" in str(e)
    else:
        raise AssertionError("allocation beyond capacity must fail")


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(min_value=1, max_value=300), context=st.integers(0, 20000))
def test_closed_form_decode_step_equals_the_general_step_time(batch: int, context: int) -> None:
    for profile in ALL_PROFILES:
        general = profile.step_time([ScheduledChunk(1, context)] * batch)
        assert abs(profile.decode_step_time(batch, context) - general) <= 1e-12 + general * 1e-9


def test_a_waiting_request_loses_cached_blocks_evicted_while_it_waits() -> None:
    engine = make_engine(num_blocks=16)
    shared = list(range(9000, 9000 + 64))
    engine.add_request(request("a", shared, max_tokens=1))
    now = run_to_completion(engine)
    # The hog grows to 13 of the 16 blocks: the free queue gives up its never-used blocks, then
    # the last block of a's cached prefix (a's blocks were freed last block first).
    engine.add_request(request("hog", list(range(20000, 20000 + 128)), max_tokens=80))
    now += engine.step(now).duration
    engine.add_request(request("b", [*shared, *range(30000, 30000 + 100)], max_tokens=1))
    waited = False
    while engine.has_work():
        waited = waited or bool(engine.waiting)
        now += engine.step(now).duration
    b = engine.requests.get("b")
    assert b is None and waited
    # Only a's first three blocks were still cached when b got in.
    assert engine.stats.prefix_cache_hits == 48


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 120), st.integers(1, 40), st.booleans(),
                  st.integers(0, 3)),
        min_size=1,
        max_size=10,
    ),
    num_blocks=st.integers(min_value=12, max_value=48),
    priority=st.booleans(),
)
def test_plain_decode_steps_equal_the_general_step(
    prompts: list[tuple[int, int, int, bool, int]], num_blocks: int, priority: bool
) -> None:
    """Every step, its outputs, events and timing, and the counters are the general step's."""
    cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_batched_tokens=64,
                       max_num_seqs=4, max_model_len=2048, eos_token_id=EOS,
                       priority_scheduling=priority)
    engines = [EngineModel(cfg, PROFILE, sampler=lambda req: 100 + len(req.output_token_ids)),
               EngineModel(cfg, PROFILE, sampler=lambda req: 100 + len(req.output_token_ids))]
    engines[1].plain_decode = False
    now = 0.0
    arrivals = list(enumerate(prompts))
    for _ in range(20000):
        # A new request every few steps, so batches grow and shrink while others decode.
        if arrivals and not int(now * 1000) % 3:
            i, (family, length, max_tokens, ignore_eos, stagger) = arrivals.pop(0)
            length = min(length, num_blocks * 16 - max_tokens)
            for engine in engines:
                engine.add_request(SimRequest(
                    f"r{i}", [family * 1000 + t for t in range(length)], max_tokens=max_tokens,
                    arrival_time=now, ignore_eos=ignore_eos, natural_output_len=8 + stagger,
                    priority=stagger))
        if not engines[1].has_work():
            if not arrivals:
                break
            now += 0.001
            continue
        fast, general = (engine.step(now) for engine in engines)
        assert fast == general
        now += general.duration
    assert engines[0].stats == engines[1].stats
    assert not engines[0].has_work() and not arrivals
    assert engines[1].plain_steps == 0


def test_a_lone_decoding_request_takes_the_plain_decode_step() -> None:
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=2048, eos_token_id=EOS)
    engine = EngineModel(cfg, PROFILE, sampler=lambda req: 100 + len(req.output_token_ids))
    engine.add_request(request("a", list(range(1000, 1040)), max_tokens=40))
    run_to_completion(engine)
    # 39 decode steps after the prefill's first token: the last finishes, and at each of the two
    # block boundaries (48 and 64 tokens) one step fills a block and the next allocates one.
    assert engine.plain_steps == 34


def test_step_time_of_equals_the_expressions_it_caches() -> None:
    """The cached factors give the step time and FLOPs to the bit, with or without a separate
    attention efficiency, with or without a cost per sequence."""
    for profile in ALL_PROFILES:
        for new, attended, kv in [(1.0, 5001.0, 5001.0), (3.0, 90.5, 40.0), (8192.0, 3e7, 9e4)]:
            flops = 2.0 * profile.params * new + 4.0 * profile.layers * profile.hidden * attended
            assert profile.step_flops(new, attended) == flops
            if profile.attention_mfu is None:
                compute = flops / (profile.peak_flops * profile.mfu)
            else:
                compute = profile.compute_time(
                    flops, 4.0 * profile.layers * profile.hidden * attended)
            memory = (profile.weight_bytes + kv * profile.kv_bytes_per_token) / (
                profile.mem_bandwidth * profile.mbu)
            for seqs in (1, 7):
                expected = (profile.step_overhead_s + seqs * profile.seq_overhead_s
                            + max(compute, memory))
                assert profile.step_time_of(new, attended, kv, seqs) == expected


def test_each_scheduled_sequence_adds_its_cost_to_the_step() -> None:
    """The engine charges `seq_overhead_s` once per sequence it schedules in a step: the same
    requests on a profile without it take steps shorter by exactly that, step for step."""
    durations = []
    for profile in (dataclasses.replace(PER_SEQUENCE, seq_overhead_s=0.0), PER_SEQUENCE):
        cfg = EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=512,
                           max_num_seqs=8, max_model_len=2048, eos_token_id=EOS)
        engine = EngineModel(cfg, profile, sampler=lambda req: 100 + len(req.output_token_ids))
        for i in range(3):
            engine.add_request(request(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 40)),
                                       max_tokens=6))
        steps = []
        while engine.has_work():
            out = engine.step(0.0)
            steps.append((out.duration, len(out.outputs)))
        durations.append(steps)
    without, with_cost = durations
    assert [n for _, n in with_cost] == [3] * 6  # every step schedules the three requests
    for (plain, _), (charged, n) in zip(without, with_cost, strict=True):
        assert charged - plain == pytest.approx(n * 3e-5, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(min_value=1, max_value=12))
def test_free_order_is_vllms_lru_queue_through_reuse_and_compaction(
    seed: int, num_blocks: int
) -> None:
    """The pool's free order (stale entries skipped, compacted now and then) evicts exactly
    the block an LRU queue that unlinks reused blocks (vLLM's FreeKVCacheBlockQueue) would:
    allocations take from the front, a cached block taken back leaves the queue, a freed one
    joins its end."""
    slack, model._ORDER_SLACK = model._ORDER_SLACK, 4  # compact often
    try:
        _check_free_order(random.Random(seed), BlockPool(num_blocks), num_blocks)
    finally:
        model._ORDER_SLACK = slack


def _check_free_order(rng: random.Random, pool: BlockPool, num_blocks: int) -> None:
    lru: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order = free order
    held: list[list[int]] = []  # per holder, its block ids
    refs = [0] * num_blocks

    def free(ids: list[int]) -> None:
        pool.free([pool.blocks[i] for i in ids])
        for i in reversed(ids):
            refs[i] -= 1
            if refs[i] == 0:
                lru[i] = None

    compactions = 0
    for _ in range(1000):
        op = rng.choice(["alloc", "touch", "free"])
        if len(held) > 3:
            op = "free"  # keep blocks coming back, so the order churns
        length = len(pool._order)
        if op == "alloc" and lru:
            n = rng.randint(1, len(lru))
            want = list(lru)[:n]
            assert [b.block_id for b in pool.allocate(n)] == want
            for i in want:
                del lru[i]
                refs[i] = 1
            held.append(want)
        elif op == "touch":
            # Any blocks, free ones included: a prefix hit on cached blocks nobody holds.
            ids = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
            pool.touch([pool.blocks[i] for i in ids])
            for i in ids:
                if refs[i] == 0:
                    del lru[i]
                refs[i] += 1
            held.append(ids)
        elif op == "free" and held:
            free(held.pop(rng.randrange(len(held))))
        assert pool.num_free == len(lru)
        assert [b.ref_cnt for b in pool.blocks] == refs
        compactions += len(pool._order) < length
    assert compactions > 0  # the run exercised the compaction
    while held:
        free(held.pop())
    assert [b.block_id for b in pool.allocate(num_blocks)] == list(lru)


def probe_per_block(pool: BlockPool, hashes: list[int]) -> list[model.KVBlock]:
    """The leading run of cached blocks, one lookup per hash (what vLLM's lookup does)."""
    found = []
    for h in hashes:
        block = pool.lookup(h)
        if block is None:
            break
        found.append(block)
    return found


@given(
    turns=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 100), st.integers(1, 60), st.integers(1, 24),
                  st.booleans()),
        min_size=1,
        max_size=16,
    ),
    num_blocks=st.integers(min_value=10, max_value=48),
    reset_at=st.integers(0, 40),
)
@settings(max_examples=150, deadline=None)
def test_a_lookup_through_runs_finds_the_blocks_a_probe_per_block_finds(
    turns: list[tuple[int, int, int, int, bool]], num_blocks: int, reset_at: int
) -> None:
    """`cached_run_from` (a stretch of another request's run at once) gives exactly the blocks
    a probe per block finds for every request's hashes, from the start and from
    the middle, after every step: conversations that extend earlier turns (their outputs
    included) or fork them, the same prompt twice at once (two copies of its blocks), eviction,
    preemption in a small pool, and a prefix-cache reset."""
    engine = make_engine(num_blocks=num_blocks, budget=64)
    pool = engine.pool
    requests: list[SimRequest] = []
    now = 0.0
    for step in range(4000):
        if turns and step % 2 == 0:
            parent, cut, extra, max_tokens, twice = turns.pop(0)
            seq: list[int] = []
            if requests and parent:
                prev = requests[parent % len(requests)]
                seq = [*prev.prompt_token_ids, *prev.output_token_ids]
                seq = seq[: len(seq) * cut // 100]
            seq += [5000 + 100 * len(requests) + t for t in range(extra)]
            seq = seq[: num_blocks * 16 - max_tokens - 1]
            for _ in range(2 if twice else 1):
                req = request(f"r{len(requests)}", seq, max_tokens=max_tokens, now=now)
                requests.append(req)
                engine.add_request(req)
        if not engine.has_work():
            if not turns:
                break
            if step >= reset_at:
                engine.reset_prefix_cache()
            now += 0.001
            continue
        now += engine.step(now).duration
        for req in requests:
            hashes = req.block_hashes
            for start in (0, len(hashes) // 2):
                through_runs = pool.cached_run_from(hashes, start, len(hashes))
                per_block = probe_per_block(pool, hashes[start:])
                assert list(map(id, through_runs)) == list(map(id, per_block))
    assert not engine.has_work()


def test_a_run_is_not_followed_past_a_block_cached_as_a_second_copy() -> None:
    """Two requests cached the same two blocks (the second's are copies); once the first's
    first block is evicted, its copy becomes what a probe finds, but the second block's is
    still the first request's: a lookup must not follow the second request's run to its copy."""
    pool = BlockPool(5)
    first, second = pool.allocate(2), pool.allocate(2)
    hashes = [11, 12]
    pool.cache_all(first, hashes, model._Run(first, hashes), 0)
    pool.cache_all(second, hashes, model._Run(second, hashes), 0)
    pool.free([first[0]])
    pool.free(second)
    pool.free([first[1]])
    pool.allocate(2)  # the free one, then first[0] (freed before the others): evicted
    assert pool.lookup(11) is second[0] and pool.lookup(12) is first[1]
    assert (pool.cached_run_from(hashes, 0, 2) == probe_per_block(pool, hashes)
            == [second[0], first[1]])


def test_the_long_prefill_cap_holds_only_while_another_request_could_use_the_budget() -> None:
    # vLLM's --long-prefill-token-threshold (v1 scheduler): a lone request computes its whole
    # prompt in one step; beside another, at most the threshold per step.
    cfg = EngineConfig(block_size=16, num_blocks=1024, max_num_batched_tokens=8192,
                       max_num_seqs=64, max_model_len=32768, eos_token_id=EOS,
                       long_prefill_token_threshold=256)
    alone = EngineModel(cfg, PROFILE, sampler=lambda req: 100)
    alone.add_request(request("a", list(range(1000, 2000))))
    assert alone.step(0.0).num_scheduled_tokens == 1000

    pair = EngineModel(cfg, PROFILE, sampler=lambda req: 100)
    pair.add_request(request("a", list(range(1000, 2000))))
    pair.add_request(request("b", list(range(3000, 3100))))
    out = pair.step(0.0)
    assert out.num_scheduled_tokens == 256 + 100  # the long one capped, the short one whole
    assert {r.request_id: r.num_computed_tokens for r in pair.running} == {"a": 256, "b": 100}
    out = pair.step(out.duration)
    assert out.num_scheduled_tokens == 256 + 1  # the next chunk beside the short one's decode


def chunks_until_computed(engine: EngineModel, req: SimRequest, now: float) -> list[int]:
    """The prompt tokens `req` computes in each step until its whole prompt is computed."""
    chunks = []
    while req.num_computed_tokens < len(req.prompt_token_ids):
        before = req.num_computed_tokens
        now += engine.step(now).duration
        chunks.append(req.num_computed_tokens - before)
    return chunks


def test_kvgates_prefill_cap_holds_only_while_a_running_request_decodes() -> None:
    # kvgate's engine-side pacing (SimRequest.prefill_cap, the vLLM plugin in
    # adapters/vllm_plugins/kvgate_pace.py): a capped prompt computes at most its cap per
    # step beside a decoding request, whole on an engine with nothing decoding.
    cfg = EngineConfig(block_size=16, num_blocks=1024, max_num_batched_tokens=8192,
                       max_num_seqs=64, max_model_len=32768, eos_token_id=EOS)
    alone = EngineModel(cfg, PROFILE, sampler=lambda req: 100)
    capped = request("a", list(range(1000, 2000)))
    capped.prefill_cap = 256
    alone.add_request(capped)
    assert alone.step(0.0).num_scheduled_tokens == 1000

    engine = EngineModel(cfg, PROFILE, sampler=lambda req: 100)
    engine.add_request(request("d", list(range(3000, 3100)), max_tokens=50))
    now = engine.step(0.0).duration  # d's prompt, then it decodes
    capped = request("a", list(range(1000, 2000)), now=now)
    capped.prefill_cap = 256
    engine.add_request(capped)
    plain = request("b", list(range(5000, 5600)), now=now)
    engine.add_request(plain)
    chunks = chunks_until_computed(engine, capped, now)
    assert chunks == [256, 256, 256, 232]  # the last chunk is what is left
    assert plain.num_computed_tokens >= 600  # uncapped beside it: its whole prompt at once
    # A request that is still computing its own prompt is not decoding: no cap beside it.
    both = EngineModel(cfg, PROFILE, sampler=lambda req: 100)
    both.add_request(request("d", list(range(3000, 3100)), max_tokens=2))
    fresh = request("a", list(range(1000, 2000)))
    fresh.prefill_cap = 256
    both.add_request(fresh)
    assert both.step(0.0).num_scheduled_tokens == 100 + 1000


def test_kvgates_prefill_caps_lower_the_cap_as_the_prompt_gets_on() -> None:
    # SimRequest.prefill_caps: (computed tokens, cap) steps after the first cap, as the planner
    # sends them (`vllm_xargs.kvgate_prefill_caps`).
    cfg = EngineConfig(block_size=16, num_blocks=1024, max_num_batched_tokens=8192,
                       max_num_seqs=64, max_model_len=32768, eos_token_id=EOS)
    engine = EngineModel(cfg, PROFILE, sampler=lambda req: 100)
    engine.add_request(request("d", list(range(3000, 3100)), max_tokens=50))
    now = engine.step(0.0).duration
    capped = request("a", list(range(1000, 2000)), now=now)
    capped.prefill_cap = 256
    capped.prefill_caps = ((500, 128), (800, 64))
    engine.add_request(capped)
    chunks = chunks_until_computed(engine, capped, now)
    # 256 up to 512 (the step that crosses 500 began under it), then 128 from 512 to 896,
    # then 64.
    assert chunks == [256, 256, 128, 128, 128, 64, 40], chunks
    # A waiting request's cache hits count as computed, as in vLLM's scheduler: one that finds
    # 992 tokens cached starts at the cap for 992 (64), not at its first cap.
    again = request("a2", [*range(1000, 1992), *range(7000, 7300)], now=now)
    again.prefill_cap = 256
    again.prefill_caps = ((500, 128), (800, 64))
    engine.add_request(again)
    assert again.num_computed_tokens == 0
    first = chunks_until_computed(engine, again, now)[0]
    assert first == 992 + 64  # the hits, then one chunk at the later cap
