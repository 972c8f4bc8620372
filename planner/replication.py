"""Replication of hot static segments: keep as many copies as their share of demand needs.

Every admitted call whose prompt starts with a static segment (system prompt, tools) of at
least `MIN_BLOCKS` blocks counts as demand for that segment, and so does every task still to
run of a workflow whose DAG the planner knows (`WorkflowSubmitted`: each task names its static
segment), from the moment the workflow is submitted until the task's call is admitted or the
workflow ends: the demand a DAG announces ahead. Over the last `WINDOW_S` seconds plus what
is announced, a segment asked for by a share `s` of all such calls should be held by
`s x engines` engines (rounded to the nearest, at least one): a segment every call needs is
everywhere, an agent type's prompt among four is on a quarter of the pool. When fewer engines
hold it (by their own KV events, or by a copy in flight), the planner copies it from the least
loaded holder to the least loaded engine that lacks it. Transient segments are never
replicated; a segment whose demand falls is simply no longer maintained and the engines' LRU
reclaims its copies.
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
    """Calls per static segment over a sliding window, plus the calls submitted DAGs announce."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._segments: dict[BlockKey, _Segment] = {}
        self._total = 0
        self._expected: dict[str, dict[str, int]] = {}
        """Per segment name, per workflow: its tasks not yet admitted."""
        self._expected_total = 0
        self._name_of: dict[BlockKey, str] = {}
        """A segment's last block key -> its name, once a call of it showed its keys; kept
        while the segment has calls in the window or announced (it grew by every distinct
        static prompt a gateway ever saw)."""

    def expect(self, workflow: str, segments: dict[str, int]) -> None:
        """A submitted workflow will send `segments[name]` calls opening with static segment
        `name` (a driver's name for its content: equal content, equal name)."""
        for name, calls in segments.items():
            if calls <= 0:
                continue
            per_wf = self._expected.setdefault(name, {})
            self._expected_total += calls - per_wf.get(workflow, 0)
            per_wf[workflow] = calls

    def admitted(self, workflow: str, name: str, keys: tuple[BlockKey, ...]) -> None:
        """One of `workflow`'s announced calls of segment `name` (whose blocks are `keys`)
        was admitted: it is no longer ahead (`observe` counts it from now on)."""
        if keys:
            self._name_of[keys[-1]] = name
        per_wf = self._expected.get(name)
        if per_wf is None or workflow not in per_wf:
            return
        per_wf[workflow] -= 1
        self._expected_total -= 1
        if per_wf[workflow] <= 0:
            del per_wf[workflow]
            if not per_wf:
                del self._expected[name]

    def forget(self, workflow: str) -> None:
        """The workflow ended: what it announced and did not send is no demand."""
        gone = set()
        for name in list(self._expected):
            per_wf = self._expected[name]
            calls = per_wf.pop(workflow, 0)
            self._expected_total -= calls
            if not per_wf:
                del self._expected[name]
                gone.add(name)
        if gone:
            for key in [k for k, n in self._name_of.items()
                        if n in gone and k not in self._segments]:
                del self._name_of[key]

    def expected(self, keys: tuple[BlockKey, ...]) -> int:
        """Calls of the segment `keys` that submitted workflows have yet to send."""
        name = self._name_of.get(keys[-1]) if keys else None
        per_wf = self._expected.get(name) if name is not None else None
        return sum(per_wf.values()) if per_wf else 0

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
                if self._name_of.get(key) not in self._expected:
                    self._name_of.pop(key, None)

    def replicas(self, keys: tuple[BlockKey, ...], engines: int, now: float) -> int:
        """How many engines should hold the segment now."""
        self._trim(now)
        seg = self._segments.get(keys[-1]) if keys else None
        total = self._total + self._expected_total
        if seg is None or total <= 0 or engines <= 0:
            return 0
        if total < MIN_CALLS:
            return 1
        demand = len(seg.seen) + self.expected(keys)
        # Nearest, not up: a share a hair over a half is half the pool, not three quarters.
        return max(1, min(engines, math.floor(demand / total * engines + 0.5)))
