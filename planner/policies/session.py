"""`session`: vLLM production-stack's session router, a consistent hash ring keyed by session.

Peer rule (production-stack `SessionRouter` and `RoutingInterface._qps_routing` in
`src/vllm_router/routers/routing_logic.py`, read at main 008a23b, 2026-11-27): the ring holds
the engines currently eligible; a request with a session id goes to the ring node owning the
id's hash, so a session sticks to one engine and an engine joining or leaving moves only ~1/N
of the sessions. A request without a session id goes to the engine with the lowest QPS over
the router's request-stats window (`--request-stats-window`, default 60 s), an engine that
never received a request first. The peer's ring is `uhashring.HashRing` (160 virtual nodes
per engine); here the same shape with xxh64 points, so placement is stable across processes
and runs.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

import xxhash

from planner.policy import EngineView, Placement, PolicyContext, RouteRequest, candidates, register

VIRTUAL_NODES = 160
"""Ring points per engine (uhashring's default)."""
QPS_WINDOW_S = 60.0
"""production-stack's default request-stats window."""


def _point(label: str) -> int:
    return xxhash.xxh64_intdigest(label.encode())


class _HashRing:
    """Consistent hash ring over engine names with virtual nodes."""

    def __init__(self, nodes: Sequence[str], virtual_nodes: int) -> None:
        points = sorted(
            (_point(f"{node}#{i}"), node) for node in nodes for i in range(virtual_nodes)
        )
        self._points = [p for p, _ in points]
        self._nodes = [n for _, n in points]

    def node(self, key: str) -> str:
        """The engine owning `key`: the first ring point at or after its hash, wrapping."""
        i = bisect.bisect_left(self._points, _point(key)) % len(self._points)
        return self._nodes[i]


@register("session")
class SessionAffinity:
    """Session id -> engine by consistent hashing; session-less requests go to the lowest QPS."""

    name = "session"
    reads_index = False
    speculative_entries = False
    moves_kv = False

    def __init__(
        self,
        context: PolicyContext | None = None,
        *,
        virtual_nodes: int = VIRTUAL_NODES,
        qps_window_s: float = QPS_WINDOW_S,
    ) -> None:
        self.virtual_nodes = virtual_nodes
        self.qps_window_s = qps_window_s
        self._ring_members: tuple[str, ...] = ()
        self._ring: _HashRing | None = None
        self._arrivals: dict[str, deque[float]] = {}

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """The session's ring node, or the eligible engine with the fewest recent requests."""
        eligible = candidates(request, engines)
        if request.session_id is None:
            return self._lowest_qps(eligible, now)
        return self._ring_over(eligible).node(request.session_id)

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """Count the request toward the engine's QPS."""
        engine = placement.engine
        self._arrivals.setdefault(engine, deque()).append(now)
        self._recent(engine, now)  # keeps the window, whether or not QPS is read

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Not used by the peer."""

    def on_finish(
        self, request_id: str, engine: str, now: float, output_tokens: int = 0
    ) -> None:
        """Not used by the peer."""

    def _ring_over(self, eligible: Sequence[EngineView]) -> _HashRing:
        members = tuple(sorted(e.name for e in eligible))
        if self._ring is None or members != self._ring_members:
            self._ring = _HashRing(members, self.virtual_nodes)
            self._ring_members = members
        return self._ring

    def _lowest_qps(self, eligible: Sequence[EngineView], now: float) -> str:
        for e in eligible:
            if e.name not in self._arrivals:
                return e.name
        return min(eligible, key=lambda e: self._recent(e.name, now)).name

    def _recent(self, engine: str, now: float) -> int:
        arrivals = self._arrivals[engine]
        while arrivals and arrivals[0] <= now - self.qps_window_s:
            arrivals.popleft()
        return len(arrivals)
