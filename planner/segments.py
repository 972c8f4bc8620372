"""Segment tagging: which blocks of a prompt are static, shared or transient (sans-IO).

- **static**: system messages and tool definitions — long-lived, shared across tasks and
  workflows (replicate when hot, keep longest);
- **shared**: a parent's context that several children extend (keep while the children run);
- **transient**: one branch's own reasoning and tool output (evict first, never replicate).

Explicit kinds (a workflow spec's segments) win over these rules. A request carries its
segments to the planner as block ranges at the index block size, so later stages (priorities,
replication, retention) can act per segment. A block is tagged by where it ends: a block that
straddles two kinds takes the later one's, so a "static" block is static all through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

SegmentKind = Literal["static", "shared", "transient"]
KINDS: tuple[SegmentKind, ...] = ("static", "shared", "transient")


@dataclass(frozen=True)
class SegmentRange:
    """Blocks `[start, end)` of the prompt, all of one kind."""

    kind: SegmentKind
    start: int
    end: int

    @property
    def blocks(self) -> int:
        """How many blocks."""
        return self.end - self.start


@dataclass(frozen=True)
class Segments:
    """A prompt's blocks as consecutive ranges, in order, covering every full block once."""

    ranges: tuple[SegmentRange, ...] = ()

    def blocks_of(self, kind: SegmentKind) -> int:
        """Blocks of this kind."""
        return sum(r.blocks for r in self.ranges if r.kind == kind)

    def kind_of(self, block: int) -> SegmentKind | None:
        """The kind of block `block` (None past the last full block)."""
        for r in self.ranges:
            if r.start <= block < r.end:
                return r.kind
        return None

    @property
    def num_blocks(self) -> int:
        """Full blocks covered."""
        return self.ranges[-1].end if self.ranges else 0

    def lasting_prefix(self) -> int:
        """Leading blocks before the first transient one: the static and shared context that
        other calls reuse (what KV movement may copy; transient blocks never move)."""
        end = 0
        for r in self.ranges:
            if r.kind == "transient":
                break
            end = r.end
        return end


NO_SEGMENTS = Segments()


def from_token_runs(runs: Sequence[tuple[SegmentKind, int]], block_size: int) -> Segments:
    """Segments from consecutive runs of tokens, each `(kind, tokens)`, at `block_size`.

    Only full blocks are tagged (a partial last block is never cached); a block takes the kind
    of the run its last token belongs to.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    ranges: list[SegmentRange] = []
    end_tokens = 0
    start = 0
    for kind, tokens in runs:
        if tokens < 0:
            raise ValueError("a run cannot have a negative length")
        end_tokens += tokens
        # Blocks whose last token falls in this run: up to the last full block it completes.
        end = end_tokens // block_size
        if end <= start:
            continue
        if ranges and ranges[-1].kind == kind:
            ranges[-1] = SegmentRange(kind, ranges[-1].start, end)
        else:
            ranges.append(SegmentRange(kind, start, end))
        start = end
    return Segments(tuple(ranges))


def tag_blocks(num_blocks: int, static_blocks: int, context_blocks: int,
               context_shared: bool) -> Segments:
    """The rule-based tagging of a call: its first `static_blocks` are static (system messages,
    tools); up to `context_blocks` it extends its parent's context, shared when several
    children extend it (else transient: only this branch reads it); the rest is its own."""
    static = max(0, min(static_blocks, num_blocks))
    context = max(static, min(context_blocks, num_blocks))
    runs: list[tuple[SegmentKind, int]] = [
        ("static", static), ("shared" if context_shared else "transient", context - static),
        ("transient", num_blocks - context)]
    return from_token_runs(runs, 1)


SYSTEM_ROLES = frozenset({"system", "developer"})
"""Roles whose messages (with the tool definitions) make a prompt's static segment."""


def static_lead(messages: Sequence[object]) -> list[dict[str, Any]]:
    """The leading system messages of an OpenAI `messages` list: with the tools, the static
    segment a chat template renders first."""
    lead: list[dict[str, Any]] = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and m["role"] in SYSTEM_ROLES):
            break
        lead.append(m)
    return lead


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """Leading elements `a` and `b` share (chained block keys: the shared prefix in blocks).

    Two tuples (or two lists) are compared a slice at a time, bisecting towards the first
    difference: a long context's keys (thousands per call) cost a few comparisons made in C
    instead of one interpreted step per block. Anything else is walked element by element."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    if n > _LINEAR_SCAN and type(a) is type(b) and isinstance(a, tuple | list):
        if a[0] != b[0]:
            return 0
        if a[:n] == b[:n]:
            return n
        # a[:lo] == b[:lo], and they differ somewhere before hi.
        while hi - lo > _LINEAR_SCAN:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


_LINEAR_SCAN = 32
"""Below this many candidates the first difference is found element by element."""
