"""`llmd-affinity-like` and `llmd-approx-affinity-like` follow llm-d's current default profile:
prefix-cache affinity filter (threshold 0.80, a load gate on in-flight tokens), token-load
scorer, in-flight tokens released at the first token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import prepare
from kvgate.bench.virtual import VirtualRun
from kvindex.index import EngineMatch
from planner.policies.llmd_affinity_like import (
    APPROX_GATE_TOKENS,
    MAX_TTFT_PENALTY_MS,
    PRECISE_PEAK_PREFILL_THROUGHPUT,
    QUEUE_THRESHOLD_TOKENS,
    LlmdAffinityScheduler,
    LlmdApproxAffinityScheduler,
    LlmdP2PTokenAwareScheduler,
    token_load_score,
)
from planner.policies.llmd_approx_like import PodBlockLru
from planner.policy import EngineView, PolicyContext, RouteRequest, make_policy, placement_of
from planner.transfer import NAMED_LINKS, Pull

MODEL = "m"
PRECISE_GATE = MAX_TTFT_PENALTY_MS * PRECISE_PEAK_PREFILL_THROUGHPUT / 1000.0


def pool(*names: str) -> list[EngineView]:
    return [EngineView(name=n, healthy=True, models=frozenset({MODEL})) for n in names]


def req(rid: str, tokens: int, matches: Mapping[str, int] | None = None,
        keys: Sequence[int] | None = None) -> RouteRequest:
    """A prompt of `tokens` tokens in 16-token index blocks; `matches`: leading index blocks held
    per engine."""
    blocks = tokens // 16
    return RouteRequest(
        request_id=rid, model=MODEL, prompt_tokens=tokens, block_size=16,
        block_keys=tuple(keys if keys is not None else range(blocks)),
        matches={n: EngineMatch(n, b, b, float(b)) for n, b in (matches or {}).items()})


def send(policy: LlmdAffinityScheduler | LlmdApproxAffinityScheduler, r: RouteRequest,
         engines: Sequence[EngineView]) -> str:
    placement = placement_of(policy.choose(r, engines, 0.0))
    policy.on_dispatch(r, placement, 0.0)
    return placement.engine


def test_registered_with_their_peers_mechanisms() -> None:
    precise = make_policy("llmd-affinity-like")
    approx = make_policy("llmd-approx-affinity-like")
    assert precise.speculative_entries and not precise.moves_kv
    assert getattr(precise, "reads_index", True)
    assert not approx.speculative_entries and not approx.moves_kv
    assert getattr(approx, "reads_index", True) is False
    assert abs(PRECISE_GATE - 286668.0) < 1e-6
    assert LlmdAffinityScheduler().gate_tokens == pytest.approx(PRECISE_GATE)
    assert LlmdApproxAffinityScheduler().gate_tokens == APPROX_GATE_TOKENS
    assert LlmdAffinityScheduler(max_ttft_penalty_ms=0).gate_tokens == float("inf")


def test_holders_keep_traffic_until_their_in_flight_lead_passes_the_gate() -> None:
    """A holder of the prefix is sticky: an idle engine that would recompute it gets nothing
    while the holder's in-flight tokens lead by no more than the gate (18 s at 15,926 tokens/s);
    then every engine is scored by token load and the idle one wins."""
    policy = LlmdAffinityScheduler()
    engines = pool("a", "b")
    held = {"a": 400}  # a holds 100 whole blocks of each prompt's 120 (0.83)
    load = n = 0
    while load <= PRECISE_GATE:
        assert send(policy, req(f"r{n}", 64 * 120, held), engines) == "a"
        load += 64 * 20  # each request's uncached part stays in flight at a
        assert policy.inflight.load("a") == load
        n += 1
    assert send(policy, req("next", 64 * 120, held), engines) == "b"


def test_gate_compares_in_flight_only_and_is_strict() -> None:
    """The gate reads the endpoints' in-flight tokens, not this request's own (the scorer adds
    those); a lead of exactly the gate still sticks."""
    policy = LlmdApproxAffinityScheduler(gate_tokens=2000)
    engines = pool("a", "b")
    policy.pods["a"] = PodBlockLru(100)
    policy.pods["a"].add(tuple(range(3, 64, 4)))  # every 64-token block of a 1024-token prompt
    r = req("r", 1024, keys=range(64))
    policy.inflight.add("x", "a", 2000)
    assert policy.choose(r, engines, 0.0) == "a"  # a lead of 2000 is not over 2000
    policy.inflight.add("y", "a", 1)
    assert policy.choose(r, engines, 0.0) == "b"  # all kept: b's 1024 uncached < a's 2001


def test_threshold_is_inclusive_and_below_it_the_least_loaded_wins() -> None:
    policy = LlmdAffinityScheduler()
    engines = pool("a", "b", "c")
    policy.inflight.add("busy", "b", 50_000)
    policy.inflight.add("busier", "c", 60_000)
    # 10 whole blocks; a holds 8 (0.80): sticky.
    assert policy.choose(req("r8", 640, {"a": 32}), engines, 0.0) == "a"
    policy.inflight.add("a-load", "a", 100_000)
    assert policy.choose(req("r8b", 640, {"a": 32}), engines, 0.0) == "a"
    # a leads b by 50k in flight, under the gate: still a. At 7 of 10 (0.70) nothing is
    # sticky and token load decides: b's 50k + 640 < c's 60k + 640 < a's 100k + 192.
    assert policy.choose(req("r7", 640, {"a": 28}), engines, 0.0) == "b"


def test_token_load_counts_this_requests_uncached_tokens() -> None:
    """With nothing sticky, the endpoint with the least in-flight plus uncached tokens wins: an
    engine holding part of the prompt can beat a less loaded one that would recompute all."""
    policy = LlmdAffinityScheduler()
    engines = pool("a", "b")
    policy.inflight.add("x", "a", 3000)
    # 100 blocks, a holds 70 (below 0.8): a = 3000 + 30 * 64 = 4920; b = 0 + 6400.
    assert policy.choose(req("r", 6400, {"a": 280}), engines, 0.0) == "a"
    assert token_load_score(0, 0) == 1.0
    assert token_load_score(QUEUE_THRESHOLD_TOKENS, 5) == 0.0
    assert token_load_score(1024, 1024) == pytest.approx(1 - 2048 / QUEUE_THRESHOLD_TOKENS)


def test_in_flight_tokens_leave_at_the_end_or_at_the_first_token_when_streamed() -> None:
    engines = pool("a", "b")
    for streamed in (False, True):
        policy = LlmdAffinityScheduler(release_at_first_token=streamed)
        # 10 blocks plus a 30-token tail; both hold 6 whole blocks: 4 * 64 + 30 uncached.
        engine = send(policy, req("r1", 670, {"a": 24, "b": 24}), engines)
        assert policy.inflight.load(engine) == 4 * 64 + 30
        policy.on_first_token("r1", engine, 1.0)
        assert policy.inflight.load(engine) == (0 if streamed else 4 * 64 + 30)
        policy.on_finish("r1", engine, 2.0)
        assert policy.inflight.load(engine) == 0
        engine = send(policy, req("r2", 640), engines)
        assert policy.inflight.load(engine) == 640
        policy.on_finish("r2", engine, 2.0)  # failed before its first token
        policy.on_finish("r2", engine, 2.0)  # released once
        assert policy.inflight.load(engine) == 0


def test_a_prompt_under_one_block_has_no_prefix_and_goes_by_load() -> None:
    policy = LlmdAffinityScheduler()
    engines = pool("a", "b")
    policy.inflight.add("x", "a", 10)
    assert policy.choose(req("short", 48, {"a": 3}), engines, 0.0) == "b"
    assert policy.scores(req("short", 48, {"a": 3}), engines) == {
        "a": pytest.approx(1 - 58 / QUEUE_THRESHOLD_TOKENS),
        "b": pytest.approx(1 - 48 / QUEUE_THRESHOLD_TOKENS)}


def test_ties_break_at_random_by_seed() -> None:
    picks = {send(LlmdAffinityScheduler(PolicyContext(seed=s)), req("r", 640), pool("a", "b"))
             for s in range(16)}
    assert picks == {"a", "b"}
    again = [send(LlmdAffinityScheduler(PolicyContext(seed=3)), req("r", 640), pool("a", "b"))
             for _ in range(4)]
    assert len(set(again)) == 1


def test_approx_records_its_routing_and_sticks_to_it() -> None:
    """The approximate producer learns a prompt where it routes it (no engine events): the same
    context goes back there; another context goes to the least loaded engine."""
    policy = LlmdApproxAffinityScheduler()
    engines = pool("a", "b", "c")
    context = list(range(1000, 3000))  # 32,000 tokens in 16-token keys
    first = send(policy, req("c0", 32000, keys=context), engines)
    for n in range(1, 6):
        # The same context plus a 64-token question: 500 of 501 blocks held (0.998).
        r = req(f"c{n}", 32064, keys=[*context, *(99_000 + 100 * i + n for i in range(4))])
        assert send(policy, r, engines) == first
    assert policy.inflight.load(first) == 32000 + 5 * 64
    other = send(policy, req("d", 32000, keys=range(5000, 7000)), engines)
    assert other != first
    # Beyond 40,960 tokens the producer stops matching: a 64k prompt has 640 blocks.
    assert len(policy.hashes(req("long", 64000, keys=range(4000)))) == 640


def test_approx_blocks_follow_the_engines_block_size_when_larger() -> None:
    policy = LlmdApproxAffinityScheduler()
    r = RouteRequest(request_id="r", model=MODEL, prompt_tokens=1024, block_size=128,
                     block_keys=tuple(range(8)))
    assert policy.block_tokens(r) == 128
    assert policy.hashes(r) == tuple(range(8))


def test_p2p_tokenaware_places_by_token_load_alone_and_pulls_from_a_leading_peer() -> None:
    """The P2P guide's token-aware arm: no affinity filter (a holder loses to a less loaded
    engine once its in-flight tokens outweigh the recompute), then the guide's pull."""
    link = PolicyContext(link=NAMED_LINKS["rdma"])
    policy = make_policy("llmd-p2p-tokenaware-like", link)
    assert isinstance(policy, LlmdP2PTokenAwareScheduler)
    assert policy.moves_kv and not policy.speculative_entries
    engines = pool("a", "b")
    r = req("r", 8192, {"a": 512})  # a holds all 128 blocks: nothing uncached there
    assert placement_of(policy.choose(r, engines, 0.0)).engine == "a"
    policy.inflight.add("x", "a", 8000)  # a's in-flight outweighs b's 8,192-token recompute
    placement = placement_of(policy.choose(r, engines, 0.0))
    assert placement.engine == "a"  # 8000 < 8192: still a
    policy.inflight.add("y", "a", 500)
    placement = placement_of(policy.choose(r, engines, 0.0))
    assert placement.engine == "b" and placement.pull == Pull("a", 8192)
    # Without a link there is no pull.
    plain = LlmdP2PTokenAwareScheduler()
    plain.inflight.add("y", "a", 8500)
    assert plain.choose(r, engines, 0.0) == "b"


@pytest.mark.parametrize("name", ["llmd-affinity-like", "llmd-approx-affinity-like",
                                  "llmd-p2p-tokenaware-like"])
def test_in_the_virtual_driver_every_request_leaves_the_in_flight_count(name: str) -> None:
    """Wired into the planner's events: while requests run the count holds their uncached
    tokens, and once every workflow is done it is empty again (nothing leaks or is released
    twice); with a link the token-aware arm pulls a long context it placed away from it."""
    o = BenchOptions(workload="fanout", workload_args={"context_tokens": "16000", "width": "4"},
                     profile="h100x4-llama3-70b", rate=0.5, workflows=6, engines=3,
                     link="rdma", progress=False)
    prepared = prepare(o)
    run = VirtualRun(name, prepared.workflows, prepared.load, o.engine_profile(), o.engines,
                     prepared.builder, link=o.transfer_link())
    policy = run.planner.policy
    assert isinstance(policy, LlmdAffinityScheduler | LlmdApproxAffinityScheduler)
    peak = 0
    add = policy.inflight.add

    def counting(request_id: str, engine: str, tokens: int) -> None:
        nonlocal peak
        add(request_id, engine, tokens)
        peak = max(peak, sum(policy.inflight.tokens.values()))

    policy.inflight.add = counting  # type: ignore[method-assign]
    result = run.run()
    assert not any(w.failed or w.finished_s is None for w in result.workflows)
    assert peak > 16000
    assert sum(policy.inflight.tokens.values()) == 0
    if name == "llmd-p2p-tokenaware-like":
        assert run.fleet.transferred_bytes > 0
