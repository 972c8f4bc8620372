"""Segment tagging: block ranges by kind, and the planner's rules in both drivers."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.bench.options import BenchOptions
from kvgate.bench.runner import prepare
from kvgate.bench.virtual import VirtualRun
from planner.core import Call, make_planner
from planner.events import EngineJoined
from planner.hints import RequestHints
from planner.policy import PolicyContext, RouteRequest
from planner.segments import (
    KINDS,
    SegmentKind,
    SegmentRange,
    Segments,
    common_prefix,
    from_token_runs,
    tag_blocks,
)

runs = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 200)), max_size=12)


@given(runs, st.integers(1, 64))
def test_ranges_cover_every_full_block_once_in_order(r: list[tuple[SegmentKind, int]],
                                                     block: int) -> None:
    seg = from_token_runs(r, block)
    total = sum(n for _, n in r)
    assert seg.num_blocks == total // block
    position = 0
    for rng in seg.ranges:
        assert rng.start == position and rng.end > rng.start
        position = rng.end
    assert sum(seg.blocks_of(k) for k in KINDS) == seg.num_blocks
    for a, b in zip(seg.ranges, seg.ranges[1:], strict=False):
        assert a.kind != b.kind  # neighbours of one kind are merged


@given(runs, st.integers(1, 64))
def test_a_block_takes_the_kind_of_its_last_token(r: list[tuple[SegmentKind, int]],
                                                  block: int) -> None:
    seg = from_token_runs(r, block)
    kind_of_token: list[SegmentKind] = [k for k, n in r for _ in range(n)]
    for b in range(seg.num_blocks):
        assert seg.kind_of(b) == kind_of_token[(b + 1) * block - 1]


def test_rule_based_tagging_and_shared_prefixes() -> None:
    seg = tag_blocks(20, static_blocks=4, context_blocks=12, context_shared=True)
    assert [(r.kind, r.start, r.end) for r in seg.ranges] == [
        ("static", 0, 4), ("shared", 4, 12), ("transient", 12, 20)]
    alone = tag_blocks(20, 4, 12, context_shared=False)
    assert (alone.blocks_of("shared"), alone.blocks_of("transient")) == (0, 16)
    short = tag_blocks(3, 10, 10, True)  # a prompt shorter than its static prefix
    assert [(r.kind, r.start, r.end) for r in short.ranges] == [("static", 0, 3)]
    assert tag_blocks(0, 4, 4, True) == Segments(())
    assert common_prefix((1, 2, 3, 9), (1, 2, 3, 4, 5)) == 3
    with pytest.raises(ValueError):
        from_token_runs([("static", 5)], 0)


def test_common_prefix_finds_the_first_difference_anywhere() -> None:
    """The sliced bisection agrees with a walk element by element, wherever the sequences
    part (at the start, at a bisection point, in the last linear stretch, nowhere), for
    tuples, lists and a mix of the two."""
    rng = random.Random(7)

    def walk(a: Sequence[int], b: Sequence[int]) -> int:
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    for n in (0, 1, 31, 32, 33, 64, 1000, 8191):
        base = [rng.randrange(1 << 62) for _ in range(n)]
        for cut in {0, n // 2, max(0, n - 1), n, 17 % max(n, 1), rng.randrange(n + 1)}:
            other = base[:cut] + [rng.randrange(1 << 62) for _ in range(n - cut + 3)]
            if cut < n:
                other[cut] = base[cut] + 1
            for a, b in ((tuple(base), tuple(other)), (base, other), (tuple(base), other),
                         (tuple(other), tuple(base[:n - 5]))):
                assert common_prefix(a, b) == walk(a, b)


def test_the_planner_tags_hinted_calls_from_their_parents() -> None:
    p = make_planner("kvgate-routing-only", PolicyContext())
    p.on_event(EngineJoined("e", healthy=True, models=frozenset({"m"})), 0.0)
    parent = tuple(range(10))

    def call(rid: str, keys: tuple[int, ...], task: str, after: tuple[str, ...] = (),
             expect: int | None = None) -> Call:
        return Call(RouteRequest(rid, "m", prompt_tokens=16 * len(keys) + 5, block_keys=keys),
                    hints=RequestHints(workflow="w", task=task, after=after,
                                       expect_children=expect), static_blocks=3)

    p.admit(call("p", parent, "plan", expect=2), 0.0)
    p.admit(call("c0", (*parent, 100, 101), "c0", ("plan",)), 0.0)
    seg = p.segments_of("c0")
    assert seg is not None
    assert [(r.kind, r.end) for r in seg.ranges] == [
        ("static", 3), ("shared", 10), ("transient", 12)]
    # Without the expectation, a single child's context is its own until a sibling shows up.
    p.admit(call("q", parent, "solo"), 0.0)
    p.admit(call("s0", (*parent, 7), "s0", ("solo",)), 0.0)
    assert p.segments_of("s0").blocks_of("shared") == 0  # type: ignore[union-attr]
    p.admit(call("s1", (*parent, 8), "s1", ("solo",)), 0.0)
    assert p.segments_of("s1").blocks_of("shared") == 7  # type: ignore[union-attr]
    actions = {a.request_id: a for a in p.release(0.0)}
    assert actions["c0"].segments == seg  # the Dispatch carries them to the driver


def test_the_benchmark_tags_its_calls_by_the_planners_rules_as_the_gateway_does() -> None:
    """One tagging path: the virtual driver tells the planner what a live gateway knows of a
    call (its static lead, its workflow's DAG) and the planner tags the rest. (The driver
    used to tag calls itself from the spec's kinds: the plan's prompt, its question marked
    transient there, had no shared blocks in the benchmark and had them at the gateway, so
    only the gateway copied it ahead for its researchers.)"""
    o = BenchOptions(workload="fanout", workflows=1, link="rdma", progress=False)
    prepared = prepare(o)
    wf = prepared.workflows[0]
    builder = prepared.builder
    plan = wf.task("plan")
    # The static lead: the template's framing and the 4,000-token system prompt, in full
    # blocks; the question (200 tokens) is not in it.
    static = builder.static_blocks(plan, builder.pieces(wf, plan), 16)
    assert 4000 // 16 <= static <= (builder.prompt_tokens(wf, plan) - 200) // 16
    run = VirtualRun("kvgate", prepared.workflows, prepared.load, o.engine_profile(), o.engines,
                     builder, link=o.transfer_link())
    tagged: dict[str, Segments] = {}
    admit = run.planner.admit

    def keep(call: Call, now: float) -> None:
        admit(call, now)
        seg = run.planner.segments_of(call.route.request_id)
        assert seg is not None
        tagged[call.hints.task or ""] = seg

    run.planner.admit = keep  # type: ignore[method-assign]
    run.run()
    assert tagged["plan"].ranges[0] == SegmentRange("static", 0, static)
    assert tagged["plan"].blocks_of("shared") > 0  # the context its researchers extend
    kinds = [r.kind for r in tagged["research0"].ranges]
    assert kinds == ["static", "shared", "transient"]
    assert run.planner.moves.stats.started.get("transfer:prefetch", 0) > 0
