"""`kvgate`: place each request on the engine with the lowest estimated completion time."""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost import CostModel, PlacementCost
from planner.policy import EngineView, PolicyContext, RouteRequest, candidates, register


@register("kvgate")
class KvgatePolicy:
    """Cost-based placement over the KV index (see planner.cost), corrected by observed TTFT."""

    name = "kvgate"

    def __init__(self, context: PolicyContext | None = None) -> None:
        ctx = context or PolicyContext()
        self.cost = CostModel(ctx.profiles, ctx.default_profile)
        self.last: PlacementCost | None = None
        # request id -> (predicted TTFT, dispatch time) for the online speed correction.
        self._pending: dict[str, tuple[float, float]] = {}

    def choose(self, request: RouteRequest, engines: Sequence[EngineView], now: float) -> str:
        """The engine with the cheapest placement."""
        self.last = self.cost.best(request, candidates(request, engines))
        return self.last.engine

    def on_dispatch(self, request: RouteRequest, engine: str, now: float) -> None:
        """Remember the prediction made for the chosen engine."""
        if self.last is not None and self.last.engine == engine:
            self._pending[request.request_id] = (self.last.ttft_s, now)

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Correct the engine's prefill speed by observed vs predicted TTFT."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            predicted, sent = pending
            self.cost.correction.observe_ttft(engine, now - sent, predicted)

    def on_finish(self, request_id: str, engine: str, now: float) -> None:
        """Drop any prediction still pending (the request failed before its first token)."""
        self._pending.pop(request_id, None)
