"""The peer baselines (session, sglang-like, llmd-like, llmd-approx-like, dynamo-like) follow
their peers' rules."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvindex.index import EngineMatch
from kvindex.keys import chain_keys
from planner.policies.dynamo_like import DynamoKvRouter, _ActiveBlocks
from planner.policies.llmd_approx_like import LlmdApproximateScheduler
from planner.policies.llmd_like import LlmdPreciseScheduler, precise_prefix_scores
from planner.policies.session import SessionAffinity
from planner.policies.sglang_like import CharRadixTree, SglangCacheAware
from planner.policy import (
    EngineView,
    NoEngineAvailable,
    Placement,
    PolicyContext,
    RouteRequest,
    RoutingPolicy,
    make_policy,
    placement_of,
    scrape_interval,
)

MODEL = "m"
BASELINES = ["session", "sglang-like", "llmd-like", "llmd-approx-like", "llmd-p2p-affinity-like",
             "llmd-affinity-like", "llmd-approx-affinity-like", "llmd-p2p-tokenaware-like",
             "dynamo-like"]
SYSTEM = "You are a meticulous assistant. Follow the tool schema exactly. " * 20


def engine(name: str, *, healthy: bool = True, waiting: int = 0, running: int = 0,
           in_flight: int = 0, kv_usage: float = 0.0, queued_prefill_tokens: int = 0,
           active_blocks: int = 0) -> EngineView:
    return EngineView(name=name, healthy=healthy, models=frozenset({MODEL}), num_waiting=waiting,
                      num_running=running, in_flight=in_flight, kv_usage=kv_usage,
                      queued_prefill_tokens=queued_prefill_tokens, active_blocks=active_blocks)


def request(rid: str = "r", *, session: str | None = None, text: str = "",
            keys: Sequence[int] = (), tokens: int | None = None,
            matches: Mapping[str, EngineMatch] | None = None) -> RouteRequest:
    return RouteRequest(request_id=rid, model=MODEL, session_id=session,
                        prompt_tokens=len(keys) * 16 if tokens is None else tokens,
                        block_keys=tuple(keys), block_size=16, matches=matches or {},
                        prompt_text=text)


def hit(name: str, blocks: int, *, confirmed: int | None = None,
        weighted: float | None = None) -> EngineMatch:
    return EngineMatch(engine=name, blocks=blocks,
                       confirmed_blocks=blocks if confirmed is None else confirmed,
                       weighted_blocks=float(blocks) if weighted is None else weighted)


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def route(policy: RoutingPolicy, req: RouteRequest, pool: Sequence[EngineView],
          now: float = 0.0) -> str:
    """Choose and dispatch, as the gateway does."""
    placement = placement_of(policy.choose(req, pool, now))
    policy.on_dispatch(req, placement, now)
    return placement.engine


# -- session -----------------------------------------------------------------------------------

def test_session_requests_of_one_session_stick_to_one_engine() -> None:
    policy = SessionAffinity()
    pool = [engine(n) for n in "abcd"]
    homes: dict[int, str] = {}
    for turn in range(5):
        for s in range(40):
            choice = route(policy, request(f"{s}-{turn}", session=f"s{s}"), pool, float(turn))
            assert homes.setdefault(s, choice) == choice
    assert len(set(homes.values())) == 4


def test_session_engine_leaving_moves_only_its_own_sessions() -> None:
    policy = SessionAffinity()
    pool = [engine(n) for n in "abcd"]
    sessions = [f"user-{i}" for i in range(2000)]
    before = {s: policy.choose(request(session=s), pool, 0.0) for s in sessions}
    after = {s: policy.choose(request(session=s), pool[:2] + pool[3:], 1.0) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(before[s] == "c" for s in moved)
    assert 0.15 < len(moved) / len(sessions) < 0.35


def test_session_engine_joining_takes_about_one_in_n_sessions() -> None:
    policy = SessionAffinity()
    pool = [engine(n) for n in "abcd"]
    sessions = [f"user-{i}" for i in range(2000)]
    before = {s: policy.choose(request(session=s), pool, 0.0) for s in sessions}
    after = {s: policy.choose(request(session=s), [*pool, engine("e")], 1.0) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "e" for s in moved)
    assert 0.12 < len(moved) / len(sessions) < 0.28


def test_session_less_request_prefers_an_engine_that_never_had_a_request() -> None:
    policy = SessionAffinity()
    pool = [engine("a"), engine("b")]
    route(policy, request("1"), pool, 0.0)
    route(policy, request("2", session="x"), [engine("a")], 0.0)
    assert policy.choose(request("3"), pool, 0.0) == "b"


def test_session_less_request_goes_to_the_lowest_qps_in_the_window() -> None:
    policy = SessionAffinity(qps_window_s=60.0)
    pool = [engine("a"), engine("b")]
    for i in range(3):
        route(policy, request(f"a{i}"), [engine("a")], 0.0)
    route(policy, request("b0"), [engine("b")], 30.0)
    assert policy.choose(request("x"), pool, 59.0) == "b"
    assert policy.choose(request("y"), pool, 61.0) == "a"


# -- sglang-like -------------------------------------------------------------------------------

@given(st.lists(st.text("ab", max_size=12), min_size=1, max_size=20), st.text("abc", max_size=14))
def test_sglang_tree_match_is_the_longest_common_prefix_with_any_inserted_text(
        texts: list[str], query: str) -> None:
    tree = CharRadixTree()
    for i, text in enumerate(texts):
        tree.insert(text, float(i))
    assert tree.match(query)[0] == max(common_prefix(query, t) for t in texts)


@given(st.lists(st.text("ab", max_size=12), max_size=20))
def test_sglang_tree_size_counts_each_distinct_prefix_character_once(texts: list[str]) -> None:
    tree = CharRadixTree()
    for i, text in enumerate(texts):
        tree.insert(text, float(i))
    assert tree.chars == len({t[:n] for t in texts for n in range(1, len(t) + 1)})


def test_sglang_low_concurrency_sends_a_shared_prefix_to_one_worker() -> None:
    policy = SglangCacheAware()
    pool = [engine(n) for n in "abc"]
    choices = {route(policy, request(f"q{i}", text=SYSTEM + f"question {i}"), pool, float(i))
               for i in range(30)}
    assert choices == {"a"}


def test_sglang_hot_prefix_piles_on_one_worker_until_it_is_64_requests_ahead() -> None:
    policy = SglangCacheAware()
    pool = [engine(n) for n in "abc"]
    choices = [route(policy, request(f"q{i}", text=SYSTEM + str(i)), pool) for i in range(66)]
    assert choices[:65] == ["a"] * 65
    assert choices[65] == "b"


def test_sglang_imbalance_needs_the_relative_threshold_too() -> None:
    policy = SglangCacheAware()
    for i in range(200):
        policy.on_dispatch(request(f"a{i}", text=SYSTEM), Placement("a"), 0.0)
    for i in range(135):
        policy.on_dispatch(request(f"b{i}", text="other"), Placement("b"), 0.0)
    # 200 - 135 > 64, but 200 <= 1.5 x 135: still balanced, so the cache decides.
    assert policy.choose(request(text=SYSTEM + "?"), [engine("a"), engine("b")], 1.0) == "a"


def test_sglang_finished_requests_stop_counting_as_load() -> None:
    policy = SglangCacheAware()
    pool = [engine("a"), engine("b")]
    for i in range(70):
        route(policy, request(f"q{i}", text=SYSTEM), [engine("a")])
    for i in range(70):
        policy.on_finish(f"q{i}", "a", 1.0)
    assert policy.choose(request(text=SYSTEM + "?"), pool, 2.0) == "a"


def test_sglang_match_rate_at_or_below_threshold_goes_to_the_least_loaded_worker() -> None:
    policy = SglangCacheAware()
    route(policy, request("1", text="x" * 100), [engine("a")])
    route(policy, request("2", text="y" * 10), [engine("b")])
    route(policy, request("2b", text="y" * 11), [engine("b")])
    route(policy, request("3", text="z" * 50), [engine("c")])
    policy.on_finish("3", "c", 0.5)
    pool = [engine(n) for n in "abc"]
    # c holds the most text but nothing in flight; b's tree is the smallest but it is busiest.
    assert policy.choose(request(text="x" * 30 + "w" * 70), pool, 1.0) == "c"
    assert policy.choose(request(text="x" * 31 + "w" * 69), pool, 1.0) == "a"


def test_sglang_least_loaded_ties_go_to_the_first_worker_in_pool_order() -> None:
    policy = SglangCacheAware()
    route(policy, request("1", text="x" * 100), [engine("a")])
    pool = [engine(n) for n in "abc"]
    assert policy.choose(request(text="unrelated"), pool, 1.0) == "b"


def test_sglang_least_loaded_ties_go_to_the_worker_routed_to_least() -> None:
    """smg's (load, processed, index) key: an idle pool's cold misses, each over before the
    next, go round the workers rather than all to the first (sglang-router 0.3.2's)."""
    policy = SglangCacheAware()
    pool = [engine(n) for n in "abc"]
    chosen = []
    for i in range(6):
        name = route(policy, request(f"q{i}", text=f"{i} unrelated " * 20), pool, float(i))
        policy.on_finish(f"q{i}", name, float(i) + 0.5)
        chosen.append(name)
    assert chosen == ["a", "b", "c", "a", "b", "c"]
    # sglang-router 0.3.2 (`sglang-0.3-like`): the first worker in pool order every time.
    old = make_policy("sglang-0.3-like")
    for i in range(3):
        assert route(old, request(f"r{i}", text=f"{i} unrelated " * 20), pool, float(i)) == "a"
        old.on_finish(f"r{i}", "a", float(i) + 0.5)


def test_sglang_equal_matches_go_to_the_worker_that_cached_the_prefix_last() -> None:
    policy = SglangCacheAware()
    route(policy, request("1", text=SYSTEM + "1"), [engine("a")], 0.0)
    route(policy, request("2", text=SYSTEM + "2"), [engine("b")], 1.0)
    pool = [engine("a"), engine("b")]
    assert policy.choose(request(text=SYSTEM + "3"), pool, 2.0) == "b"


def test_sglang_eviction_tick_drops_least_recently_used_text_beyond_the_size_bound() -> None:
    policy = SglangCacheAware(max_tree_chars=100)
    route(policy, request("old", text="A" * 80), [engine("a")], 0.0)
    route(policy, request("new", text="B" * 80), [engine("a")], 10.0)
    pool = [engine("a"), engine("b")]
    assert policy.choose(request(text="A" * 80), pool, 61.0) == "b"
    assert policy.choose(request(text="B" * 80), pool, 61.0) == "a"


def test_sglang_text_within_the_size_bound_survives_eviction_ticks() -> None:
    policy = SglangCacheAware()
    route(policy, request("old", text=SYSTEM), [engine("a")], 0.0)
    pool = [engine("a"), engine("b")]
    policy.choose(request(text="unrelated"), pool, 61.0)
    assert policy.choose(request(text=SYSTEM + "again"), pool, 300.0) == "a"


# -- llmd-like ---------------------------------------------------------------------------------

def test_llmd_total_is_the_weighted_sum_of_clamped_scores() -> None:
    policy = LlmdPreciseScheduler()
    req = request(keys=range(10), matches={"a": hit("a", 8), "b": hit("b", 5, weighted=4.0)})
    pool = [engine("a", kv_usage=0.5, waiting=4), engine("b", kv_usage=0.2),
            engine("c", waiting=2)]
    # prefix (min-max over hits 8.0 and 4.0): a 1, b 0, c 0 (no hit), weight 2
    # kv-util: a 0.5, b 0.8, c 1.0; queue (max 4, min 0): a 0, b 1, c 0.5; weights 1 and 1
    assert policy.scores(req, pool) == pytest.approx({"a": 2.5, "b": 1.8, "c": 1.5})
    assert policy.choose(req, pool, 0.0) == "a"


def test_llmd_prefix_beats_an_idle_engine_only_when_weights_favour_it() -> None:
    req = request(keys=range(10), matches={"a": hit("a", 10)})
    pool = [engine("a", kv_usage=0.9, waiting=5), engine("b")]
    # a: 2 x 1 + 0.1 + 0 = 2.1 against b: 0 + 1 + 1 = 2.0
    assert LlmdPreciseScheduler().choose(req, pool, 0.0) == "a"
    # a: 1 x 1 + 0.1 + 0 = 1.1 against b: 2.0
    assert LlmdPreciseScheduler(prefix_weight=1.0).choose(req, pool, 0.0) == "b"


def test_llmd_a_sole_prefix_hit_earns_the_full_prefix_score() -> None:
    req = request(keys=range(100), matches={"a": hit("a", 4)})
    scores = LlmdPreciseScheduler().scores(req, [engine("a"), engine("b")])
    assert scores == pytest.approx({"a": 4.0, "b": 2.0})


def test_llmd_a_pod_without_the_first_64_token_block_scores_zero() -> None:
    # 3 index blocks of 16 tokens are less than llm-d's first 64-token block.
    req = request(keys=range(20), matches={"a": hit("a", 3), "b": hit("b", 8)})
    scores = precise_prefix_scores(req, [engine("a"), engine("b"), engine("c")])
    assert scores == {"a": 0.0, "b": 1.0, "c": 0.0}


def test_llmd_prefix_runs_are_min_max_normalised_over_the_holders() -> None:
    req = request(keys=range(40), matches={"a": hit("a", 4), "b": hit("b", 8),
                                           "c": hit("c", 16)})
    scores = precise_prefix_scores(req, [engine(n) for n in "abcd"])
    assert scores == pytest.approx({"a": 0.0, "b": 1 / 3, "c": 1.0, "d": 0.0})


def test_llmd_ignores_speculative_index_entries() -> None:
    req = request(keys=range(20), matches={"a": hit("a", 8, confirmed=0), "b": hit("b", 4)})
    assert precise_prefix_scores(req, [engine("a"), engine("b")]) == {"a": 0.0, "b": 1.0}


def test_llmd_queue_reads_only_the_scraped_waiting_count() -> None:
    policy = LlmdPreciseScheduler()
    pool = [engine("a", running=1, in_flight=9), engine("b", waiting=1, running=1, in_flight=2)]
    assert policy.choose(request(), pool, 0.0) == "a"


def test_llmd_a_sole_holder_keeps_the_traffic_however_long_its_queue() -> None:
    policy = LlmdPreciseScheduler()
    req = request(keys=range(20), matches={"a": hit("a", 16)})
    # a: 2 x 1 + (1 - usage) + 0 against an idle b: 0 + 1 + 1 = 2; only a full KV cache ties.
    pool = [engine("a", waiting=50, kv_usage=0.99), engine("b")]
    assert policy.choose(req, pool, 0.0) == "a"
    pool = [engine("a", waiting=50, kv_usage=1.0), engine("b")]
    assert {policy.choose(req, pool, 0.0) for _ in range(40)} == {"a", "b"}


def test_llmd_asks_drivers_for_its_peers_50_ms_metrics_refresh() -> None:
    assert scrape_interval(LlmdPreciseScheduler(), 0.5) == 0.05
    assert scrape_interval(LlmdPreciseScheduler(), 0.01) == 0.01
    assert scrape_interval(DynamoKvRouter(), 0.5) == 0.5


def test_llmd_ties_are_broken_at_random() -> None:
    policy = LlmdPreciseScheduler(PolicyContext(seed=3))
    pool = [engine(n) for n in "abc"]
    assert {policy.choose(request(), pool, 0.0) for _ in range(50)} == {"a", "b", "c"}


# -- llmd-approx-like --------------------------------------------------------------------------

def test_llmd_approx_scores_matched_over_total_16_token_blocks_it_routed_itself() -> None:
    policy = LlmdApproximateScheduler()
    pool = [engine("a"), engine("b")]
    policy.on_dispatch(request("1", keys=range(8)), Placement("a"), 0.0)
    # 8 index blocks of 16 tokens; the 16-token prompt blocks are the same keys.
    req = request(keys=[0, 1, 2, 3, 90, 91, 92, 93])
    assert policy.prefix_matches(policy.prompt_hashes(req)) == {"a": 4}
    # a: 3 x 4/8 + queue 2 + kv 2 + no-hit-lru 2 x 0.5 (warm); b: 0 + 2 + 2 + 1
    assert policy.scores(req, pool) == pytest.approx({"a": 6.5, "b": 5.0})


def test_llmd_approx_learns_only_from_its_own_routing_not_the_kv_index() -> None:
    policy = LlmdApproximateScheduler()
    pool = [engine("a"), engine("b"), engine("c")]
    req = request("1", keys=range(8), matches={"c": hit("c", 8)})
    first = route(policy, req, pool)
    for i in range(5):
        assert route(policy, request(f"again{i}", keys=range(8), matches={"c": hit("c", 8)}),
                     pool) == first


def test_llmd_approx_matches_at_most_the_first_256_blocks() -> None:
    policy = LlmdApproximateScheduler()
    policy.on_dispatch(request("1", keys=range(300)), Placement("a"), 0.0)
    req = request(keys=[*range(256), *range(1000, 1044)])
    assert len(policy.prompt_hashes(req)) == 256
    assert policy.prefix_matches(policy.prompt_hashes(req)) == {"a": 256}


def test_llmd_approx_spreads_cold_requests_over_the_least_recently_used_pods() -> None:
    policy = LlmdApproximateScheduler()
    pool = [engine(n) for n in "abcd"]
    choices = [route(policy, request(f"cold{i}", keys=[1000 * i + j for j in range(4)]), pool)
               for i in range(8)]
    assert choices == ["a", "b", "c", "d", "a", "b", "c", "d"]


def test_llmd_approx_no_hit_lru_ranks_never_used_pods_first_then_oldest() -> None:
    policy = LlmdApproximateScheduler()
    pool = [engine(n) for n in "abcd"]
    policy.on_dispatch(request("1", keys=[1]), Placement("c"), 0.0)
    policy.on_dispatch(request("2", keys=[2]), Placement("a"), 0.0)
    scores = policy.no_hit_lru_scores(pool)
    # never used: b, d (ranks 0, 1); then c (oldest, rank 2) and a (rank 3)
    assert scores == pytest.approx({"b": 1.0, "d": 2 / 3, "c": 1 / 3, "a": 0.0})


def test_llmd_approx_warm_requests_leave_the_no_hit_lru_alone() -> None:
    policy = LlmdApproximateScheduler()
    policy.on_dispatch(request("1", keys=range(4)), Placement("a"), 0.0)
    policy.on_dispatch(request("2", keys=range(4)), Placement("b"), 0.0)
    assert list(policy.cold.order) == ["a"]


def test_llmd_approx_pod_record_forgets_the_least_recently_routed_blocks() -> None:
    policy = LlmdApproximateScheduler(lru_capacity_per_pod=8)
    policy.on_dispatch(request("1", keys=range(8)), Placement("a"), 0.0)
    policy.on_dispatch(request("2", keys=range(100, 104)), Placement("a"), 1.0)
    assert policy.prefix_matches(policy.prompt_hashes(request(keys=range(8)))) == {}
    assert policy.prefix_matches(policy.prompt_hashes(request(keys=range(100, 104)))) == {"a": 4}


def test_llmd_approx_pod_record_holds_as_many_blocks_as_the_pods_kv_cache() -> None:
    """GIE's autoTune (its default): each pod's LRU is sized to the engine's own block count,
    so the record forgets a prefix about when the engine evicts it."""
    from planner.policy import PolicyContext
    from planner.profiles import get_profile

    small = get_profile("h200-qwen3-32b")
    ctx = PolicyContext(profiles={"a": small, "b": get_profile("h100-llama3-8b")})
    policy = LlmdApproximateScheduler(ctx)
    assert policy.capacity("a") == small.num_blocks(16) == 13824
    assert policy.capacity("b") == get_profile("h100-llama3-8b").num_blocks(16)
    assert LlmdApproximateScheduler(ctx, lru_capacity_per_pod=31250).capacity("a") == 31250


# -- dynamo-like -------------------------------------------------------------------------------

def test_dynamo_cost_is_scaled_prefill_blocks_plus_active_blocks() -> None:
    policy = DynamoKvRouter()
    req = request(keys=range(10), tokens=160, matches={"a": hit("a", 6)})
    pool = [engine("a", queued_prefill_tokens=64, active_blocks=30),
            engine("b", active_blocks=20)]
    # a: (64 + 160 - 6 x 16) / 16 = 8 prefill blocks, 30 + 10 decode blocks -> 48
    # b: 160 / 16 = 10 prefill blocks, 20 + 10 decode blocks -> 40
    assert policy.costs(req, pool) == pytest.approx({"a": 48.0, "b": 40.0})
    assert policy.choose(req, pool, 0.0) == "b"
    assert DynamoKvRouter(prefill_load_scale=2.0).costs(req, pool) == pytest.approx(
        {"a": 56.0, "b": 50.0})


def test_dynamo_overlap_reduces_cost() -> None:
    policy = DynamoKvRouter()
    req = request(keys=range(10), tokens=160, matches={"b": hit("b", 8)})
    pool = [engine("a", active_blocks=5), engine("b", active_blocks=5)]
    costs = policy.costs(req, pool)
    assert costs["a"] - costs["b"] == pytest.approx(8.0)
    assert policy.choose(req, pool, 0.0) == "b"


def test_dynamo_ignores_speculative_index_entries() -> None:
    req = request(keys=range(10), matches={"b": hit("b", 8, confirmed=0)})
    costs = DynamoKvRouter().costs(req, [engine("a"), engine("b")])
    assert costs["a"] == costs["b"]


def test_dynamo_breaks_equal_costs_at_random_by_seed() -> None:
    """Upstream reservoir-samples the workers of equal lowest cost (temperature 0)."""
    req = request(keys=range(10))
    pool = [engine("a"), engine("b"), engine("c", active_blocks=1)]
    picks = {DynamoKvRouter(PolicyContext(seed=s)).choose(req, pool, 0.0) for s in range(16)}
    assert picks == {"a", "b"}
    assert len({DynamoKvRouter(PolicyContext(seed=5)).choose(req, pool, 0.0)
                for _ in range(4)}) == 1


def test_dynamo_blocks_shared_with_in_flight_requests_count_once() -> None:
    policy = DynamoKvRouter()
    policy.on_dispatch(request("first", keys=range(10)), Placement("a"), 0.0)
    policy.on_dispatch(request("second", keys=[*range(8), 100, 101]), Placement("a"), 0.0)
    req = request(keys=[*range(8), 200, 201], tokens=0)
    # Unique active blocks at a: 12 of the 20 the gateway sums; 2 of the request's are new.
    assert policy.costs(req, [engine("a", active_blocks=20)]) == {"a": 14.0}


def test_dynamo_finished_requests_release_their_blocks() -> None:
    policy = DynamoKvRouter()
    policy.on_dispatch(request("first", keys=range(10)), Placement("a"), 0.0)
    policy.on_finish("first", "a", 1.0)
    req = request(keys=range(10), tokens=0)
    assert policy.costs(req, [engine("a")]) == {"a": 10.0}


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(1, 40)),
                min_size=1, max_size=30), st.sampled_from([1, 20, 1024]))
def test_dynamo_new_blocks_match_a_key_by_key_count_over_chained_prompts(
        ops: list[tuple[bool, int, int]], long_blocks: int) -> None:
    """The bisections over the keys counted and the chains kept whole give what counting
    every key gives, while requests sharing prefixes of several lengths come and go (every
    request kept whole, short and long ones mixed, every one counted)."""
    active, live = _ActiveBlocks(long_blocks), []
    for add, family, length in ops:
        keys = chain_keys([family] * 16 + list(range(16 * length)), 16)
        if add or not live:
            active.add(keys)
            live.append(keys)
        else:
            active.remove(live.pop(length % len(live)))
        count = Counter(k for keys in live for k in keys)
        for probe_family in range(4):
            for probe_length in (3, 20, 45):
                probe = chain_keys([probe_family] * 16 + list(range(16 * probe_length)), 16)
                assert active.new_blocks(probe) == sum(1 for k in probe if k not in count)
        assert active.repeats == sum(count.values()) - len(count)


# -- every baseline ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", BASELINES)
def test_baseline_raises_no_engine_available_when_nothing_is_eligible(name: str) -> None:
    policy = make_policy(name)
    req = request(session="s", text=SYSTEM, keys=range(4))
    with pytest.raises(NoEngineAvailable, match="no engines"):
        policy.choose(req, [], 0.0)
    with pytest.raises(NoEngineAvailable, match="no engine is healthy"):
        policy.choose(req, [engine("a", healthy=False)], 0.0)
    other = EngineView(name="o", healthy=True, models=frozenset({"other"}))
    with pytest.raises(NoEngineAvailable, match="serves this model"):
        policy.choose(req, [other], 0.0)


@pytest.mark.parametrize("name", BASELINES)
def test_baseline_skips_unhealthy_engines(name: str) -> None:
    policy = make_policy(name)
    pool = [engine("a", healthy=False), engine("b"), engine("c", healthy=False)]
    for i in range(20):
        req = request(f"q{i}", session=f"s{i}", text=SYSTEM, keys=range(8),
                      matches={"a": hit("a", 8), "c": hit("c", 8)})
        assert route(policy, req, pool, float(i)) == "b"


def _workload(policy: RoutingPolicy) -> list[str]:
    pool = [engine("a", kv_usage=0.1), engine("b"), engine("c", waiting=1), engine("d")]
    choices = []
    for i in range(60):
        req = request(f"q{i}", session=f"s{i % 7}" if i % 3 else None,
                      text=SYSTEM[: 40 * (i % 5)] + str(i), keys=range(i % 6),
                      matches={"b": hit("b", i % 4)} if i % 2 else {})
        choices.append(route(policy, req, pool, float(i)))
        if i % 4 == 0:
            policy.on_first_token(f"q{i}", choices[-1], i + 0.5)
            policy.on_finish(f"q{i}", choices[-1], i + 0.5)
    return choices


@pytest.mark.parametrize("name", BASELINES)
def test_baseline_choices_are_determined_by_inputs_and_seed(name: str) -> None:
    first = _workload(make_policy(name, PolicyContext(seed=11)))
    second = _workload(make_policy(name, PolicyContext(seed=11)))
    assert first == second
