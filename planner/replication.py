"""Replication of hot static segments: keep as many copies as their share of demand needs.

Every admitted call whose prompt starts with a static segment (system prompt, tools) of at
least `MIN_BLOCKS` blocks counts as demand for that segment. Over the last `WINDOW_S` seconds,
a segment asked for by a share `s` of all such calls should be held by `s x engines` engines
(rounded to the nearest, at least one): a segment every call needs is everywhere, an agent
type's prompt among four is on a quarter of the pool. When fewer engines hold it (by their own
KV events, or by a copy in flight), the planner copies it from the least loaded holder to the
least loaded engine that lacks it. Transient segments are never replicated; a segment whose
demand falls is simply no longer maintained and the engines' LRU reclaims its copies.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvindex.index import BlockKey

WINDOW_S = 30.0
MIN_BLOCKS = 32
"""Static segments shorter than this (512 tokens at the default block size) are cheaper to
recompute than to track."""

MIN_CALLS = 8
"""Calls seen in the window before shares are trusted (the first call of a segment is not
"all of the demand")."""


@dataclass
class _Segment:
    keys: tuple[BlockKey, ...]
    seen: deque[float] = field(default_factory=deque)


class StaticDemand:
    """Calls per static segment over a sliding window."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._segments: dict[BlockKey, _Segment] = {}
        self._total = 0

    def observe(self, keys: tuple[BlockKey, ...], now: float) -> None:
        """A call whose prompt starts with the static segment `keys` was admitted."""
        seg = self._segments.get(keys[-1])
        if seg is None:
            seg = self._segments[keys[-1]] = _Segment(keys)
        seg.seen.append(now)
        self._total += 1
        self._trim(now)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        for key in list(self._segments):
            seen = self._segments[key].seen
            while seen and seen[0] < horizon:
                seen.popleft()
                self._total -= 1
            if not seen:
                del self._segments[key]

    def replicas(self, keys: tuple[BlockKey, ...], engines: int, now: float) -> int:
        """How many engines should hold the segment now."""
        self._trim(now)
        seg = self._segments.get(keys[-1]) if keys else None
        if seg is None or self._total <= 0 or engines <= 0:
            return 0
        if self._total < MIN_CALLS:
            return 1
        # Nearest, not up: a share a hair over a half is half the pool, not three quarters.
        return max(1, min(engines, math.floor(len(seg.seen) / self._total * engines + 0.5)))
