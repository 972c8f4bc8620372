"""`llmd-p2p-affinity-like` follows the arm llm-d's P2P guide deploys (precise prefix affinity with
speculative indexing, no-hit-lru, queue and kv-util, max-score, plus the P2P pull)."""

from __future__ import annotations

from collections.abc import Mapping

from kvindex.index import EngineMatch
from planner.policies.llmd_p2p_affinity_like import (
    LlmdP2PAffinityScheduler,
    held_run_tokens,
    weighted_match_blocks,
)
from planner.policy import EngineView, Placement, PolicyContext, RouteRequest, make_policy
from planner.transfer import NAMED_LINKS, Pull

MODEL = "m"
RDMA = PolicyContext(link=NAMED_LINKS["rdma"])


def engine(name: str, *, waiting: int = 0, kv_usage: float = 0.0) -> EngineView:
    return EngineView(name=name, healthy=True, models=frozenset({MODEL}), num_waiting=waiting,
                      kv_usage=kv_usage)


def held(tokens: int, *, confirmed: int | None = None, weight: float = 1.0) -> EngineMatch:
    """A leading run of `tokens` prompt tokens in the index's 16-token blocks, `confirmed` of
    them by the engine's own events (the rest speculative), each block in a tier of `weight`."""
    blocks = tokens // 16
    return EngineMatch(engine="", blocks=blocks,
                       confirmed_blocks=blocks if confirmed is None else confirmed // 16,
                       weighted_blocks=weight * blocks)


def request(runs: Mapping[str, EngineMatch], rid: str = "r",
            prompt_tokens: int = 8192) -> RouteRequest:
    return RouteRequest(request_id=rid, model=MODEL, prompt_tokens=prompt_tokens,
                        block_keys=tuple(range(prompt_tokens // 16)), block_size=16,
                        matches=dict(runs))


def test_registered_as_a_kv_moving_policy_with_speculative_entries() -> None:
    policy = make_policy("llmd-p2p-affinity-like", RDMA)
    assert isinstance(policy, LlmdP2PAffinityScheduler)
    assert policy.moves_kv is True and policy.speculative_entries is True
    assert policy.metrics_interval_s == 0.05


def test_prefix_score_is_the_weighted_run_over_the_prompts_64_token_blocks_not_min_max() -> None:
    # 8,192 tokens = 128 blocks of 64; a holds 2,048 (32 blocks), b 1,024 (16), c nothing.
    policy = LlmdP2PAffinityScheduler()
    pool = [engine("a"), engine("b"), engine("c")]
    scores = policy.scores(request({"a": held(2048), "b": held(1024)}), pool)
    # queue 2 x 1 + kv-util 2 x 1 + warm no-hit-lru 2 x 0.5 = 5, plus prefix 3 x run / 128.
    assert scores == {"a": 5 + 3 * 32 / 128, "b": 5 + 3 * 16 / 128, "c": 5.0}


def test_speculative_entries_count_as_held_and_cpu_blocks_weigh_0_8_truncated() -> None:
    req = request({})
    # 40 blocks of 16 = 10 of 64, 4 of them confirmed: the speculative rest counts in full.
    assert weighted_match_blocks(req, held(640, confirmed=256)) == 10
    # CPU tier: 10 x 0.8 = 8; 1 x 0.8 truncates to 0 (no match at all).
    assert weighted_match_blocks(req, held(640, weight=0.8)) == 8
    assert weighted_match_blocks(req, held(64, weight=0.8)) == 0
    # A partial 64-token block is not matched.
    assert weighted_match_blocks(req, held(48)) == 0


def test_traffic_stays_on_the_holder_until_its_queue_outweighs_the_prefix() -> None:
    policy = LlmdP2PAffinityScheduler()
    req = request({"a": held(8192)})  # a holds the whole prompt: prefix score 1 (3 points)
    assert policy.choose(req, [engine("a", waiting=2), engine("b")], 0.0) == Placement("a")
    # a's queue the longest (queue 0 vs 2) and its KV 60% full (0.8 vs 2): 3 + 0.8 + 1 = 4.8
    # against b's 0 + 2 + 2 + 1 = 5.
    assert policy.choose(req, [engine("a", waiting=2, kv_usage=0.6), engine("b")],
                         0.0) == Placement("b")


def test_cold_requests_spread_by_no_hit_lru_and_warm_ones_score_it_neutral() -> None:
    policy = LlmdP2PAffinityScheduler()
    pool = [engine("a"), engine("b"), engine("c")]
    seen = []
    for i in range(3):
        req = request({}, rid=f"cold{i}")
        placement = policy.choose(req, pool, 0.0)
        policy.on_dispatch(req, placement, 0.0)
        seen.append(placement.engine)
    assert seen == ["a", "b", "c"]  # never-used first, then least recently used
    assert list(policy.cold.order) == ["a", "b", "c"]
    warm = request({"a": held(1024)}, rid="warm")
    scores = policy.scores(warm, pool)
    assert scores["b"] == scores["c"] == 2 + 2 + 2 * 0.5
    policy.on_dispatch(warm, policy.choose(warm, pool, 0.0), 0.0)
    assert list(policy.cold.order) == ["a", "b", "c"]  # a warm request moves nothing


def test_pulls_when_a_peer_leads_the_chosen_engine_by_2048_tokens() -> None:
    policy = LlmdP2PAffinityScheduler(RDMA)
    # a holds 4,096 tokens but is full and backed up: b (no prefix) wins on load.
    pool = [engine("a", waiting=8, kv_usage=1.0), engine("b")]
    placement = policy.choose(request({"a": held(4096)}), pool, 0.0)
    assert placement == Placement("b", pull=Pull("a", 4096))


def test_the_destinations_speculative_run_counts_against_the_lead() -> None:
    policy = LlmdP2PAffinityScheduler(RDMA)
    pool = [engine("a", waiting=8, kv_usage=1.0), engine("b")]
    # b holds 2,560 tokens by a speculative entry only: a leads by 1,536 < 2,048, no pull.
    req = request({"a": held(4096), "b": held(2560, confirmed=0)})
    assert held_run_tokens(req, "b") == 2560
    assert policy.choose(req, pool, 0.0) == Placement("b")


def test_a_source_needs_confirmed_blocks_and_no_pull_without_a_link() -> None:
    pool = [engine("a", waiting=8, kv_usage=1.0), engine("b")]
    # a's run is only speculative: nothing to pull from.
    req = request({"a": held(4096, confirmed=0)})
    assert LlmdP2PAffinityScheduler(RDMA).choose(req, pool, 0.0) == Placement("b")
    assert LlmdP2PAffinityScheduler().choose(request({"a": held(4096)}), pool,
                                              0.0) == Placement("b")


def test_equal_totals_are_broken_at_random_not_by_pool_order() -> None:
    policy = LlmdP2PAffinityScheduler(PolicyContext(seed=3))
    req = request({"a": held(8192), "b": held(8192)})
    picks = {policy.choose(req, [engine("a"), engine("b")], 0.0).engine for _ in range(40)}
    assert picks == {"a", "b"}
