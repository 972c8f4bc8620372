"""One behavioural suite for every KV index backend (in-memory and Redis), plus a differential
property test that drives both side by side, and Redis-only tests for sharing across processes.

Redis tests run against a private redis-server started for this module (tests/redis_server.py),
each test in a fresh key namespace. Speculative expiry is checked with real sleeps and wall-clock
`now`, because the Redis backend expires on the server's clock and ignores the caller's `now`.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvindex.index as index_module
from kvindex.index import EngineMatch, IndexStats, InMemoryIndex, KVIndexBackend
from kvindex.redis_index import CHUNK, RedisIndex
from tests.redis_server import redis_server_available

needs_redis = pytest.mark.skipif(not redis_server_available(), reason="redis-server not installed")

LONG_TTL = 60.0


def now() -> float:
    return time.time()


def fresh_namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"



@pytest.fixture(params=["memory", pytest.param("redis", marks=needs_redis)])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[KVIndexBackend]:
    backend: KVIndexBackend
    if request.param == "memory":
        backend = InMemoryIndex()
    else:
        backend = RedisIndex.from_url(request.getfixturevalue("redis_url"), fresh_namespace())
    yield backend
    await backend.close()


def summary(matches: dict[str, EngineMatch]) -> dict[str, tuple[int, int, float]]:
    """Comparable form of a match result (weights rounded against float noise)."""
    return {e: (m.blocks, m.confirmed_blocks, round(m.weighted_blocks, 9))
            for e, m in matches.items()}


# -- longest prefix ---------------------------------------------------------------------------


async def test_add_then_match_gives_longest_consecutive_prefix_per_engine(
    index: KVIndexBackend,
) -> None:
    await index.add("a", [1, 2, 3, 4])
    await index.add("b", [1, 2])
    await index.add("c", [2, 3])  # holds later blocks but not the first: no prefix
    got = await index.match([1, 2, 3, 4, 5], now())
    assert summary(got) == {"a": (4, 4, 4.0), "b": (2, 2, 2.0)}
    assert got["a"] == EngineMatch(engine="a", blocks=4, confirmed_blocks=4, weighted_blocks=4.0)


async def test_a_gap_in_the_middle_stops_the_match(index: KVIndexBackend) -> None:
    await index.add("a", [1, 2, 4, 5])
    assert summary(await index.match([1, 2, 3, 4, 5], now())) == {"a": (2, 2, 2.0)}
    assert await index.match([3, 4, 5], now()) == {}


async def test_engines_filter_limits_the_result(index: KVIndexBackend) -> None:
    await index.add("a", [1, 2, 3])
    await index.add("b", [1, 2])
    keys = [1, 2, 3]
    assert summary(await index.match(keys, now(), ["b", "unknown"])) == {"b": (2, 2, 2.0)}
    assert summary(await index.match(keys, now(), iter(["a"]))) == {"a": (3, 3, 3.0)}
    assert await index.match(keys, now(), []) == {}
    assert await index.match([], now()) == {}


async def test_engine_names_may_contain_separators(index: KVIndexBackend) -> None:
    engine = "127.0.0.1:8101|dp0"
    await index.add(engine, [1, 2], "CPU")
    assert summary(await index.match([1, 2], now())) == {engine: (2, 2, 1.6)}
    assert await index.engine_keys(engine) == {1: {"CPU": 1}, 2: {"CPU": 1}}


# -- copy counts ------------------------------------------------------------------------------


async def test_a_key_stored_twice_must_be_removed_twice(index: KVIndexBackend) -> None:
    await index.add("a", [1, 2])
    await index.add("a", [1, 2])
    await index.remove("a", [1, 2])
    assert summary(await index.match([1, 2], now())) == {"a": (2, 2, 2.0)}
    assert await index.engine_keys("a") == {1: {"GPU": 1}, 2: {"GPU": 1}}
    await index.remove("a", [1, 2])
    assert await index.match([1, 2], now()) == {}
    assert await index.engine_keys("a") == {}
    stats = await index.stats()
    assert (stats.keys, stats.entries) == (0, 0)


async def test_duplicate_keys_in_one_call_count_as_copies(index: KVIndexBackend) -> None:
    await index.add("a", [7, 7])
    assert await index.engine_keys("a") == {7: {"GPU": 2}}
    await index.remove("a", [7])
    assert await index.engine_keys("a") == {7: {"GPU": 1}}


async def test_removing_unknown_keys_is_a_noop(index: KVIndexBackend) -> None:
    await index.remove("ghost", [1, 2])  # unknown engine
    await index.add("a", [1, 2])
    await index.remove("a", [3, 4])  # unknown keys
    await index.remove("a", [1], "CPU")  # held, but in another tier
    await index.remove("a", [])
    assert summary(await index.match([1, 2], now())) == {"a": (2, 2, 2.0)}
    assert await index.engine_keys("a") == {1: {"GPU": 1}, 2: {"GPU": 1}}
    assert await index.engine_keys("ghost") == {}
    stats = await index.stats()
    assert (stats.keys, stats.entries, stats.engines) == (2, 2, 1)


async def test_clear_engine_removes_only_that_engine(index: KVIndexBackend) -> None:
    await index.add("a", [1, 2, 3])
    await index.add("a", [1])  # a second copy
    await index.add("a", [4], "CPU")
    await index.add_speculative("a", [5], now(), LONG_TTL)
    await index.add("b", [1, 2])
    await index.add("b", [3], "CPU")
    await index.clear_engine("a")
    assert summary(await index.match([1, 2, 3, 4, 5], now())) == {"b": (3, 3, 2.8)}
    assert await index.engine_keys("a") == {}
    assert await index.engine_keys("b") == {1: {"GPU": 1}, 2: {"GPU": 1}, 3: {"CPU": 1}}
    assert await index.stats() == IndexStats(keys=3, entries=3, speculative_entries=0, engines=1)
    await index.clear_engine("never-seen")  # no-op
    # A cleared engine starts from nothing: one add is one copy.
    await index.add("a", [1])
    await index.remove("a", [1])
    assert summary(await index.match([1], now())) == {"b": (1, 1, 1.0)}


async def test_a_clear_in_slices_lets_other_engines_change_the_index_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-memory clear yields to the event loop between slices (it used to hold the loop
    # for 0.1 s on 2M keys): what other engines add and remove meanwhile must stand, and the
    # cleared engine's bit must not be handed out before its entries are gone.
    monkeypatch.setattr(index_module, "CLEAR_CHUNK", 3)
    index = InMemoryIndex()
    await index.add("a", list(range(20)))
    await index.add("b", list(range(10)))

    async def meanwhile() -> None:
        for k in range(20, 30):
            await index.add("c", [k])  # a new engine while a's bit is not yet free
            await index.remove("b", [k - 20])
            await asyncio.sleep(0)

    await asyncio.gather(index.clear_engine("a"), meanwhile())
    assert await index.engine_keys("a") == {}
    assert sorted(await index.engine_keys("c")) == list(range(20, 30))
    assert await index.engine_keys("b") == {}
    assert summary(await index.match(list(range(20)), now())) == {}
    await index.add("d", [0])  # a's bit, free again: nothing of a's comes with it
    assert summary(await index.match([0, 1], now())) == {"d": (1, 1, 1.0)}


# -- speculative entries ----------------------------------------------------------------------


async def test_speculative_entries_match_until_their_ttl_then_vanish(
    index: KVIndexBackend,
) -> None:
    await index.add_speculative("a", [1, 2], now(), 0.3)
    assert summary(await index.match([1, 2, 3], now())) == {"a": (2, 0, 2.0)}
    assert (await index.stats()).speculative_entries == 2
    await asyncio.sleep(0.5)
    assert await index.match([1, 2, 3], now()) == {}
    assert (await index.stats()).speculative_entries == 0


async def test_speculative_blocks_do_not_count_toward_confirmed_blocks(
    index: KVIndexBackend,
) -> None:
    await index.add("a", [1, 2])
    await index.add("a", [4], "CPU")
    await index.add_speculative("a", [3, 5], now(), LONG_TTL)
    got = summary(await index.match([1, 2, 3, 4, 5, 6], now()))
    # Blocks 1-5 held; the confirmed run stops at the speculative block 3; only block 4 (CPU)
    # costs weight, speculative blocks count as GPU.
    assert got == {"a": (5, 2, 4.8)}


async def test_a_confirmed_add_drops_the_speculative_entry(index: KVIndexBackend) -> None:
    await index.add_speculative("a", [1, 2], now(), LONG_TTL)
    await index.add("a", [1], "CPU")  # confirmation in any tier replaces the speculation
    await index.remove("a", [1], "CPU")
    assert await index.match([1, 2], now()) == {}
    assert (await index.stats()).speculative_entries == 1  # key 2 is still speculative


async def test_a_remove_drops_the_speculative_entry(index: KVIndexBackend) -> None:
    await index.add_speculative("a", [1, 2, 3], now(), LONG_TTL)
    await index.remove("a", [2])  # not held confirmed: only the speculation goes
    assert summary(await index.match([1, 2, 3], now())) == {"a": (1, 0, 1.0)}
    assert (await index.stats()).speculative_entries == 2


async def test_speculation_skips_keys_already_confirmed_in_gpu(index: KVIndexBackend) -> None:
    await index.add("a", [1])
    await index.add_speculative("a", [1, 2], now(), LONG_TTL)
    assert (await index.stats()).speculative_entries == 1
    await index.remove("a", [1])
    assert await index.match([1, 2], now()) == {}


@pytest.mark.parametrize("removed_between", [False, True])
def test_a_dispatch_right_after_its_match_speculates_exactly_what_is_not_held(
    removed_between: bool,
) -> None:
    """The in-memory index reuses a match's confirmed run for the speculative add of the same
    prompt only while no confirmed entry changed; a removal in between is seen."""
    index = InMemoryIndex()
    index.add_sync("a", [1, 2, 3, 4])
    prompt = (1, 2, 3, 4, 5, 6)
    assert index.match_sync(prompt, now())["a"].confirmed_blocks == 4
    if removed_between:
        index.remove_sync("a", [3, 4])
    index.add_speculative_sync("a", prompt, now(), LONG_TTL)
    assert index.stats_sync().speculative_entries == (4 if removed_between else 2)
    assert index.match_sync(prompt, now())["a"].blocks == 6


async def test_a_shorter_speculation_expires_even_after_a_longer_one(
    index: KVIndexBackend,
) -> None:
    await index.add_speculative("a", [1], now(), LONG_TTL)
    await index.add_speculative("a", [2], now(), 0.3)  # another key, after a longer entry
    await index.add_speculative("b", [1], now(), 0.3)  # the same key as a longer entry
    await index.add_speculative("c", [3], now(), LONG_TTL)
    await index.add_speculative("c", [3], now(), 0.3)  # speculating again shortens the entry
    await index.add_speculative("d", [4], now(), LONG_TTL)
    await index.add_speculative("d", [4], now(), 0)  # a zero TTL cancels it at once
    assert await index.match([4], now()) == {}
    await asyncio.sleep(0.5)
    assert await index.match([2], now()) == {}
    assert summary(await index.match([1], now())) == {"a": (1, 0, 1.0)}
    assert await index.match([3], now()) == {}


# -- tiers, engine_keys, stats ----------------------------------------------------------------


async def test_a_key_only_in_cpu_counts_with_cpu_weight(index: KVIndexBackend) -> None:
    await index.add("a", [1, 3])
    await index.add("a", [2, 3], "CPU")  # 3 is in both: it counts as GPU
    await index.add("a", [4], "disk")  # unknown tiers weigh like CPU
    await index.add("a", [5], "cpu")  # tier names are case-insensitive
    got = (await index.match([1, 2, 3, 4, 5], now()))["a"]
    assert (got.blocks, got.confirmed_blocks) == (5, 5)
    assert math.isclose(got.weighted_blocks, 1.0 + 0.8 + 1.0 + 0.8 + 0.8)


async def test_engine_keys_reports_copy_counts_per_tier(index: KVIndexBackend) -> None:
    await index.add("a", [1, 1, 2])
    await index.add("a", [1, 3], "CPU")
    await index.add("b", [1])
    assert await index.engine_keys("a") == {1: {"GPU": 2, "CPU": 1}, 2: {"GPU": 1},
                                             3: {"CPU": 1}}
    assert await index.engine_keys("b") == {1: {"GPU": 1}}


async def test_stats_counts_keys_entries_speculation_and_engines(index: KVIndexBackend) -> None:
    assert await index.stats() == IndexStats(keys=0, entries=0, speculative_entries=0, engines=0)
    await index.add("a", [1, 2])
    await index.add("a", [2], "CPU")
    await index.add("a", [2])  # a second copy is not a new entry
    await index.add("b", [2])
    await index.add_speculative("c", [9, 10], now(), LONG_TTL)
    assert await index.stats() == IndexStats(keys=2, entries=4, speculative_entries=2, engines=3)


async def test_large_key_lists_are_handled_in_batches(index: KVIndexBackend) -> None:
    keys = list(range(10**12, 10**12 + 2 * CHUNK + 500))
    await index.add("a", keys)
    await index.add_speculative("b", keys, now(), LONG_TTL)
    got = await index.match(keys, now())
    assert summary(got) == {"a": (len(keys), len(keys), float(len(keys))),
                            "b": (len(keys), 0, float(len(keys)))}
    await index.add("c", keys[::2], "CPU")
    await index.remove("a", keys)
    await index.clear_engine("b")
    await index.clear_engine("c")  # more than one chunk of entries
    assert await index.engine_keys("c") == {}
    assert await index.stats() == IndexStats(keys=0, entries=0, speculative_entries=0, engines=1)


# -- differential stateful test: both backends, same random operations ------------------------

ENGINES = ["e0", "127.0.0.1:8101"]  # few engines and keys, so operations collide often
N_KEYS = 6
FULL = list(range(N_KEYS))
QUERIES = [(FULL, None), (FULL, ["127.0.0.1:8101", "other"]), (FULL[1:], None), ([0, 2, 4], None)]

_engines = st.sampled_from(ENGINES)
_tiers = st.sampled_from(["GPU", "GPU", "CPU", "gpu", "disk"])


@st.composite
def _key_list(draw: st.DrawFn) -> list[int]:
    """Mostly a run of consecutive keys from the start (as prompts' chained blocks are),
    sometimes any list."""
    if draw(st.integers(0, 3)):
        start = draw(st.sampled_from([0, 0, 0, 1, 2]))
        return list(range(start, draw(st.integers(start, N_KEYS))))
    return draw(st.lists(st.integers(0, N_KEYS - 1), max_size=4))


async def _observe(index: KVIndexBackend) -> Any:
    matches = [summary(await index.match(q, now(), f)) for q, f in QUERIES]
    keys = [await index.engine_keys(e) for e in ENGINES]
    return matches, keys, await index.stats()


class BackendsAgree(RuleBasedStateMachine):
    """Every operation goes to an InMemoryIndex and a RedisIndex; after each, `match` (several
    prompts, with and without an engine filter), `engine_keys` and `stats` must agree."""

    url = ""
    added = Bundle("added")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.memory = InMemoryIndex()
        self.shared = RedisIndex.from_url(self.url, fresh_namespace())
        self.log: list[str] = []

    def _both(self, name: str, *args: Any) -> None:
        self.log.append(f"{name}{args}")

        async def run() -> None:
            for index in (self.memory, self.shared):
                await getattr(index, name)(*args)

        self.loop.run_until_complete(run())

    @rule(target=added, engine=_engines, keys=_key_list(), tier=_tiers)
    def add(self, engine: str, keys: list[int], tier: str) -> tuple[str, list[int], str]:
        self._both("add", engine, keys, tier)
        return engine, keys, tier

    @rule(target=added, entry=added)
    def add_again(self, entry: tuple[str, list[int], str]) -> tuple[str, list[int], str]:
        """Another physical copy of the same blocks (vLLM announces each one)."""
        self._both("add", *entry)
        return entry

    @rule(entry=added)
    def remove_added(self, entry: tuple[str, list[int], str]) -> None:
        self._both("remove", *entry)

    @rule(engine=_engines, keys=_key_list(), tier=_tiers)
    def remove_any(self, engine: str, keys: list[int], tier: str) -> None:
        self._both("remove", engine, keys, tier)

    @rule(engine=_engines, keys=_key_list())
    def speculate(self, engine: str, keys: list[int]) -> None:
        self._both("add_speculative", engine, keys, now(), LONG_TTL)

    @rule(entry=added)
    def speculate_on_added(self, entry: tuple[str, list[int], str]) -> None:
        self._both("add_speculative", entry[0], entry[1], now(), LONG_TTL)

    @rule(engine=_engines, keys=_key_list(), gone=_key_list(), between=st.booleans())
    def match_then_speculate(self, engine: str, keys: list[int], gone: list[int],
                             between: bool) -> None:
        """A dispatch: the prompt's keys (one tuple) matched, then speculated on the chosen
        engine, with or without confirmed entries removed in between (the in-memory index
        reuses the match's confirmed runs only while nothing changed)."""
        prompt = tuple(keys)
        self._both("match", prompt, now())
        if between:
            self._both("remove", engine, gone, "GPU")
        self._both("add_speculative", engine, prompt, now(), LONG_TTL)

    @rule(engine=_engines)
    def clear(self, engine: str) -> None:
        self._both("clear_engine", engine)

    @invariant()
    def backends_agree(self) -> None:
        expected = self.loop.run_until_complete(_observe(self.memory))
        got = self.loop.run_until_complete(_observe(self.shared))
        assert got == expected, f"after {self.log}"

    def teardown(self) -> None:
        self.loop.run_until_complete(self.shared.close())
        self.loop.close()


@needs_redis
def test_backends_agree_on_random_operation_sequences(redis_url: str) -> None:
    BackendsAgree.url = redis_url
    run_state_machine_as_test(BackendsAgree, settings=settings(
        max_examples=40, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# -- Redis only: several gateway processes share one index ------------------------------------


@needs_redis
async def test_two_gateway_processes_share_one_redis_index(redis_url: str) -> None:
    ns = fresh_namespace()
    first, second = RedisIndex.from_url(redis_url, ns), RedisIndex.from_url(redis_url, ns)
    try:
        await first.add("a", [1, 2, 3])
        assert summary(await second.match([1, 2, 3], now())) == {"a": (3, 3, 3.0)}
        await second.add("a", [1])  # a second copy, announced through the other process
        await first.remove("a", [1])
        assert (await second.engine_keys("a"))[1] == {"GPU": 1}
        await second.add_speculative("b", [1, 2], now(), LONG_TTL)
        assert summary(await first.match([1, 2, 3], now())) == {"a": (3, 3, 3.0),
                                                                "b": (2, 0, 2.0)}
        await first.clear_engine("a")
        assert summary(await second.match([1, 2, 3], now())) == {"b": (2, 0, 2.0)}
        assert (await first.stats()) == (await second.stats())
    finally:
        await first.close()
        await second.close()


@needs_redis
async def test_concurrent_writers_leave_no_negative_count_or_dangling_entry(
    redis_url: str,
) -> None:
    ns = fresh_namespace()
    writers = [RedisIndex.from_url(redis_url, ns) for _ in range(2)]
    keys = list(range(40))

    async def churn(index: RedisIndex, engine: str, offset: int) -> None:
        for i in range(15):
            chunk = keys[(offset + i) % 20:(offset + i) % 20 + 20]
            await index.add(engine, chunk)
            await index.remove(engine, chunk[::-1])
            await index.remove(engine, [k + 1000 for k in chunk])  # never added: no-op

    try:
        await asyncio.gather(*(churn(writers[j % 2], f"e{j % 3}", j) for j in range(12)),
                             writers[1].add_speculative("e0", keys, now(), LONG_TTL))
        # Everything added was removed again; the speculation may or may not have survived.
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            left = [str(k) for k in await client.keys(f"{ns}:*")]
            assert not [k for k in left if k.startswith((f"{ns}:b:", f"{ns}:e:"))]
            counters = await client.hgetall(f"{ns}:stats")
            assert {k: int(v) for k, v in counters.items()} == {"keys": 0, "entries": 0}
        finally:
            await client.aclose()
        for e in ("e0", "e1", "e2"):
            assert await writers[0].engine_keys(e) == {}
        stats = await writers[0].stats()
        assert (stats.keys, stats.entries, stats.engines) == (0, 0, 3)
    finally:
        for w in writers:
            await w.close()


@needs_redis
async def test_expired_speculation_leaves_no_redis_keys_behind(redis_url: str) -> None:
    ns = fresh_namespace()
    index = RedisIndex.from_url(redis_url, ns)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await index.add_speculative("a", [1, 2], now(), 0.2)
        await index.add_speculative("b", [2, 3], now(), 0.3)
        assert {str(k) for k in await client.keys(f"{ns}:s*")} == {
            f"{ns}:s:1", f"{ns}:s:2", f"{ns}:s:3", f"{ns}:se:a", f"{ns}:se:b"}
        await asyncio.sleep(0.5)
        assert {str(k) for k in await client.keys(f"{ns}:*")} == {f"{ns}:engines"}
    finally:
        await client.aclose()
        await index.close()


@needs_redis
async def test_redis_index_accepts_a_client_that_returns_bytes(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)  # decode_responses=False
    index = RedisIndex(client, fresh_namespace())
    try:
        await index.add("a", [1, 2], "CPU")
        await index.add_speculative("b", [1], now(), LONG_TTL)
        assert summary(await index.match([1, 2], now())) == {"a": (2, 2, 1.6), "b": (1, 0, 1.0)}
        assert await index.engine_keys("a") == {1: {"CPU": 1}, 2: {"CPU": 1}}
        await index.close()  # not owned: the client stays usable
        assert await client.ping()
    finally:
        await client.aclose()
