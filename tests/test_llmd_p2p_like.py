"""`llmd-p2p-like` follows llm-d's P2P guide (load arm) and the p2p-source-producer's rule."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest

from kvindex.index import EngineMatch
from planner.policies.llmd_p2p_like import LlmdP2PScheduler, request_spread_fraction
from planner.policy import (
    EngineView,
    Placement,
    PolicyContext,
    RouteRequest,
    make_policy,
    reads_index,
)
from planner.transfer import NAMED_LINKS, Pull

MODEL = "m"
RDMA = PolicyContext(link=NAMED_LINKS["rdma"])


def engine(name: str, *, waiting: int = 0, kv_usage: float = 0.0) -> EngineView:
    return EngineView(name=name, healthy=True, models=frozenset({MODEL}), num_waiting=waiting,
                      kv_usage=kv_usage)


def busy(name: str, *, waiting: int = 8) -> EngineView:
    """An engine the placement never picks (full KV, the longest queue: total score 0)."""
    return engine(name, waiting=waiting, kv_usage=1.0)


def held(tokens: int, *, confirmed: int | None = None) -> EngineMatch:
    """A leading run of `tokens` prompt tokens in the index's 16-token blocks."""
    blocks = tokens // 16
    return EngineMatch(engine="", blocks=blocks,
                       confirmed_blocks=blocks if confirmed is None else confirmed // 16,
                       weighted_blocks=float(blocks))


def request(runs: Mapping[str, int], rid: str = "r", prompt_tokens: int = 16384) -> RouteRequest:
    return RouteRequest(request_id=rid, model=MODEL, prompt_tokens=prompt_tokens,
                        block_keys=tuple(range(prompt_tokens // 16)), block_size=16,
                        matches={name: held(tokens) for name, tokens in runs.items()})


def test_registered_as_a_kv_moving_policy_without_speculative_entries() -> None:
    policy = make_policy("llmd-p2p-like", RDMA)
    assert isinstance(policy, LlmdP2PScheduler)
    assert policy.moves_kv is True
    assert policy.speculative_entries is False


def test_pulls_when_a_peer_leads_the_chosen_engine_by_2048_tokens() -> None:
    policy = LlmdP2PScheduler(RDMA)
    pool = [busy("a"), engine("b")]
    placement = policy.choose(request({"a": 4096, "b": 2048}), pool, 0.0)
    assert placement == Placement("b", pull=Pull("a", 4096))


def test_no_pull_when_the_peer_leads_by_less_than_2048_tokens() -> None:
    policy = LlmdP2PScheduler(RDMA)
    pool = [busy("a"), engine("b")]
    placement = policy.choose(request({"a": 4096, "b": 2048 + 64}), pool, 0.0)
    assert placement == Placement("b")


def test_the_pull_carries_the_sources_confirmed_run_in_whole_64_token_blocks() -> None:
    policy = LlmdP2PScheduler(RDMA)
    pool = [busy("a"), engine("b")]
    req = RouteRequest(request_id="r", model=MODEL, prompt_tokens=8192,
                       block_keys=tuple(range(512)), block_size=16,
                       matches={"a": held(5000, confirmed=3000)})
    assert policy.choose(req, pool, 0.0).pull == Pull("a", 2944)


def test_no_pull_without_a_transfer_link() -> None:
    policy = LlmdP2PScheduler(PolicyContext())
    pool = [busy("a"), engine("b")]
    assert policy.choose(request({"a": 8192}), pool, 0.0) == Placement("b")


def test_reads_the_kv_index_only_with_a_transfer_link() -> None:
    """Only the pull reads the index; without a link a driver may skip matching and ingesting
    (tests/test_bench.py checks that the reports agree either way)."""
    assert reads_index(LlmdP2PScheduler(RDMA))
    assert not reads_index(LlmdP2PScheduler(PolicyContext()))


def test_the_source_is_sampled_by_request_among_holders_within_a_block_of_the_best() -> None:
    policy = LlmdP2PScheduler(RDMA)
    # c is the destination; a holds the longest run, b one block less, d two blocks less.
    pool = [busy("a"), busy("b"), engine("c"), busy("d")]
    runs = {"a": 8192, "b": 8192 - 64, "d": 8192 - 128}
    sources: Counter[str] = Counter()
    for i in range(400):
        pull = policy.choose(request(runs, rid=f"req-{i}"), pool, 0.0).pull
        assert pull is not None
        sources[pull.source] += 1
    assert set(sources) == {"a", "b"}


def test_source_weights_are_one_over_one_plus_waiting() -> None:
    policy = LlmdP2PScheduler(RDMA)
    # Equal runs; a waits 0 (weight 1), b waits 3 (weight 1/4): a is sampled 80% of the time.
    pool = [engine("a", waiting=0), engine("b", waiting=3)]
    runs = {"a": 8192, "b": 8192}
    for i in range(500):
        rid = f"req-{i}"
        expected = "a" if request_spread_fraction(rid) < 0.8 else "b"
        assert policy.source(request(runs, rid=rid), pool) == (expected, 8192)


def test_the_source_sample_is_fixed_per_request_id() -> None:
    pool = [busy("a"), busy("b"), engine("c")]
    req = request({"a": 8192, "b": 8192}, rid="fixed")
    first = LlmdP2PScheduler(PolicyContext(link=NAMED_LINKS["rdma"], seed=1))
    second = LlmdP2PScheduler(PolicyContext(link=NAMED_LINKS["rdma"], seed=2))
    expected = "a" if request_spread_fraction("fixed") < 0.5 else "b"
    assert first.choose(req, pool, 0.0).pull == Pull(expected, 8192)
    assert second.choose(req, pool, 0.0).pull == Pull(expected, 8192)


def test_request_spread_fraction_is_fnv1a_32_over_2_to_the_32() -> None:
    # FNV-1a-32 test vectors: "" -> 0x811c9dc5, "a" -> 0xe40c292c.
    assert request_spread_fraction("") == 0x811C9DC5 / 2**32
    assert request_spread_fraction("a") == 0xE40C292C / 2**32


def test_a_sampled_source_that_is_the_destination_pulls_nothing() -> None:
    policy = LlmdP2PScheduler(RDMA)
    # b is the only holder and the only engine placement can pick.
    assert policy.choose(request({"b": 8192}), [busy("a"), engine("b")], 0.0) == Placement("b")


def test_placement_draws_engines_in_proportion_to_queue_3_plus_kv_utilisation_2() -> None:
    policy = LlmdP2PScheduler(RDMA)
    # a: queue 1.0 x 3 + (1 - 0) x 2 = 5; b: queue 0 x 3 + (1 - 0.5) x 2 = 1.
    pool = [engine("a", waiting=0), engine("b", waiting=6, kv_usage=0.5)]
    picks = Counter(policy.choose(request({}, rid=f"q{i}"), pool, 0.0).engine
                    for i in range(3000))
    assert picks["b"] / 3000 == pytest.approx(1 / 6, abs=0.03)


def test_placement_ignores_which_engine_holds_the_prefix() -> None:
    policy = LlmdP2PScheduler(PolicyContext())
    pool = [engine("a"), engine("b")]
    picks = Counter(policy.choose(request({"a": 16384 - 64}, rid=f"q{i}"), pool, 0.0).engine
                    for i in range(2000))
    assert picks["a"] / 2000 == pytest.approx(0.5, abs=0.05)


def test_placement_is_uniform_when_every_total_is_zero() -> None:
    policy = LlmdP2PScheduler(PolicyContext())
    pool = [busy("a"), busy("b")]
    picks = Counter(policy.choose(request({}), pool, 0.0).engine for _ in range(2000))
    assert picks["a"] / 2000 == pytest.approx(0.5, abs=0.05)


def test_placement_randomness_follows_the_context_seed() -> None:
    pool = [engine("a"), engine("b"), engine("c")]

    def run(seed: int) -> list[str]:
        policy = LlmdP2PScheduler(PolicyContext(seed=seed))
        return [policy.choose(request({}), pool, 0.0).engine for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)
