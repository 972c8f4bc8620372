"""The in-memory index's match gives what its definition says, whichever walk it takes inside."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.index import EngineMatch, InMemoryIndex

ENGINES = ["a", "b", "c", "d"]
KEYS = st.lists(st.integers(0, 11), max_size=12)
# Events name each block once as a rule (the index's fast paths), a block twice by exception.
EVENT_KEYS = st.one_of(st.lists(st.integers(0, 11), max_size=6, unique=True), KEYS)
OPS = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "speculate", "wait"]), st.sampled_from(ENGINES),
              EVENT_KEYS, st.sampled_from([0.3, 5.0, 100.0])),
    max_size=30,
)


class _Reference:
    """Confirmed copies and speculative expiries per engine, matched by the definition."""

    def __init__(self) -> None:
        self.copies: dict[str, Counter[int]] = {e: Counter() for e in ENGINES}
        self.spec: dict[str, dict[int, float]] = {e: {} for e in ENGINES}

    def add(self, engine: str, keys: list[int]) -> None:
        for k in keys:
            self.copies[engine][k] += 1
            self.spec[engine].pop(k, None)

    def remove(self, engine: str, keys: list[int]) -> None:
        for k in keys:
            self.spec[engine].pop(k, None)
            if self.copies[engine][k]:
                self.copies[engine][k] -= 1

    def speculate(self, engine: str, keys: list[int], expires: float) -> None:
        for k in keys:
            if not self.copies[engine][k]:
                self.spec[engine][k] = expires

    def match(self, keys: list[int], now: float, known: list[str]) -> dict[str, EngineMatch]:
        out = {}
        for e in known:
            def held(k: int, e: str = e) -> bool:
                return self.copies[e][k] > 0 or self.spec[e].get(k, 0.0) > now

            blocks = next((i for i, k in enumerate(keys) if not held(k)), len(keys))
            confirmed = next((i for i, k in enumerate(keys) if not self.copies[e][k]), len(keys))
            if blocks:
                out[e] = EngineMatch(e, blocks, confirmed, float(blocks))
        return out


@settings(max_examples=300, deadline=None)
@given(ops=OPS, query=KEYS)
def test_match_is_the_longest_run_of_confirmed_or_live_speculative_blocks(
    ops: list[tuple[str, str, list[int], float]], query: list[int]
) -> None:
    index, reference = InMemoryIndex(), _Reference()
    now = 0.0
    for op, engine, keys, ttl in ops:
        if op == "add":
            index.add_sync(engine, keys)
            reference.add(engine, keys)
        elif op == "remove":
            index.remove_sync(engine, keys)
            reference.remove(engine, keys)
        elif op == "speculate":
            index.add_speculative_sync(engine, keys, now, ttl)
            reference.speculate(engine, keys, now + ttl)
        else:
            now += ttl / 2
        assert index.match_sync(query, now) == reference.match(query, now, index.engines)
        # Every key alone, so an entry the query's run never reaches is checked too.
        for k in range(12):
            assert index.match_sync([k], now) == reference.match([k], now, index.engines)


def test_removing_a_block_from_one_engine_leaves_its_other_holders() -> None:
    index = InMemoryIndex()
    index.add_sync("a", [1, 2])
    index.add_sync("b", [1])
    index.remove_sync("a", [1, 2])
    assert set(index.match_sync([1, 2], 0.0)) == {"b"}
    index.add_sync("a", [1, 1])  # a second copy on the same engine
    index.remove_sync("a", [1])
    assert set(index.match_sync([1], 0.0)) == {"a", "b"}
