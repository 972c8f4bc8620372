"""The planner: one sans-IO object both drivers run (ARCHITECTURE.md, "The planner's one
interface").

Drivers tell it what is known and what happened, and carry out what it decides:

    planner.admit(Call(route, ...), now)   # a request is ready to be placed
    planner.on_event(event, now)           # FirstToken, Finished, Cancelled, Engine* (events.py)
    actions = planner.release(now)         # Dispatch | Reject (actions.py)
    planner.next_wakeup()                  # when release() must run again without an event

The live gateway (`gateway/proxy.py`) turns HTTP requests, streamed chunks, scrapes and health
checks into these calls; the virtual-time benchmark (`kvgate/bench/virtual.py`) turns workflow
arrivals and engine-model steps into the same calls. Everything that decides lives here or below
(routing policies, the load ledger, holding), so a benchmark result measures the code that serves
traffic.

Release is `Immediate`: a request is offered to the routing policy as soon as it is admitted and
dispatched unless the policy holds it; held requests are offered again, oldest first, whenever
load changes (a first token, a finish, a scrape, an engine's health). That reproduces every
per-request router exactly (the seeded-report gate, tests/test_seeded_reports.py).

Each request's state moves only along `TRANSITIONS`; anything else raises `IllegalTransition`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.actions import Action, Dispatch, Reject
from planner.dag import IllegalTransition
from planner.events import (
    Cancelled,
    EngineHealth,
    EngineJoined,
    EngineLeft,
    EngineScraped,
    Event,
    Finished,
    FirstToken,
)
from planner.hints import RequestHints
from planner.holding import HoldQueue
from planner.ledger import GatewayLoad, Outstanding, close_dispatch, open_dispatch, prefill_done
from planner.policy import (
    EngineView,
    Hold,
    NoEngineAvailable,
    RouteRequest,
    RoutingPolicy,
    placement_of,
)


class RequestState(enum.Enum):
    """Where one request is, from the planner's point of view."""

    QUEUED = "queued"
    """Admitted; not offered to the routing policy yet."""
    HELD = "held"
    """The policy keeps it at the gateway until load changes."""
    DISPATCHED = "dispatched"
    """Sent to an engine; no first token yet."""
    PREFILLED = "prefilled"
    """Its engine is answering."""
    FINISHED = "finished"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.HELD, RequestState.DISPATCHED,
                                    RequestState.REJECTED, RequestState.CANCELLED}),
    RequestState.HELD: frozenset({RequestState.DISPATCHED, RequestState.REJECTED,
                                  RequestState.CANCELLED}),
    RequestState.DISPATCHED: frozenset({RequestState.PREFILLED, RequestState.FINISHED}),
    RequestState.PREFILLED: frozenset({RequestState.FINISHED}),
    RequestState.FINISHED: frozenset(),
    RequestState.REJECTED: frozenset(),
    RequestState.CANCELLED: frozenset(),
}


@dataclass(frozen=True)
class Call:
    """A request ready to be placed: what the policy may know, and where it must not go."""

    route: RouteRequest
    exclude: frozenset[str] = frozenset()
    """Engines not to use (those that already failed this request)."""
    hints: RequestHints = field(default_factory=RequestHints)

    @property
    def request_id(self) -> str:
        """The request's id (unique among the planner's live requests)."""
        return self.route.request_id


@dataclass
class EngineRecord:
    """What the planner knows of one engine: health, models, scraped load, its own ledger."""

    name: str
    healthy: bool = False
    models: frozenset[str] = frozenset()
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    load: GatewayLoad = field(default_factory=GatewayLoad)
    """What the gateway has outstanding here (a fresh ledger when the engine rejoins)."""


@dataclass
class _Request:
    call: Call
    state: RequestState = RequestState.QUEUED
    outstanding: Outstanding | None = None

    def move(self, to: RequestState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.call.request_id!r}: {self.state.value} -> "
                                    f"{to.value}")
        self.state = to


class Planner:
    """Admission, placement and the gateway's ledger, behind `admit`/`on_event`/`release`."""

    def __init__(
        self,
        policy: RoutingPolicy,
        *,
        speculative_ttl_s: float = 0.0,
        engine_block_size: Callable[[str], int] = lambda _: 0,
    ) -> None:
        self.policy = policy
        self.speculative_ttl_s = speculative_ttl_s if policy.speculative_entries else 0.0
        """Index entries for dispatched prompts live this long; only for policies whose peer
        records its routing decisions (a baseline never gets a mechanism its peer lacks)."""
        self._block_size_of = engine_block_size
        self.engines: dict[str, EngineRecord] = {}
        self._known_models: set[str] = set()
        self._requests: dict[str, _Request] = {}
        self._queued: list[str] = []
        self._held: HoldQueue[str] = HoldQueue()
        self._load_changed = False

    # -- what drivers may read ------------------------------------------------------------------

    def views(self, exclude: frozenset[str] = frozenset()) -> list[EngineView]:
        """Immutable snapshots of every engine (but `exclude`), in the order they joined."""
        return [
            EngineView(
                name=e.name, healthy=e.healthy, models=e.models, num_running=e.num_running,
                num_waiting=e.num_waiting, kv_usage=e.kv_usage, in_flight=e.load.in_flight,
                prefilling=e.load.prefilling,
                queued_prefill_tokens=e.load.queued_prefill_tokens,
                active_blocks=e.load.active_blocks, block_size=self._block_size_of(e.name))
            for e in self.engines.values() if e.name not in exclude
        ]

    def models(self) -> list[str]:
        """Models served by at least one healthy engine, sorted."""
        return sorted({m for e in self.engines.values() if e.healthy for m in e.models})

    def knows(self, request_id: str) -> bool:
        """The request is admitted and not over."""
        return request_id in self._requests

    def state(self, request_id: str) -> RequestState | None:
        """The request's state (None once it is over)."""
        req = self._requests.get(request_id)
        return req.state if req is not None else None

    @property
    def held(self) -> int:
        """Requests the policy keeps at the gateway."""
        return len(self._held)

    @property
    def pending(self) -> bool:
        """`release` may have something to do."""
        return bool(self._queued) or (self._load_changed and bool(self._held))

    # -- the interface --------------------------------------------------------------------------

    def admit(self, call: Call, now: float) -> None:
        """A request is ready to be placed (at the next `release`)."""
        rid = call.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already in flight")
        self._requests[rid] = _Request(call)
        self._queued.append(rid)

    def on_event(self, event: Event, now: float) -> None:
        """Something happened at an engine or a client."""
        match event:
            case FirstToken(request_id=rid, observed=observed):
                req = self._requests.get(rid)
                if req is None or req.outstanding is None:
                    return
                if prefill_done(req.outstanding):
                    req.move(RequestState.PREFILLED)
                    if observed:
                        self.policy.on_first_token(rid, req.outstanding.engine, now)
                    self._load_changed = True
            case Finished(request_id=rid, output_tokens=tokens):
                req = self._requests.pop(rid, None)
                if req is None:
                    return
                if req.outstanding is None:
                    self._withdraw(req)
                    return
                req.move(RequestState.FINISHED)
                if close_dispatch(req.outstanding):
                    self.policy.on_finish(rid, req.outstanding.engine, now, tokens)
                    self._load_changed = True
            case Cancelled(request_id=rid):
                req = self._requests.get(rid)
                if req is None:
                    return
                if req.outstanding is not None:
                    raise IllegalTransition(f"request {rid!r} is at an engine already: report "
                                            "its end with Finished")
                del self._requests[rid]
                self._withdraw(req)
            case EngineJoined(engine=name, healthy=healthy, models=models):
                if name in self.engines:
                    raise ValueError(f"engine {name!r} is already in the pool")
                self.engines[name] = EngineRecord(name, healthy, models)
                self._known_models |= models
                self._load_changed = True
            case EngineLeft(engine=name):
                self.engines.pop(name, None)
                self._load_changed = True
            case EngineHealth(engine=name, healthy=healthy, models=models):
                rec = self.engines.get(name)
                if rec is None:
                    return
                rec.healthy = healthy
                if models is not None:
                    rec.models = models
                    self._known_models |= models
                self._load_changed = True
            case EngineScraped(engine=name):
                rec = self.engines.get(name)
                if rec is None:
                    return
                rec.num_running = event.num_running
                rec.num_waiting = event.num_waiting
                rec.kv_usage = event.kv_usage
                self._load_changed = True

    def release(self, now: float) -> list[Action]:
        """What to do now: held requests are offered again (oldest first) if load changed since
        the last release, then the newly admitted ones in admission order."""
        actions: list[Action] = []
        if self._load_changed:
            self._load_changed = False
            if self._held:
                self._held.release(lambda rid: self._offer(rid, now, actions))
        if self._queued:
            queued, self._queued = self._queued, []
            for rid in queued:
                if not self._offer(rid, now, actions):
                    self._requests[rid].move(RequestState.HELD)
                    self._held.hold(rid, rid)
        return actions

    def next_wakeup(self) -> float | None:
        """When `release` must run again without an event (never, under `Immediate`)."""
        return None

    # -- placing --------------------------------------------------------------------------------

    def _offer(self, rid: str, now: float, actions: list[Action]) -> bool:
        """Let the policy place one request; False if it holds it."""
        req = self._requests[rid]
        route = req.call.route
        try:
            choice = self.policy.choose(route, self.views(req.call.exclude), now)
        except Hold:
            return False
        except NoEngineAvailable as e:
            del self._requests[rid]
            req.move(RequestState.REJECTED)
            actions.append(Reject(rid, route.model, e.reason,
                                  route.model in self._known_models, tuple(self.models())))
            return True
        placement = placement_of(choice)
        engine = placement.engine
        rec = self.engines[engine]
        req.outstanding = open_dispatch(route, engine, rec.load, self._block_size_of(engine))
        req.move(RequestState.DISPATCHED)
        self.policy.on_dispatch(route, placement, now)
        ttl = self.speculative_ttl_s
        actions.append(Dispatch(
            rid, engine, req.outstanding.cached_tokens, placement.cost,
            route.block_keys if ttl > 0 else (), ttl, req.call.hints.priority))
        return True

    def _withdraw(self, req: _Request) -> None:
        """A request leaves before any engine saw it."""
        rid = req.call.request_id
        if req.state is RequestState.HELD:
            self._held.discard(rid)
        elif req.state is RequestState.QUEUED:
            self._queued.remove(rid)
        req.move(RequestState.CANCELLED)


def reject_message(reject: Reject) -> str:
    """The error a client reads for a `Reject`."""
    return f"no engine available for model {reject.model!r}: {reject.reason}"

