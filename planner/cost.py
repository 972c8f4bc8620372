"""Cost model for placing one request: compute-first vs data-first, as one estimate per engine.

For every engine: time the request would wait behind prefill work already queued there, time to
prefill the part of its prompt the engine does not hold, optionally time to pull missing blocks
from the best holder when that beats recomputing them (Mooncake's Algorithm 1, generalised), and
time to decode its output at the engine's current batch size. Engine speed comes from its roofline
profile and is corrected online by the ratio of observed to predicted TTFT and ITL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvindex.index import EngineMatch
from planner.policy import EngineView, RouteRequest
from planner.profiles import EngineProfile
from planner.transfer import NO_LINK, TransferLink


@dataclass(frozen=True)
class PlacementCost:
    """One engine's estimate for one request (seconds)."""

    engine: str
    queue_s: float
    prefill_s: float
    transfer_s: float
    decode_s: float
    cached_tokens: int
    transfer_from: str | None = None
    transfer_tokens: int = 0
    cache_ignored: bool = False
    """Hot-spot protection discarded this engine's cache advantage."""
    external_s: float = 0.0
    """Delay the placement imposes on the requests already at the engine (their decode steps
    stretched by this request's prefill and by one more sequence in the batch), summed."""

    @property
    def ttft_s(self) -> float:
        """Predicted time to first token."""
        return self.queue_s + self.transfer_s + self.prefill_s

    @property
    def total_s(self) -> float:
        """Predicted completion time of the request."""
        return self.ttft_s + self.decode_s

    group_s: float = 0.0
    """When the request's sibling group would be done with it placed here (0: no siblings)."""
    own_s: float = 0.0
    """With siblings in flight, the weighted own completion (`CostSettings.own_weight`)."""
    prefill_engine: str | None = None
    """Disaggregated: the prompt is computed on this other engine, then its KV copied here
    (`transfer_from` is the same engine) and the request decodes here."""

    @property
    def score(self) -> float:
        """What placement minimises: when the caller can go on — the later of the request's own
        completion and its sibling group's (a join waits for the slowest) — plus the delay it
        imposes on the other requests at the engine and, with siblings, its own completion
        weighted by how idle the pool is (`CostSettings.own_weight`)."""
        return max(self.ttft_s + self.decode_s, self.group_s) + self.external_s + self.own_s


@dataclass
class SpeedCorrection:
    """Observed/predicted ratios per engine, smoothed (1.0 until observations arrive)."""

    alpha: float = 0.2
    lo: float = 0.25
    hi: float = 4.0
    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)

    def _update(self, table: dict[str, float], engine: str, observed: float, predicted: float
                ) -> None:
        if predicted <= 0 or observed <= 0:
            return
        ratio = min(self.hi, max(self.lo, observed / predicted))
        old = table.get(engine, 1.0)
        table[engine] = (1 - self.alpha) * old + self.alpha * ratio

    min_predicted_s: float = 0.02
    """Predictions shorter than this are dominated by fixed overheads and teach nothing."""

    def observe_ttft(self, engine: str, observed: float, predicted: float) -> None:
        """Fold in one request's observed time to first token."""
        if predicted >= self.min_predicted_s:
            self._update(self.prefill, engine, observed, predicted)

    def observe_itl(self, engine: str, observed: float, predicted: float) -> None:
        """Fold in one request's observed mean inter-token latency."""
        self._update(self.decode, engine, observed, predicted)


@dataclass(frozen=True)
class CostSettings:
    """Knobs of the cost model."""

    default_output_tokens: int = 128
    hot_spot_factor: float | None = None
    """An engine whose load exceeds this multiple of the pool mean (plus `hot_spot_slack`)...
    Off by default: the queue, decode-batch and externality terms already price a hot spot, and
    a load rule that ignores the cache sent a fan-out's children to recompute a long shared
    context (measured: fan-out with 32k contexts on h100x4-llama3-70b, hit rate 68% with it
    against 86% without)."""
    hot_spot_slack: int = 2
    """...cannot win on its cache: its cached tokens are priced as if recomputed."""
    link: TransferLink = NO_LINK
    pulls: bool = False
    """With a link, price pulling the prompt's cached prefix from the engine holding most of
    it when a request is placed (llm-d's P2P move, made when the cost model says it pays).
    Off by default: a request's KV moves only ahead of need (prefetch, replication). Measured
    (2026-11-26, 8 x h100x4-llama3-70b, RDMA, 32k contexts, 4 agent types, goodput at the
    default SLO; both arms copying every hot system prompt, as replication then did): pulls and
    splits together read 0.594 / 0.364 / 1.235 workflows/s on fanout-long / tree-long /
    debate-long, against 0.700 / 0.390 / 1.482 without either; splits alone off, 0.670 / 0.390
    / 1.235 (with today's replication: `kvgate-pulls` 0.594 / 0.364 / 1.235 against `kvgate`
    0.700 / 0.416 / 1.606, the README's moves table). A pull takes a workflow's call off
    the engine its context lives on, and the myopic estimate misses what that does to the
    workflow's later calls and to the decodes at the new engine."""
    disaggregate_min_steps: float | None = None
    """With a link, a prompt whose uncached part needs at least this many full prefill steps
    may be computed on one engine and decoded on another (`CostModel.split`), when that costs
    less: its chunks then stall no decode at the engine it runs on. None (the default): never;
    see `pulls` for what it measured (`kvgate-pulls` sets 1.0)."""
    transfer_min_tokens: int = 256
    """Pulling fewer missing tokens than this is never worth a transfer's setup."""
    own_weight: float = 2.0
    """With siblings in flight, the request's own completion also counts, with this weight over
    (1 + the pool's mean load per engine): the later of its own and its group's finish alone
    is indifferent to where a call goes while the group's predicted finish dominates, and then
    the cheapest prefill wins, piling a fan-out's children onto the engine that holds their
    context while the rest of an idle pool waits. Measured (2026-11-26, 8 x h100-llama3-8b,
    100 workflows, seed 0): at low load (fanout 0.5/s, tree 0.25/s) mean JCT 5.681 -> 5.514 s
    and 7.177 -> 6.859 s (least-loaded 5.552 and 6.842); at tree's goodput (2.6/s) 9.993 ->
    9.965 s. 0 gives the group's finish alone."""
    externality: float = 1.0
    """Weight of the delay a placement imposes on the requests already at the engine: each of
    them waits through this request's prefill chunks and steps one sequence longer. Without it
    the greedy choice recomputes long prefixes on busy engines whose other requests pay."""
    opportunity: float = 1.0
    """Weight of the prefill a placement spends, times the pool's mean load per engine: the
    requests still to come that wait through it (an idle engine's compute is free only while
    the pool is idle)."""
    opportunity_per_workflow: bool = True
    """Count the work still to come that waits through a recompute as the pool's mean
    *workflows* per engine (`EngineView.workflows`: a workflow's calls in flight at an engine
    count once, since a delay there lengthens the workflow once however many of them run in
    parallel) rather than its mean requests. With a wide fan-out in flight, counting its calls
    one by one priced a child's recompute elsewhere so high that every leaf of a tree of
    thought went to the engine holding the tree (26 of 27, at 2.6 workflows/s). Measured
    (2026-11-26, 8 x h100-llama3-8b, 100 workflows, seed 0): at low load tree (0.25/s)
    6.859 -> 6.785 s mean JCT (least-loaded 6.842, round-robin 6.832), fanout (0.5/s) 5.514
    -> 5.499 s, debate (0.5/s) 8.728 -> 8.725 s; goodput (precision 0.01) tree 2.456 -> 2.418,
    fanout and debate unchanged; 70B long contexts on 48 workflows with an RDMA link: tree-long
    0.387 -> 0.3902, fanout-long 0.7157 -> 0.7119, debate-long unchanged (0.7154). Counting
    the externality per workflow as well was tried and dropped: long-context goodput fell
    1-5%."""
    measured_contexts: bool = True
    """Price the decode batch by the contexts the gateway has in flight at the engine (its
    ledger's prompt blocks) rather than as copies of this request's context."""
    fresh_load: bool = True
    """Count the engine's load as the gateway's own in flight plus the foreign requests of the
    last scrape (`EngineView.fresh_load`) rather than the larger of in flight and the scrape."""


class CostModel:
    """Estimates `PlacementCost` for every engine and picks the cheapest."""

    def __init__(
        self,
        profiles: Mapping[str, EngineProfile],
        default_profile: EngineProfile,
        settings: CostSettings | None = None,
    ) -> None:
        self.profiles = profiles
        self.default_profile = default_profile
        self.settings = settings or CostSettings()
        self.correction = SpeedCorrection()

    def profile(self, engine: str) -> EngineProfile:
        """The engine's roofline profile."""
        return self.profiles.get(engine, self.default_profile)

    def prefill_seconds(self, engine: str, new_tokens: int, context_tokens: int) -> float:
        """Prefill time on an otherwise idle engine, corrected by observations."""
        if new_tokens <= 0:
            return 0.0
        base = self.profile(engine).prefill_time(new_tokens, context_tokens)
        return base * self.correction.prefill.get(engine, 1.0)

    def decode_step_seconds(self, engine: str, batch: int, context_tokens: int) -> float:
        """One decode step with `batch` sequences of `context_tokens` each."""
        step = self.profile(engine).decode_step_time(max(1, batch), context_tokens)
        return step * self.correction.decode.get(engine, 1.0)

    def _legs_seconds(self, source: EngineView, destination: EngineView, context: int) -> float:
        """The two legs' own cost beyond the copy: each waits for a step of its engine (the
        producer computes the prompt's last token, the consumer its first output token)."""
        return (self.decode_step_seconds(source.name, self._load(source) + 1, context)
                + self.decode_step_seconds(destination.name, self._load(destination) + 1,
                                           context))

    @staticmethod
    def _confirmed_tokens(request: RouteRequest, e: EngineView) -> int:
        m = request.matches.get(e.name)
        if m is None or request.prompt_tokens <= 0:
            return 0
        held = min(m.confirmed_blocks * request.block_size, request.prompt_tokens - 1)
        return held - held % e.block_size if e.block_size > 0 else held

    def _load(self, e: EngineView) -> int:
        return e.fresh_load if self.settings.fresh_load else e.load

    def estimate(
        self, request: RouteRequest, engines: Sequence[EngineView]
    ) -> list[PlacementCost]:
        """One cost per engine in `engines` (already filtered to eligible ones)."""
        s = self.settings
        if not engines:
            return []
        mean_load = sum(self._load(e) for e in engines) / len(engines)
        mean_waiting = (sum(e.workflows for e in engines) / len(engines)
                        if s.opportunity_per_workflow else mean_load)
        hot_limit = float("inf")
        if s.hot_spot_factor is not None:
            hot_limit = mean_load * s.hot_spot_factor + s.hot_spot_slack
        output = request.max_tokens or s.default_output_tokens
        prompt = request.prompt_tokens
        # A pull's source must hold the blocks for real (the engine's own events), not by a
        # speculative entry for a prompt that may still be prefilling there.
        holders = sorted(
            ((self._confirmed_tokens(request, e), e.name) for e in engines),
            reverse=True,
        )
        by_name = {e.name: e for e in engines}
        out = []
        for e in engines:
            cached = request.cached_tokens(e.name, e.block_size)
            ignored = False
            load = self._load(e)
            if cached and load > hot_limit:
                cached, ignored = 0, True
            # Prefill work ahead of this request: what the gateway itself queued there, plus
            # requests the engine reports waiting that are not the gateway's (other clients,
            # other replicas), each priced like this one.
            foreign_waiting = max(0, e.num_waiting - e.prefilling)
            queue = self.prefill_seconds(e.name, e.queued_prefill_tokens, 0)
            queue += foreign_waiting * self.prefill_seconds(e.name, prompt, 0)
            prefill = self.prefill_seconds(e.name, prompt - cached, cached)
            transfer, source, moved = 0.0, None, 0
            best_cached, best_holder = holders[0] if holders else (0, "")
            if (s.pulls and s.link.bandwidth_bytes_s > 0 and best_holder != e.name
                    and best_cached - cached >= s.transfer_min_tokens):
                moved = best_cached - cached
                kv_bytes = moved * self.profile(e.name).kv_bytes_per_token
                busy = request.link_wait
                t = (s.link.setup_s + kv_bytes / s.link.bandwidth_bytes_s
                     + max(busy.get(best_holder, 0.0), busy.get(e.name, 0.0))
                     + self._legs_seconds(by_name[best_holder], e, prompt))
                with_transfer = t + self.prefill_seconds(e.name, prompt - best_cached, best_cached)
                if with_transfer < prefill:
                    transfer, prefill, source = t, with_transfer - t, best_holder
                    cached = best_cached
                else:
                    moved = 0
            coming = request.arriving.get(e.name)
            if coming is not None:
                # A move in flight brings the prefix: wait for it, if that beats the rest.
                blocks, wait = coming
                landed = min(blocks * request.block_size, prompt - 1)
                if e.block_size > 0:
                    landed -= landed % e.block_size
                if landed > cached:
                    after = self.prefill_seconds(e.name, prompt - landed, landed)
                    if wait + after < transfer + prefill:
                        transfer, prefill, cached, source, moved = wait, after, landed, None, 0
            batch = load + 1
            own = prompt + output // 2
            # The contexts already decoding there: the gateway's own in-flight prompts (its
            # ledger's blocks), and foreign requests priced like this one.
            siblings = min(load, request.group_at.get(e.name, 0))
            others = own * load
            if s.measured_contexts and e.in_flight > 0:
                others = (e.active_blocks * request.block_size
                          + own * max(0, load - e.in_flight))
            with_it = self.decode_step_seconds(e.name, batch, (others + own) // batch)
            decode = output * with_it
            external = 0.0
            group = 0.0
            if load > 0:
                # Each request already there waits through this one's prefill chunks, and
                # steps one sequence longer while both decode. Siblings pay it in the group's
                # finish instead: the caller waits for the slowest of them, not for the sum.
                without = self.decode_step_seconds(e.name, load, others // load)
                delay = prefill + output * max(0.0, with_it - without)
                external = s.externality * (load - siblings) * delay
                if siblings:
                    group = request.group_finish_s + delay
            # Compute spent recomputing is compute the requests still to come do not get: as
            # many of them as the pool holds per engine now wait through it.
            external += s.opportunity * mean_waiting * prefill
            if request.group_finish_s > group:
                group = request.group_finish_s
            own_s = (s.own_weight / (1.0 + mean_load) * (queue + transfer + prefill + decode)
                     if group else 0.0)
            out.append(PlacementCost(
                engine=e.name, queue_s=queue, prefill_s=prefill, transfer_s=transfer,
                decode_s=decode, cached_tokens=cached, transfer_from=source,
                transfer_tokens=moved, cache_ignored=ignored, external_s=external, group_s=group,
                own_s=own_s,
            ))
        return out

    def split(self, request: RouteRequest, engines: Sequence[EngineView],
              costs: Sequence[PlacementCost]) -> PlacementCost | None:
        """Prefill on one engine, decode on another (the NIXL two legs as vLLM's P/D flow
        uses them): the prefill engine is the one where the prompt's computation costs least
        counting the decodes it stalls there; the decode engine the one where the request,
        its prompt copied in, decodes at least cost. None without a link or a second engine."""
        s = self.settings
        if not s.link.enabled or len(engines) < 2:
            return None
        by_name = {e.name: e for e in engines}
        mean_load = sum(self._load(e) for e in engines) / len(engines)
        best_p: tuple[float, PlacementCost] | None = None
        for c in costs:
            if c.transfer_from is not None or c.prefill_s <= 0:
                continue
            load = self._load(by_name[c.engine])
            stall = (s.externality * load + s.opportunity * mean_load) * c.prefill_s
            key = c.queue_s + c.prefill_s + stall
            if best_p is None or key < best_p[0]:
                best_p = (key, c)
        if best_p is None:
            return None
        pre = best_p[1]
        blocks = len(request.block_keys)
        full = replace(request, arriving={}, matches={
            e.name: EngineMatch(e.name, blocks, blocks, float(blocks)) for e in engines})
        after = [c for c in self.estimate(full, engines) if c.engine != pre.engine]
        if not after:
            return None
        dest = min(after, key=lambda c: (round(c.score, 9), c.engine))
        moved = min(blocks * request.block_size, request.prompt_tokens - 1)
        kv_bytes = moved * self.profile(dest.engine).kv_bytes_per_token
        busy = request.link_wait
        t = (s.link.setup_s + kv_bytes / s.link.bandwidth_bytes_s
             + max(busy.get(pre.engine, 0.0), busy.get(dest.engine, 0.0))
             + self._legs_seconds(by_name[pre.engine], by_name[dest.engine],
                                  request.prompt_tokens))
        stall = (best_p[0] - pre.queue_s - pre.prefill_s)
        return replace(
            dest, queue_s=pre.queue_s + dest.queue_s, prefill_s=pre.prefill_s + dest.prefill_s,
            transfer_s=t, transfer_from=pre.engine, transfer_tokens=moved,
            cached_tokens=moved, external_s=dest.external_s + stall,
            prefill_engine=pre.engine)

    def best(self, request: RouteRequest, engines: Sequence[EngineView]) -> PlacementCost:
        """The cheapest placement; ties go to the less loaded engine, then pool order."""
        return self.ranked(request, engines)[0]

    def ranked(self, request: RouteRequest, engines: Sequence[EngineView]
               ) -> tuple[PlacementCost, list[PlacementCost]]:
        """The cheapest placement (as `best`), and every engine's own estimate, cheapest first
        (the choice's engine included, as estimated alone), for traces to show the runners-up."""
        costs = self.estimate(request, engines)
        load = {e.name: self._load(e) for e in engines}
        order = {e.name: i for i, e in enumerate(engines)}
        ranked = sorted(costs, key=lambda c: (round(c.score, 9), round(c.total_s, 9),
                                              load[c.engine], order[c.engine]))
        best = ranked[0]
        steps = self.settings.disaggregate_min_steps
        if steps is not None and self.settings.link.enabled:
            uncached = request.prompt_tokens - best.cached_tokens
            if uncached >= steps * self.profile(best.engine).max_num_batched_tokens:
                split = self.split(request, engines, costs)
                if split is not None and split.score < best.score:
                    return split, ranked
        return best, ranked
