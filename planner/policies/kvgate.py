"""`kvgate`: place each request on the engine with the lowest estimated completion time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvindex.index import EngineMatch
from planner.cost import CostModel, CostSettings, PlacementCost
from planner.policy import (
    EngineView,
    Placement,
    PolicyContext,
    RouteRequest,
    candidates,
    register,
)
from planner.transfer import Pull


@register("kvgate")
class KvgatePolicy:
    """Cost-based placement over the KV index (see planner.cost), corrected online by observed
    TTFT and inter-token latency."""

    name = "kvgate"
    speculative_entries = True
    moves_kv = True
    homes = True
    """Place a workflow's first call by the workflows each engine is home to (`_root_home`)."""

    def __init__(self, context: PolicyContext | None = None) -> None:
        ctx = context or PolicyContext()
        self.cost = CostModel(ctx.profiles, ctx.default_profile, CostSettings(link=ctx.link))
        # Predictions per request id, for the online speed correction.
        self._pending: dict[str, _Prediction] = {}
        self._in_flight: dict[str, int] = {}

    def choose(
        self, request: RouteRequest, engines: Sequence[EngineView], now: float
    ) -> Placement:
        """The engine with the cheapest placement, with its estimate and the runners-up."""
        eligible = candidates(request, engines)
        best, ranked = self.cost.ranked(request, eligible)
        if request.workflow_root and self.homes:
            best = self._root_home(best, ranked, eligible)
        pull = None
        if best.transfer_from is not None:
            reason = "disaggregate" if best.prefill_engine is not None else "pull"
            pull = Pull(best.transfer_from, best.cached_tokens, reason)
        others = tuple(c for c in ranked if c.engine != best.engine)[:RUNNERS_UP]
        return Placement(best.engine, best, pull, others)

    def _root_home(self, best: PlacementCost, ranked: Sequence[PlacementCost],
                   engines: Sequence[EngineView]) -> PlacementCost:
        """Where a workflow's first call goes is where its context will live: its later calls
        come back to it. Among the engines that serve nearly as much of the prompt from cache
        as the best choice (they would recompute at most one full prefill step more) and whose
        estimate is within `ROOT_SCORE_CAP` times the best, the one home to the fewest
        workflows in flight (then the cheapest). Where the cost model chose to recompute a
        prefix that others hold (the holders are hot), its choice stands.

        The load of the moment is a poor guide for work that lasts: agent loops alternate
        between a call and a tool's think time, so an engine whose loops are all thinking
        looks idle, takes every new loop, and then serves them all at once when they come
        back (measured: react, 1,000 workflows at 14/s, 8 x h100-llama3-8b: mean JCT 37.3 s
        placing roots by the estimate alone, 31.4 s by homes)."""
        if best.prefill_engine is not None:
            return best
        slack = self.cost.profile(best.engine).max_num_batched_tokens
        floor = max(c.cached_tokens for c in ranked) - slack
        if best.cached_tokens < floor:
            return best
        homed = {e.name: e.homed_workflows for e in engines}
        cap = ROOT_SCORE_CAP * best.score
        near = [c for c in ranked if c.cached_tokens >= floor and c.score <= cap]
        if not near:
            return best
        return min(near, key=lambda c: homed.get(c.engine, 0))

    def plan_prefetch(self, request: RouteRequest, children: int,
                      engines: Sequence[EngineView], now: float,
                      holder: str | None = None) -> list[str]:
        """Where `children` calls extending `request` (its prompt, then its output) should run:
        each child placed in turn by the cost model on the pool as the earlier ones leave it.

        With a link, the prompt's KV can be copied ahead to wherever they go, so every engine
        is priced as holding it. Without one, a copy is a recompute warm-up that costs what
        the child's own recompute would: only `holder` (the engine that computed the prompt)
        and the engines the index says hold it are priced as holding it, and a child goes
        elsewhere only where the cost model would recompute the prompt there anyway (the
        warm-up then does that work earlier, overlapped with the parent's decode)."""
        pool = {e.name: e for e in candidates(request, engines)}
        blocks = len(request.block_keys)
        output = request.max_tokens or self.cost.settings.default_output_tokens
        held = [*pool] if self.cost.settings.link.enabled else [holder] if holder else []
        matches = {**request.matches,
                   **{n: EngineMatch(n, blocks, blocks, float(blocks)) for n in held}}
        child = replace(
            request, prompt_tokens=request.prompt_tokens + output, matches=matches,
            group_finish_s=0.0, group_at={}, arriving={})
        picks = []
        for _ in range(children):
            best = self.cost.best(child, list(pool.values()))
            picks.append(best.engine)
            v = pool[best.engine]
            pool[best.engine] = replace(
                v, in_flight=v.in_flight + 1, prefilling=v.prefilling + 1,
                queued_prefill_tokens=v.queued_prefill_tokens + child.prompt_tokens
                - best.cached_tokens, active_blocks=v.active_blocks + blocks)
        return picks

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """Remember the prediction the placement made, for the online correction."""
        engine = placement.engine
        self._in_flight[engine] = self._in_flight.get(engine, 0) + 1
        est = placement.cost
        if est is not None and est.engine == engine:
            # The correction learns how far the engine is from its profile, so the prediction
            # it is compared with is the profile's own (the correction in force divided out).
            corr = self.cost.correction
            ttft_raw = est.ttft_s / corr.prefill.get(engine, 1.0)
            context = request.prompt_tokens + (request.max_tokens or
                                               self.cost.settings.default_output_tokens) // 2
            self._pending[request.request_id] = _Prediction(
                ttft_raw, self._in_flight[engine], context, now)

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Correct the engine's prefill speed by observed vs predicted TTFT."""
        p = self._pending.get(request_id)
        if p is not None and p.first_token_at is None:
            p.first_token_at = now
            self.cost.correction.observe_ttft(engine, now - p.sent_at, p.ttft_s)

    def on_finish(
        self, request_id: str, engine: str, now: float, output_tokens: int = 0
    ) -> None:
        """Correct the engine's decode speed by observed vs predicted inter-token latency.

        The batch a request decodes in grows and shrinks after it is placed; its ITL is
        predicted again at the mean of the batch it was placed into and the batch it leaves,
        so a fan-out that joined later is not mistaken for a slow engine."""
        in_flight = self._in_flight.get(engine, 0)
        self._in_flight[engine] = max(0, in_flight - 1)
        p = self._pending.pop(request_id, None)
        if p is None or p.first_token_at is None or output_tokens < MIN_TOKENS_FOR_ITL:
            return
        observed = (now - p.first_token_at) / (output_tokens - 1)
        batch = max(1, round((p.batch + in_flight) / 2))
        predicted = self.cost.profile(engine).decode_step_time(batch, p.context_tokens)
        self.cost.correction.observe_itl(engine, observed, predicted)


ROOT_SCORE_CAP = 2.0
"""A workflow's first call never goes where its estimate exceeds this multiple of the best
(a hot engine's queue still counts)."""

RUNNERS_UP = 3
"""Other engines' estimates a placement carries (for traces)."""

MIN_TOKENS_FOR_ITL = 8
"""Fewer streamed tokens than this say more about scheduling noise than decode speed."""


@dataclass
class _Prediction:
    ttft_s: float
    """Predicted time to first token, by the profile (no correction)."""
    batch: int
    """Requests at the engine, this one included, when it was placed."""
    context_tokens: int
    sent_at: float
    first_token_at: float | None = None
