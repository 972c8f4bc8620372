"""The planner: one sans-IO object both drivers run (ARCHITECTURE.md, "The planner's one
interface").

Drivers tell it what is known and what happened, and carry out what it decides:

    planner.admit(Call(route, ...), now)   # a request is ready to be placed
    planner.on_event(event, now)           # FirstToken, Finished, Cancelled, Engine*,
                                           # TransferDone/Failed, Workflow* (events.py)
    actions = planner.release(now)         # Dispatch | Reject | Transfer | Warm (actions.py)
    planner.next_wakeup()                  # when release() must run again without an event

The live gateway (`gateway/proxy.py`) turns HTTP requests, streamed chunks, scrapes and health
checks into these calls; the virtual-time benchmark (`kvgate/bench/virtual.py`) turns workflow
arrivals and engine-model steps into the same calls. Everything that decides lives here or below
(routing policies, the load ledger, holding), so a benchmark result measures the code that serves
traffic.

Two release policies:
- `immediate`: a request is offered to the routing policy as soon as it is admitted and
  dispatched unless the policy holds it; held requests are offered again, oldest first, whenever
  load changes (a first token, a finish, a scrape, an engine's health). That reproduces every
  per-request router exactly (the seeded-report gate, tests/test_seeded_reports.py).
- `batch` (SBS, ANCHORS.md): calls wait in the gateway's buffer (planner/release.py), ranked by
  priority (planner/priorities.py), and each release offers them in that order to the routing
  policy; a call goes out when the engine the policy picks has headroom, else it waits for the
  next release (on every admission and load change, and at least once per interval).

KV movement (policies whose peer moves KV, `moves_kv`; README "Moving KV between engines"):
a placement may ask for a pull (or a disaggregated prefill), and the request then waits in
`awaiting_kv` for its `Transfer`; variants that prefetch copy a fan-out parent's prompt to where
its children are planned when it starts answering; variants that replicate keep hot static
segments on as many engines as their share of demand calls for (planner/replication.py). Moves
in flight are visible to placement (`RouteRequest.arriving`, `link_wait`).

Each request's state moves only along `TRANSITIONS`; anything else raises `IllegalTransition`.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvindex.index import BlockKey, EngineMatch
from planner.actions import Action, Dispatch, Move, Reject, Transfer
from planner.cost import CostModel
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
    TransferDone,
    TransferFailed,
    WorkflowOver,
    WorkflowSubmitted,
)
from planner.hints import RequestHints
from planner.holding import HoldQueue
from planner.ledger import (
    GatewayLoad,
    Outstanding,
    close_dispatch,
    computed_ahead,
    lost_ahead,
    open_dispatch,
    prefill_done,
)
from planner.movement import MoveRecord, Moves, warm_of
from planner.policy import (
    EngineView,
    Hold,
    NoEngineAvailable,
    Placement,
    PolicyContext,
    RouteRequest,
    RoutingPolicy,
    make_policy,
    placement_of,
    policy_names,
)
from planner.priorities import WorkflowPriorities
from planner.profiles import EngineProfile
from planner.release import BatchRelease
from planner.replication import MIN_BLOCKS as REPLICATE_MIN_BLOCKS
from planner.replication import StaticDemand
from planner.segments import NO_SEGMENTS, Segments, common_prefix, tag_blocks
from planner.transfer import NO_LINK, TransferLink


@dataclass(frozen=True)
class PlannerSettings:
    """How a planner variant is put together: its routing policy, release and priorities."""

    routing: str
    release: str = "immediate"
    """`immediate` or `batch` (SBS)."""
    priorities: bool = False
    """Order the buffer by DAG priorities and hand engines vLLM's `priority`."""
    siblings: bool = False
    """Tell the routing policy when a call's siblings (the same workflow's calls in flight:
    the workflow ends only when every branch has) are predicted to finish, and where they
    run."""
    prefetch: bool = False
    """When a task with several children starts answering, copy its prompt's KV to the
    engines its children are planned for (a transfer, or a warm-up where no link exists)."""
    replicate: bool = False
    """With a link, keep hot static segments on as many engines as their share of demand
    needs (planner/replication.py)."""
    homes: bool = True
    """Policies that can (`kvgate`) place a workflow's first call by the workflows each engine
    is home to; False keeps the cost estimate alone."""
    pulls: bool = False
    """Policies with a cost model (`kvgate`) also price, with a link, pulling a request's
    prefix from a peer as it is placed and splitting a long prefill from its decode
    (`CostSettings.pulls`, `disaggregate_min_steps`)."""
    pace: bool = False
    """Stall-free prefill: a prompt whose uncached part is longer than what one step of its
    engine's decode batch computes for free (`EngineProfile.free_prefill_tokens`) is
    computed in such pieces, each a warm-up of a longer prefix (`Warm`, reason `pace`), so
    no step of the engine turns compute-bound and stalls the sequences decoding there; the
    request goes out with the last piece (`Planner._pace`)."""
    pace_in_engine: bool = False
    """With `pace`: no pieces; the request goes out at once with the same free piece as a
    per-step cap on its prompt (`Dispatch.prefill_cap`, lowered further into a long prompt
    by `Dispatch.prefill_caps`), which an engine running kvgate's scheduler plugin (or the
    simulated engine) applies in every step that has a decoding request, so the server sees
    the call once."""


VARIANTS: dict[str, PlannerSettings] = {
    "kvgate": PlannerSettings("kvgate", release="batch", priorities=True, siblings=True,
                              prefetch=True, replicate=True, pace=True),
    "kvgate-engine-pace": PlannerSettings("kvgate", release="batch", priorities=True,
                                          siblings=True, prefetch=True, replicate=True,
                                          pace=True, pace_in_engine=True),
    "kvgate-no-prefetch": PlannerSettings("kvgate", release="batch", priorities=True,
                                          siblings=True, replicate=True, pace=True),
    "kvgate-no-replicate": PlannerSettings("kvgate", release="batch", priorities=True,
                                           siblings=True, prefetch=True, pace=True),
    "kvgate-no-batch": PlannerSettings("kvgate", release="immediate", priorities=True,
                                       siblings=True, prefetch=True, replicate=True, pace=True),
    "kvgate-no-priority": PlannerSettings("kvgate", release="batch", siblings=True,
                                          prefetch=True, replicate=True, pace=True),
    "kvgate-no-siblings": PlannerSettings("kvgate", release="batch", priorities=True,
                                          prefetch=True, replicate=True, pace=True),
    "kvgate-no-homes": PlannerSettings("kvgate", release="batch", priorities=True,
                                       siblings=True, prefetch=True, replicate=True,
                                       homes=False, pace=True),
    "kvgate-no-pace": PlannerSettings("kvgate", release="batch", priorities=True,
                                      siblings=True, prefetch=True, replicate=True),
    "kvgate-pulls": PlannerSettings("kvgate", release="batch", priorities=True, siblings=True,
                                    prefetch=True, replicate=True, pulls=True, pace=True),
    "kvgate-routing-only": PlannerSettings("kvgate"),
}
"""The full planner and its ablations; every other name is a routing policy under `immediate`
release (the per-request routers, exactly as their peers ship)."""


def planner_settings(name: str) -> PlannerSettings:
    """The variant's settings; a plain routing policy name runs under `immediate` release."""
    return VARIANTS.get(name, PlannerSettings(name))


def planner_names() -> list[str]:
    """Every name `make_planner` takes: the variants and every registered routing policy."""
    return sorted(set(policy_names()) | set(VARIANTS))


def moves_kv_with_a_link(name: str) -> bool:
    """Whether the planner or policy `name` copies KV between engines when it has a transfer
    path: a routing policy whose peer pulls (`moves_kv`), or a planner variant over such a
    policy that prefetches, replicates or pulls."""
    if name not in planner_names():
        return False
    settings = planner_settings(name)
    if not getattr(make_policy(settings.routing), "moves_kv", False):
        return False
    return name not in VARIANTS or settings.prefetch or settings.replicate or settings.pulls


class RequestState(enum.Enum):
    """Where one request is, from the planner's point of view."""

    QUEUED = "queued"
    """Admitted; not offered to the routing policy yet."""
    HELD = "held"
    """The policy keeps it at the gateway until load changes."""
    AWAITING_KV = "awaiting_kv"
    """Placed; waits for its prefix to arrive at the engine (a transfer) before it is sent."""
    DISPATCHED = "dispatched"
    """Sent to an engine; no first token yet."""
    PREFILLED = "prefilled"
    """Its engine is answering."""
    FINISHED = "finished"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.HELD, RequestState.DISPATCHED,
                                    RequestState.AWAITING_KV, RequestState.REJECTED,
                                    RequestState.CANCELLED}),
    RequestState.HELD: frozenset({RequestState.DISPATCHED, RequestState.AWAITING_KV,
                                  RequestState.REJECTED, RequestState.CANCELLED}),
    RequestState.AWAITING_KV: frozenset({RequestState.DISPATCHED, RequestState.CANCELLED}),
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
    segments: Segments | None = None
    """The prompt's segments, where a driver knows them better than the rules do; else (the
    gateway and the benchmark alike) the planner tags the call from its static lead and its
    workflow (`_tag`, `planner/segments.py`)."""
    static_blocks: int = 0
    """Leading blocks of system messages and tools, for the planner's own tagging."""

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
    foreign: int = 0
    """Requests the last scrape counted beyond the gateway's own in flight at that moment."""
    finished: int = 0
    """The gateway's requests that finished here (`Planner.finished_at`)."""


PACE = "pace"
"""The reason of a stall-free prefill's warm-ups (`Planner._pace`)."""

PACE_IN_ENGINE = "paced-in-engine"
"""The reason of the move that stands for a prompt its engine computes paced
(`PlannerSettings.pace_in_engine`): no action, it ends with the request's first token, and
calls that extend the prompt wait for it there as for any move bringing their prefix."""

PACE_MIN_BLOCKS = 2
"""A free piece shorter than this is not worth a warm-up's round trip: the request computes its
prompt in one go."""

PACE_SCHEDULE_TOKENS = 8192
"""`Dispatch.prefill_caps` re-sizes an engine-paced prompt's cap every this many tokens (of
2,048, 4,096 and 8,192, the one that lifted all three long rows' goodput over a single cap;
README, "Paced by the engine")."""


def paced_steps(start: int, end: int, cap: int, caps: tuple[tuple[int, int], ...]) -> int:
    """Steps an engine takes to compute a prompt's tokens `start` to `end` at `cap` tokens a
    step, then at each `(tokens, cap)` of `caps` from its tokens on (`Dispatch.prefill_caps`;
    a step's chunk is sized by where it begins)."""
    steps = 0
    at = start
    i = 0
    while at < end:
        while i < len(caps) and caps[i][0] <= at:
            cap = caps[i][1]
            i += 1
        at += cap
        steps += 1
    return steps


PACE_AHEAD_S = 0.001
"""A paced request's next piece is sent this long after the engine has begun the step that
computes the piece before it, so that it waits at the engine for the following step: a piece
sent only once the previous one has answered reaches a real engine after its next step has
begun (the answer's and the request's trips through the API server and the gateway) and waits
a whole step, which halves the pace."""

REPLICATE_BACKOFF_S = 30.0
"""After a replication copy from one engine to another fails, no other is tried between them for
this long (vLLM's default NIXL lease, which a failed copy's producer blocks may stay pinned for)."""

HOME_IDLE_S = 300.0
"""A workflow with no call for this long no longer counts as homed anywhere (hint-mode
workflows never say they are over)."""

LINEAGE_WORKFLOWS = 10_000
"""Workflows whose calls the planner remembers for segment tagging (least recent forgotten)."""
LINEAGE_HINT_TASKS = 256
"""Calls of a hint-mode workflow it remembers (the latest; each holds its prompt's keys)."""
LINEAGE_HINT_BLOCKS = 2_000_000
"""Prompt block keys the hint-mode workflows' remembered calls may hold together (about 90 MB;
the least recently called workflows are forgotten past it). Hint-mode workflows never end:
an agent's long session alone, 256 calls of 3,000-block prompts, holds 768,000."""


@dataclass
class _Lineage:
    keys: tuple[BlockKey, ...]
    expect_children: int
    children: int = 0
    route: RouteRequest | None = None
    """The task's call as dispatched, and where (a later join's prefetch copies its prompt)."""
    engine: str | None = None
    shared: bool = False
    """Its prompt holds a shared context (worth copying ahead)."""


@dataclass
class _Request:
    call: Call
    state: RequestState = RequestState.QUEUED
    outstanding: Outstanding | None = None
    segments: Segments = NO_SEGMENTS
    dispatch: Dispatch | None = None
    """While AWAITING_KV: the dispatch to send once its move ends."""
    move_id: str | None = None
    pace_next: MoveRecord | None = None
    """While paced: the piece sent ahead of the one the request waits for (`PACE_AHEAD_S`)."""
    admitted_s: float = 0.0

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
        release: str = "immediate",
        priorities: WorkflowPriorities | None = None,
        profile_of: Callable[[str], EngineProfile] | None = None,
        siblings: bool = False,
        link: TransferLink = NO_LINK,
        prefetch: bool = False,
        replicate: bool = False,
        pace: bool = False,
        pace_in_engine: bool = False,
        paced_engines: set[str] | None = None,
    ) -> None:
        if release not in ("immediate", "batch"):
            raise ValueError(f"unknown release policy {release!r}; known: immediate, batch")
        if release == "batch" and profile_of is None:
            raise ValueError("batch release needs the engines' profiles (profile_of)")
        self.policy = policy
        self.release_mode = release
        self.priorities = priorities
        """DAG priorities; None keeps admission order (and sends engines no priority)."""
        self._profile_of = profile_of
        self.siblings = siblings
        self._groups: dict[str, dict[str, tuple[str, float]]] = {}
        """Calls in flight per workflow (a sibling group): engine and predicted finish."""
        self._group_of: dict[str, str] = {}
        self._groups_at: dict[str, dict[str, int]] = {}
        """Per engine, its calls in flight per sibling group."""
        self._lineage: OrderedDict[str, dict[str, _Lineage]] = OrderedDict()
        """Per workflow (most recent last), each task's prompt keys and children: what segment
        tagging needs of a call's parents."""
        self._lineage_size: dict[str, int] = {}
        """Block keys each hint-mode workflow's remembered calls hold."""
        self._hint_blocks = 0
        """Their sum (at most LINEAGE_HINT_BLOCKS, but for the workflow called last)."""
        self._submitted: set[str] = set()
        """Workflows submitted whole (`WorkflowSubmitted`, until `WorkflowOver`): their task
        count is the spec's; a hint-mode workflow's grows with every call."""
        self._seq = 0
        self._order: dict[str, int] = {}
        self._batch = BatchRelease(profile_of) if profile_of is not None and release == "batch" \
            else None
        """The buffer and its interval under `batch` release (planner/release.py)."""
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
        self.moves_kv = bool(getattr(policy, "moves_kv", False))
        """The policy's peer moves KV (pulls; prefetch where the variant plans it)."""
        self.link = link
        self.moves = Moves(link)
        self.prefetch = prefetch and self.moves_kv and profile_of is not None
        self.replicate = replicate and self.moves_kv and link.enabled and profile_of is not None
        self.pace = pace and self.moves_kv and profile_of is not None
        """Stall-free prefill (`PlannerSettings.pace`)."""
        self.pace_in_engine = pace_in_engine
        """Paced by every engine (`PlannerSettings.pace_in_engine`), not in pieces."""
        self.paced_engines = paced_engines if paced_engines is not None else set()
        """Engines that pace a capped prompt themselves (`PolicyContext.paced_engines`): paced
        there with a cap whatever `pace_in_engine` says; the caller may add to it later."""
        self._paced_in_engine: dict[str, str] = {}
        """Requests paced by their engine: the move (`PACE_IN_ENGINE`) their prompt stands
        for until its first token."""
        self._pace_due: dict[str, float] = {}
        """Paced requests whose next piece goes out ahead at this time (`PACE_AHEAD_S`)."""
        self._assumed: dict[str, float] = {}
        """Calls that do not stream, at their engines: when their prompt is taken as computed
        (their placement's estimate of queue and prefill), since their first token is seen
        only with their whole answer. Counted as prefilling until then, such calls held an
        engine's prefill budget for their whole decode."""
        self._wakeup_moved = False
        """A paced piece fell due at a new time since the last `release`: the driver must
        look at `next_wakeup` again (through `pending`), or the piece waits for an event."""
        self.static_demand = StaticDemand()
        self._static_of: dict[str, dict[str, str]] = {}
        """Per submitted workflow, its tasks' static segment names (replication demand)."""
        self._children: dict[str, dict[str, int]] = {}
        """Per submitted workflow, each task's number of children (what prefetch plans for)."""
        self._joins: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {}
        """Per submitted workflow, its joins that extend one parent's prompt: their parents
        and that parent (prefetched once every parent answers)."""
        self._started: dict[str, set[str]] = {}
        """Per workflow with such joins, its tasks that have produced a first token."""
        self._ready: list[Action] = []
        """Actions decided on an event, handed out at the next `release`."""
        self._homes: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """Workflows in flight (least recently dispatched first): the engine of their latest
        call, and when it was sent."""
        self._homed: dict[str, int] = {}
        """Per engine, how many of `_homes` point at it."""
        self._replica_backoff: dict[tuple[str, str], float] = {}
        """(source, destination) pairs whose replication copy failed, and until when no other
        is tried there (`REPLICATE_BACKOFF_S`)."""

    # -- what drivers may read ------------------------------------------------------------------

    def views(self, exclude: frozenset[str] = frozenset()) -> list[EngineView]:
        """Immutable snapshots of every engine (but `exclude`), in the order they joined."""
        return [
            EngineView(
                name=e.name, healthy=e.healthy, models=e.models, num_running=e.num_running,
                num_waiting=e.num_waiting, kv_usage=e.kv_usage, in_flight=e.load.in_flight,
                prefilling=e.load.prefilling,
                queued_prefill_tokens=e.load.queued_prefill_tokens,
                active_blocks=e.load.active_blocks, block_size=self._block_size_of(e.name),
                foreign=e.foreign, homed_workflows=self._homed.get(e.name, 0),
                grouped=sum(groups.values()), groups=len(groups))
            for e in self.engines.values() if e.name not in exclude
            for groups in (self._groups_at.get(e.name, {}),)
        ]

    def models(self) -> list[str]:
        """Models served by at least one healthy engine, sorted."""
        return sorted({m for e in self.engines.values() if e.healthy for m in e.models})

    def finished_at(self, engine: str) -> int | None:
        """How many of the gateway's requests have finished at `engine` (None: not in the
        pool). A driver whose scrapes take a while reads it when it sends one and returns it
        in `EngineScraped.finished_before`."""
        rec = self.engines.get(engine)
        return rec.finished if rec is not None else None

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
        return (bool(self._queued) or bool(self._ready) or self._wakeup_moved
                or (self._load_changed and bool(self._held or self.buffered)))

    @property
    def wants_workflows(self) -> bool:
        """The planner uses whole DAGs (`WorkflowSubmitted`): for priorities, prefetch or the
        replication demand they announce."""
        return self.priorities is not None or self.prefetch or self.replicate

    @property
    def buffered(self) -> int:
        """Requests waiting in the gateway's buffer (batch release)."""
        return len(self._batch) if self._batch is not None else 0

    # -- the interface --------------------------------------------------------------------------

    def admit(self, call: Call, now: float) -> None:
        """A request is ready to be placed (at the next `release`)."""
        rid = call.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already in flight")
        req = self._requests[rid] = _Request(call, segments=self._tag(call), admitted_s=now)
        if self.replicate:
            self._replicate(req, now)
        self._queued.append(rid)
        self._order[rid] = self._seq
        self._seq += 1

    def on_event(self, event: Event, now: float) -> None:
        """Something happened at an engine or a client."""
        match event:
            case FirstToken(request_id=rid, observed=observed):
                if self._paced_in_engine:
                    self._paced_over(rid, True, now)
                self._assumed.pop(rid, None)
                req = self._requests.get(rid)
                if req is None or req.outstanding is None:
                    return
                self._prefilled(req, rid, now, observed)
            case Finished(request_id=rid, output_tokens=tokens, error=error):
                if self._paced_in_engine:
                    self._paced_over(rid, False, now)
                self._assumed.pop(rid, None)
                waiting = self._requests.get(rid)
                if waiting is not None and waiting.state is RequestState.AWAITING_KV:
                    # Its engine was never told (it waited for a move): a withdrawal, as a
                    # cancel is. It used to be dropped with its load entry left open for good.
                    self.on_event(Cancelled(rid), now)
                    return
                req = self._requests.pop(rid, None)
                if req is None:
                    return
                self._order.pop(rid, None)
                if req.outstanding is None:
                    self._withdraw(req)
                    return
                req.move(RequestState.FINISHED)
                self._leave_group(rid)
                if self.priorities is not None:
                    # A failed attempt's tokens are service the workflow had, but its task is
                    # not done: it may be retried, and its path still lies ahead.
                    hints = req.call.hints
                    self.priorities.task_done(hints.workflow,
                                              hints.task if error is None else None, tokens)
                if close_dispatch(req.outstanding):
                    rec = self.engines.get(req.outstanding.engine)
                    if rec is not None and rec.load is req.outstanding.load:
                        rec.finished += 1  # counted against this ledger (not a rejoined one)
                    self.policy.on_finish(rid, req.outstanding.engine, now, tokens)
                    self._load_changed = True
            case Cancelled(request_id=rid):
                self._assumed.pop(rid, None)
                req = self._requests.get(rid)
                if req is None:
                    return
                if req.state is RequestState.AWAITING_KV:
                    # Placed, its engine not yet told: undo what the placement counted.
                    outstanding = req.outstanding
                    self._stop_waiting(req)
                    del self._requests[rid]
                    self._order.pop(rid, None)
                    self._leave_group(rid)
                    if outstanding is not None:
                        self.policy.on_finish(rid, outstanding.engine, now, 0)
                        self._load_changed = True
                    req.move(RequestState.CANCELLED)
                    return
                if req.outstanding is not None:
                    raise IllegalTransition(f"request {rid!r} is at an engine already: report "
                                            "its end with Finished")
                del self._requests[rid]
                self._order.pop(rid, None)
                self._withdraw(req)
            case WorkflowSubmitted(workflow=wf, tasks=tasks):
                if self.priorities is not None:
                    self.priorities.submit(wf, tasks)
                opening = {t.task: t.static_segment for t in tasks}
                self._submitted.add(wf)
                if self.prefetch:
                    children: dict[str, int] = {}
                    for t in tasks:
                        # A join's prompt extends several parents: no one parent's prompt
                        # is its prefix, so only single-parent children are counted; and a
                        # sub-agent of another kind (another static segment) starts afresh.
                        # A tree node that runs after its whole path (it quotes every
                        # ancestor) is not counted either: counting it by its nearest parent
                        # was measured (2026-11-28, README "Eleventh session") to copy
                        # contexts its children are then not placed beside.
                        if len(t.after) == 1 and opening.get(t.after[0]) == t.static_segment:
                            children[t.after[0]] = children.get(t.after[0], 0) + 1
                    self._children[wf] = children
                    joins: dict[str, tuple[tuple[str, ...], str]] = {}
                    for t in tasks:
                        # A join that opens like exactly one of its parents extends that
                        # parent's prompt (a reduce after sub-agents of another kind).
                        kin = [q for q in t.after if opening.get(q) == t.static_segment]
                        if len(t.after) > 1 and t.static_segment and len(kin) == 1:
                            joins[t.task] = (t.after, kin[0])
                    if joins:
                        self._joins[wf] = joins
                        self._started[wf] = set()
                if self.replicate:
                    # A task that opens with its parent's static segment extends the parent's
                    # context and is placed by it (pulls, prefetch); demand for the segment
                    # alone comes from root tasks and from sub-agents of another kind.
                    named = {t.task: t.static_segment for t in tasks if t.static_segment
                             and all(opening.get(p) != t.static_segment for p in t.after)}
                    if named:
                        counts: dict[str, int] = {}
                        for name in named.values():
                            counts[name] = counts.get(name, 0) + 1
                        self.static_demand.expect(wf, counts)
                        self._static_of[wf] = named
            case TransferDone(move_id=mid):
                self._move_over(mid, ok=True, now=now)
            case TransferFailed(move_id=mid):
                self._move_over(mid, ok=False, now=now)
            case WorkflowOver(workflow=wf):
                self._unhome(wf)
                self._children.pop(wf, None)
                self._joins.pop(wf, None)
                self._started.pop(wf, None)
                if self._static_of.pop(wf, None) is not None:
                    self.static_demand.forget(wf)
                self._forget_lineage(wf)
                self._submitted.discard(wf)
                if self.priorities is not None:
                    self.priorities.forget(wf)
            case EngineJoined(engine=name, healthy=healthy, models=models):
                if name in self.engines:
                    raise ValueError(f"engine {name!r} is already in the pool")
                self.engines[name] = EngineRecord(name, healthy, models)
                self._known_models |= models
                self._load_changed = True
            case EngineLeft(engine=name):
                self.engines.pop(name, None)
                # Moves from or to it will not land: their waiters go now (those placed on
                # it, to be sent elsewhere by their driver) rather than at the move's deadline.
                for record in self.moves:
                    a = record.action
                    if record.destination == name or (isinstance(a, Transfer)
                                                       and a.source == name):
                        self._move_over(a.move_id, ok=False, now=now)
                # Workflows last sent there have no home now (one that rejoins under the name
                # starts with none homed on it).
                for wf in [w for w, (e, _) in self._homes.items() if e == name]:
                    self._unhome(wf)
                self._homed.pop(name, None)
                if self._batch is not None:
                    self._batch.forget_engine(name)
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
                # Requests of the gateway's that finished while the scrape was on its way may
                # still be counted in it: they are not other clients' load.
                late = (max(0, rec.finished - event.finished_before)
                        if event.finished_before is not None else 0)
                rec.foreign = max(0, event.num_running + event.num_waiting
                                  - rec.load.in_flight - late)
                self._load_changed = True

    def release(self, now: float) -> list[Action]:
        """What to do now (see the module docstring for each release policy)."""
        if self._assumed:
            for rid in [r for r, t in self._assumed.items() if t <= now]:
                del self._assumed[rid]
                req = self._requests.get(rid)
                if req is not None and req.outstanding is not None:
                    self._prefilled(req, rid, now, observed=False, estimated=True)
        actions = self._release(now)
        for a in actions:
            if isinstance(a, Dispatch):
                self._assume_prefill(a, now)
        return actions

    def _assume_prefill(self, d: Dispatch, now: float) -> None:
        """A call that does not stream goes out: when to take its prompt as computed."""
        req = self._requests.get(d.request_id)
        if req is None or req.call.route.streams or req.outstanding is None:
            return
        if d.cost is not None:
            done = now + d.cost.queue_s + d.cost.prefill_s
        elif self._profile_of is not None:
            done = now + self._profile_of(d.engine).prefill_time(
                req.outstanding.uncached_tokens, d.cached_tokens)
        else:
            return
        self._assumed[d.request_id] = done

    def _prefilled(self, req: _Request, rid: str, now: float, observed: bool,
                   estimated: bool = False) -> None:
        """The request's prompt is in (its first token came, or, for a call that does not
        stream, its estimate says so): the engine's prefill ledger lets it go, and what
        waits for it (prefetches to its children) may start."""
        assert req.outstanding is not None
        if prefill_done(req.outstanding):
            req.move(RequestState.PREFILLED)
            if self._batch is not None and not estimated:
                self._batch.observe_step(req.outstanding, now)
            if observed:
                self.policy.on_first_token(rid, req.outstanding.engine, now)
            self._load_changed = True
            if self.prefetch:
                self._plan_prefetch(req, now)
                self._plan_join_prefetch(req, now)

    def _release(self, now: float) -> list[Action]:
        ready: list[Action] = []
        if self._ready:
            ready, self._ready = self._ready, []
        if self.moves:
            for record in self.moves.overdue(now):
                self.moves.stats.late += 1
                self._dispatch_waiters(record, ready)
        if self._pace_due:
            for rid in [r for r, t in self._pace_due.items() if t <= now]:
                del self._pace_due[rid]
                self._pace_ahead(rid, now, ready)
        if self._batch is not None:
            actions = ready + self._release_batch(self._batch, now)
            self._wakeup_moved = False  # the driver reads `next_wakeup` after each release
            return actions
        actions = ready
        if self._load_changed:
            self._load_changed = False
            if self._held:
                self._held.release(lambda rid: self._offer(rid, now, actions),
                                   lambda rid: self._requests[rid].call.route.model)
        if self._queued:
            queued, self._queued = self._queued, []
            for rid in queued:
                if not self._offer(rid, now, actions):
                    self._requests[rid].move(RequestState.HELD)
                    self._held.hold(rid, rid)
        self._wakeup_moved = False
        return actions

    def next_wakeup(self) -> float | None:
        """When `release` must run again without an event: the next batch interval while
        requests wait in the buffer (`batch` release), the deadline of a move requests wait
        for (they stop waiting then), a paced piece's due time, and when a call that does not
        stream is taken as prefilled."""
        wake = self._batch.wakeup if self._batch is not None else None
        for record in self.moves:
            if record.waiters:
                d = record.deadline()
                wake = d if wake is None or d < wake else wake
        if self._pace_due:
            d = min(self._pace_due.values())
            wake = d if wake is None or d < wake else wake
        if self._assumed:
            d = min(self._assumed.values())
            wake = d if wake is None or d < wake else wake
        return wake

    # -- batch release (SBS) --------------------------------------------------------------------

    def _release_batch(self, batch: BatchRelease, now: float) -> list[Action]:
        if not (self._queued or batch.due(now) or (self._load_changed and batch.buffer)):
            return []
        self._load_changed = False
        ranked = batch.buffer + self._queued
        self._queued = []
        order = self._order
        if self.priorities is not None:
            rank = self.priorities.rank
            reqs = self._requests
            ranked.sort(key=lambda r: (rank(reqs[r].call.hints, now - reqs[r].admitted_s),
                                       order[r]))
        actions: list[Action] = []
        batch.release(
            ranked, lambda rid: self._offer(rid, now, actions, batch=batch, fresh=True),
            now, next(iter(self.engines), ""))
        return actions

    # -- placing --------------------------------------------------------------------------------

    def _offer(self, rid: str, now: float, actions: list[Action],
               views: list[EngineView] | None = None,
               batch: BatchRelease | None = None,
               fresh: bool = False) -> bool:
        """Let the policy place one request (among `views`, else every engine but those the
        request excludes); False if it holds it, or if under `batch` release neither the
        engine it chose nor a stand-in (`BatchRelease.stand_ins`) can take it yet (the
        policy's `choose` must then be free of side effects, as the cost model's is)."""
        req = self._requests[rid]
        route = req.call.route
        if views is None:
            views = self.views(req.call.exclude)
        if fresh and self._batch is not None:
            route = self._batch.with_recent_placements(route, now)
        group = self._sibling_group(req.call.hints)
        if group is not None:
            members = self._groups.get(group)
            if members:
                at: dict[str, int] = {}
                for engine_name, _ in members.values():
                    at[engine_name] = at.get(engine_name, 0) + 1
                finish = max(f for _, f in members.values())
                route = replace(route, group_finish_s=max(0.0, finish - now), group_at=at)
        hints = req.call.hints
        if hints.workflow is not None:
            self._expire_homes(now)
            if not hints.after and hints.workflow not in self._homes:
                route = replace(route, workflow_root=True)
        if self.moves_kv and len(self.moves):
            arriving = self.moves.arriving(route.block_keys, now)
            busy = self.moves.nic_wait(now)
            if arriving or busy:
                route = replace(route, arriving=arriving, link_wait=busy)
        reason: str | None = None
        try:
            choice = self.policy.choose(route, views, now)
        except Hold:
            return False
        except NoEngineAvailable as e:
            reason = e.reason
        except (ArithmeticError, ValueError) as e:
            # A call the cost model cannot price (a length beyond any float: the gateway bounds
            # what it passes, but a driver might not) is refused alone, not left in the buffer
            # to fail every release after it.
            reason = f"the planner could not price this call: {type(e).__name__}: {e}"
        if reason is not None:
            del self._requests[rid]
            self._order.pop(rid, None)
            req.move(RequestState.REJECTED)
            actions.append(Reject(rid, route.model, reason,
                                  route.model in self._known_models, tuple(self.models())))
            return True
        placement = placement_of(choice)
        engine = placement.engine
        if batch is not None:
            chosen = next(v for v in views if v.name == engine)
            if not batch.fits(route, chosen):
                # Work-conserving: an engine that can take the call now and holds about as
                # much of its prompt, the best of them by the policy, rather than the buffer.
                stand_ins = batch.stand_ins(route, chosen, views)
                if not stand_ins:
                    return False
                try:
                    placement = placement_of(self.policy.choose(route, stand_ins, now))
                except (Hold, NoEngineAvailable):
                    return False
                engine = placement.engine
        rec = self.engines[engine]
        wait = self._kv_move_for(rid, route, placement, now, actions)
        prefill_cap = 0
        prefill_caps: tuple[tuple[int, int], ...] = ()
        if wait is None and self.pace:
            held = req.call.route.matches.get(engine)
            held_blocks = held.blocks if held is not None else 0
            if self.pace_in_engine or engine in self.paced_engines:
                free = self._pace_blocks(route, engine, held_blocks)
                if free:
                    prefill_cap = free * route.block_size
                    prefill_caps = self._pace_in_engine(rid, route, engine, held_blocks, free,
                                                        now)
            else:
                wait = self._pace(rid, route, engine, held_blocks, now, actions)
        placed_route = route
        if wait is not None:
            # The ledger counts the prefix as held there: it will be by the time it runs.
            n = common_prefix(route.block_keys, wait.keys)
            m = route.matches.get(engine)
            if m is None or m.blocks < n:
                placed_route = replace(route, matches={**route.matches, engine: EngineMatch(
                    engine, n, n, float(n))})
        req.outstanding = open_dispatch(placed_route, engine, rec.load,
                                        self._block_size_of(engine))
        if hints.workflow is not None:
            self._home(hints.workflow, engine, now)
        if hints.workflow in self._joins and hints.task is not None:
            # Only a workflow with such joins keeps its calls (a join's prefetch copies one).
            known = self._lineage.get(hints.workflow or "", {}).get(hints.task)
            if known is not None:
                known.route, known.engine = placed_route, engine
                known.shared = req.segments.blocks_of("shared") > 0
        self.policy.on_dispatch(route, placement, now)
        if group is not None:
            finish = now + (placement.cost.total_s if placement.cost is not None else 0.0)
            self._groups.setdefault(group, {})[rid] = (engine, finish)
            self._group_of[rid] = group
            at_engine = self._groups_at.setdefault(engine, {})
            at_engine[group] = at_engine.get(group, 0) + 1
        ttl = self.speculative_ttl_s
        if self._batch is not None and route.block_keys:
            self._batch.placed(now, engine, route.block_keys)
        priority = (self.priorities.engine_priority(req.call.hints, now - req.admitted_s)
                    if self.priorities is not None else None)
        dispatch = Dispatch(
            rid, engine, req.outstanding.cached_tokens, placement.cost,
            # A prompt its engine paces is announced by its KV events as it is computed: a
            # call that extends it waits for its move (`PACE_IN_ENGINE`) rather than taking
            # the blocks still to come as held and computing them beside it.
            route.block_keys if ttl > 0 and not prefill_cap else (), ttl, priority,
            req.segments, placement.runners_up, prefill_cap, prefill_caps)
        if wait is not None:
            req.move(RequestState.AWAITING_KV)
            req.dispatch = replace(dispatch, kv_move=wait.action.reason)
            req.move_id = wait.action.move_id
            wait.waiters.append(rid)
            if wait.action.reason == PACE:
                # Its engine begins the piece's step within a step from now (a piece already
                # late is due now: a past due time made `next_wakeup` lie in the past).
                self._pace_due[rid] = max(now, wait.eta) + PACE_AHEAD_S
                self._wakeup_moved = True
        else:
            req.move(RequestState.DISPATCHED)
            actions.append(dispatch)
        return True

    # -- KV movement ----------------------------------------------------------------------------

    def _kv_move_for(self, rid: str, route: RouteRequest, placement: Placement, now: float,
                     actions: list[Action]) -> MoveRecord | None:
        """The move the request must wait for at its engine: a pull its placement asks for
        (started here), or a move in flight that brings more of its prefix than the engine
        holds (a prefetch); None to dispatch at once."""
        engine = placement.engine
        if not self.moves_kv:
            return None
        # What the engine holds by the index, not by the recent-placements overlay: a sibling
        # placed there a moment ago may itself be waiting for this prefix to arrive.
        held = self._requests[rid].call.route.matches.get(engine)
        held_blocks = held.blocks if held is not None else 0
        pull = placement.pull
        if pull is not None and self.link.enabled and pull.source != engine:
            blocks = min(len(route.block_keys), pull.tokens // max(1, route.block_size))
            if blocks > held_blocks:
                record = self.moves.covering(engine, route.block_keys, blocks, now)
                if record is not None:
                    return record
                keys = route.block_keys[:blocks]
                record = self._start_transfer(pull.source, engine, rid, keys, route.block_size,
                                              held_blocks, pull.reason, now, actions)
                if pull.reason == "disaggregate" and pull.source in self.engines:
                    # The source computes the prompt first: its ledger carries that prefill
                    # until the move ends, and the move lands after it.
                    record.source_load = open_dispatch(
                        route, pull.source, self.engines[pull.source].load,
                        self._block_size_of(pull.source))
                    cost = placement.cost
                    if cost is not None:
                        record.eta = max(record.eta, now + cost.queue_s + cost.prefill_s
                                         + cost.transfer_s)
                return record
        arriving = route.arriving.get(engine)
        if arriving is not None and arriving[0] > held_blocks:
            return self.moves.covering(engine, route.block_keys, arriving[0], now)
        return None

    def _start_transfer(self, source: str, destination: str, origin: str,
                        keys: tuple[BlockKey, ...], block_size: int, held_blocks: int,
                        reason: str, now: float, actions: list[Action]) -> MoveRecord:
        assert self._profile_of is not None
        per_token = self._profile_of(destination).kv_bytes_per_token
        num_bytes = max(0, len(keys) - held_blocks) * block_size * per_token
        action: Move = Transfer(self.moves.new_id(), source, destination, origin,
                                len(keys) * block_size, keys, num_bytes, reason)
        eta = self.moves.transfer_eta(source, destination, num_bytes, now)
        actions.append(action)
        profile = self._profile_of(destination)
        recompute = profile.prefill_time(max(0, len(keys) - held_blocks) * block_size,
                                         held_blocks * block_size)
        return self.moves.start(action, now, eta, recompute)

    def _plan_prefetch(self, req: _Request, now: float) -> None:
        """A task with several children is answering: copy its prompt (the context its
        children extend) to the engines the policy plans them on, overlapped with its decode."""
        hints = req.call.hints
        out = req.outstanding
        if hints.workflow is None or hints.task is None or out is None:
            return
        children = self._children.get(hints.workflow, {}).get(hints.task, 0)
        if hints.expect_children is not None:
            children = max(children, hints.expect_children)
        planner_fn = getattr(self.policy, "plan_prefetch", None)
        route = req.call.route
        # Single-parent children extend the parent's whole prompt (its generation prompt's
        # block may differ, so the last block stays behind). Only a parent with a shared
        # context prefetches: a static prompt alone is every workflow's, and a prompt
        # without a lasting part is cheap to recompute.
        segments = req.segments
        keys = route.block_keys[:-1]
        if (children < 2 or planner_fn is None or not keys
                or segments.blocks_of("shared") == 0):
            return
        try:
            destinations: list[str] = planner_fn(route, children, self.views(), now,
                                                 holder=out.engine)
        except NoEngineAvailable:
            return  # best effort: no engine to copy to now (none healthy serves the model)
        self._copy_ahead(route, keys, out.engine, destinations, now)

    def _plan_join_prefetch(self, req: _Request, now: float) -> None:
        """Every parent of a join that extends one of them has answered: the join is one step
        from ready. Copy that parent's prompt to where the policy plans the join, overlapped
        with the parents' decode (the parent itself may be long over: its engine keeps the
        prompt in its prefix cache, and the driver its token ids)."""
        wf, task = req.call.hints.workflow, req.call.hints.task
        joins = self._joins.get(wf) if wf is not None else None
        if wf is None or task is None or not joins:
            return
        started = self._started[wf]
        started.add(task)
        planner_fn = getattr(self.policy, "plan_prefetch", None)
        lineage = self._lineage.get(wf, {})
        for join, (after, anchor) in list(joins.items()):
            if task not in after or not started.issuperset(after):
                continue
            del joins[join]
            known = lineage.get(anchor)
            if (planner_fn is None or known is None or known.route is None
                    or known.engine is None or not known.shared):
                continue
            route = known.route
            try:
                destinations: list[str] = planner_fn(route, 1, self.views(), now,
                                                     holder=known.engine)
            except NoEngineAvailable:
                continue  # best effort, as above
            self._copy_ahead(route, route.block_keys[:-1], known.engine, destinations, now)

    def _copy_ahead(self, route: RouteRequest, keys: tuple[BlockKey, ...], source: str,
                    destinations: list[str], now: float) -> None:
        """Copy `keys` of `route`'s prompt from `source` to each destination that lacks them
        (by a transfer, or a recompute warm-up without a link)."""
        bs = route.block_size
        for dest in dict.fromkeys(destinations):
            if dest == source or dest not in self.engines:
                continue
            held = route.matches.get(dest)
            held_blocks = held.blocks if held is not None else 0
            if held_blocks >= len(keys) or self.moves.covering(dest, keys, len(keys), now):
                continue
            if self.link.enabled:
                self._start_transfer(source, dest, route.request_id, keys, bs, held_blocks,
                                     "prefetch", now, self._ready)
            else:
                assert self._profile_of is not None
                profile = self._profile_of(dest)
                warm = warm_of(self.moves.new_id(), dest, route.request_id, keys, bs,
                               "prefetch")
                eta = now + profile.prefill_time((len(keys) - held_blocks) * bs,
                                                 held_blocks * bs)
                self._ready.append(warm)
                self.moves.start(warm, now, eta, eta - now)

    def _pace(self, rid: str, route: RouteRequest, engine: str, held_blocks: int, now: float,
              actions: list[Action]) -> MoveRecord | None:
        """Stall-free prefill (`PlannerSettings.pace`): the warm-up of the next piece of the
        request's prompt at `engine`, which holds its first `held_blocks`, when the rest is
        more than one step of the engine's decode batch computes for free; None to send the
        request now (an idle engine has no decode to stall; a compute-bound step has nothing
        free). The request waits for the piece; a piece that fails or is late sends it as it
        is, to compute the rest itself."""
        free = self._pace_blocks(route, engine, held_blocks)
        if not free:
            return None
        assert self._profile_of is not None
        bs = route.block_size
        end = held_blocks + free
        warm = warm_of(self.moves.new_id(), engine, rid, route.block_keys[:end], bs, PACE)
        actions.append(warm)
        batch, context = self._decode_batch(engine, bs)
        step = self._profile_of(engine).decode_step_time(batch + 1, context)
        return self.moves.start(warm, now, now + step, step)

    def _decode_batch(self, engine: str, block_size: int) -> tuple[int, int]:
        """The sequences decoding at `engine` by the ledger (and the last scrape), and their
        mean context in tokens."""
        rec = self.engines[engine]
        load = rec.load
        batch = load.in_flight - load.prefilling + rec.foreign
        return batch, load.active_blocks * block_size // max(1, load.in_flight)

    def _pace_in_engine(self, rid: str, route: RouteRequest, engine: str, held_blocks: int,
                        free: int, now: float) -> tuple[tuple[int, int], ...]:
        """The request goes to `engine` with a cap of `free` blocks per step, lowered further
        in (the schedule returned, `Dispatch.prefill_caps`: the free piece of the engine's
        decode batch at each `PACE_SCHEDULE_TOKENS` of the prompt past its first
        `held_blocks`, where it differs from the one before; a token further into a prompt
        attends to more, so fewer ride free in a step). Its prompt is a move in flight there
        (no action) until its first token, so that a call extending it waits for it rather
        than computing the same blocks beside it, as a call waits for a piece of a prompt
        paced by warm-ups."""
        assert self._profile_of is not None
        self._paced_over(rid, False, now)  # a retry elsewhere: the earlier attempt's is over
        bs = route.block_size
        warm = warm_of(self.moves.new_id(), engine, rid, route.block_keys, bs, PACE_IN_ENGINE)
        batch, context = self._decode_batch(engine, bs)
        profile = self._profile_of(engine)
        caps: list[tuple[int, int]] = []
        cap = free * bs
        at = held_blocks * bs + PACE_SCHEDULE_TOKENS
        while at < route.prompt_tokens:
            piece = max(PACE_MIN_BLOCKS * bs,
                        profile.free_prefill_tokens(batch, context, at, granule=bs))
            if piece != cap:
                caps.append((at, piece))
                cap = piece
            at += PACE_SCHEDULE_TOKENS
        steps = paced_steps(held_blocks * bs, len(route.block_keys) * bs, free * bs,
                            tuple(caps))
        eta = now + steps * profile.decode_step_time(batch + 1, context)
        recompute = profile.prefill_time((len(route.block_keys) - held_blocks) * bs,
                                         held_blocks * bs)
        self.moves.start(warm, now, eta, recompute)
        self._paced_in_engine[rid] = warm.move_id
        return tuple(caps)

    def _paced_over(self, rid: str, ok: bool, now: float) -> None:
        """A request paced by its engine has its first token (`ok`) or ended without one."""
        move_id = self._paced_in_engine.pop(rid, None)
        if move_id is not None:
            self._move_over(move_id, ok, now)

    def _pace_blocks(self, route: RouteRequest, engine: str, held_blocks: int) -> int:
        """The blocks of the request's prompt past its first `held_blocks` that one step of
        `engine`'s decode batch computes for free (`EngineProfile.free_prefill_tokens`), when
        its prompt is longer than that; 0 to compute the prompt in one go (an idle engine has
        no decode to stall; a compute-bound step has nothing free)."""
        if engine not in self.engines or self._profile_of is None or not route.block_keys:
            return 0
        bs = route.block_size
        batch, context = self._decode_batch(engine, bs)
        if batch <= 0 or route.prompt_tokens - held_blocks * bs <= bs:
            return 0
        profile = self._profile_of(engine)
        free = profile.free_prefill_tokens(batch, context, held_blocks * bs, granule=bs) // bs
        end = held_blocks + free
        # The last piece goes with the request itself (its last block may be partial).
        if free < PACE_MIN_BLOCKS or route.prompt_tokens - end * bs <= 0 \
                or end >= len(route.block_keys):
            return 0
        return free

    def _pace_ahead(self, rid: str, now: float, actions: list[Action]) -> None:
        """Send a paced request's next piece ahead (`PACE_AHEAD_S`): the prefix one free piece
        past the piece it waits for, which its engine computes in the step before."""
        req = self._requests.get(rid)
        if (req is None or req.state is not RequestState.AWAITING_KV or req.move_id is None
                or req.pace_next is not None):
            return
        current = self.moves.get(req.move_id)
        if current is None or current.action.reason != PACE or current.action.origin != rid:
            # Another call's chain (this call waits on its piece): its origin sends the next
            # piece, which this call then waits on (`_dispatch_waiters`).
            return
        route = req.call.route
        held = common_prefix(route.block_keys, current.keys)
        req.pace_next = self._pace(rid, route, current.destination, held, now, actions)

    def _replicate(self, req: _Request, now: float) -> None:
        """Count the call's static segment as demanded, and copy it to one more engine if
        fewer hold it than its share of demand calls for (planner/replication.py)."""
        first = req.segments.ranges[0] if req.segments.ranges else None
        route = req.call.route
        static = first is not None and first.kind == "static"
        keys = route.block_keys[:first.end] if first is not None and static else ()
        hints = req.call.hints
        if hints.workflow is not None and hints.task is not None:
            name = self._static_of.get(hints.workflow, {}).get(hints.task)
            if name is not None:
                self.static_demand.admitted(hints.workflow, name, keys)
        if len(keys) < REPLICATE_MIN_BLOCKS:
            return
        self.static_demand.observe(keys, now)
        views = [v for v in self.views() if v.healthy and route.model in v.models]
        if not views or len(keys) * route.block_size < self._replicate_min_tokens(views):
            return
        wanted = self.static_demand.replicas(keys, len(views), now)
        holders = {name for name, m in route.matches.items() if m.confirmed_blocks >= len(keys)}
        coming = {r.destination for r in self.moves if common_prefix(keys, r.keys) >= len(keys)}
        have = {v.name for v in views} & (holders | coming)
        if not holders or len(have) >= wanted:
            return
        load = {v.name: v.fresh_load for v in views}
        sources = [n for n in holders if n in load]
        backoff = self._replica_backoff

        def open_pair(src: str, dst: str) -> bool:
            return backoff.get((src, dst), -math.inf) <= now

        lacking = [v.name for v in views
                   if v.name not in have and any(open_pair(n, v.name) for n in sources)]
        if not lacking:
            return
        dest = min(lacking, key=lambda n: (load[n], n))
        source = min((n for n in sources if open_pair(n, dest)), key=lambda n: (load[n], n))
        self._start_transfer(source, dest, route.request_id, keys, route.block_size, 0,
                             "replicate", now, self._ready)

    def _replicate_min_tokens(self, views: list[EngineView]) -> int:
        """The shortest static segment worth copying: one full prefill step of the pool's
        smallest (`max_num_batched_tokens`). A shorter one is recomputed within a share of one
        step wherever a call lands, while a copy takes a step at both ends and draws later
        calls to where the copy is rather than to where their workflow's context is. Measured
        (2026-11-26, 8 x h100x4-llama3-70b, RDMA, 32k contexts, 4 agent types with 3-4k-token
        system prompts, goodput at the default SLO): copying them read 0.403 / 1.482
        workflows/s on tree-long / debate-long against 0.416 / 1.606 without (fanout-long
        0.700 either way); sub-agents with 16k-token prompts of their own still gain from
        copies (fanout-long, `worker_types=4 worker_static_tokens=16000`, 0.8 wf/s: 21.96 s
        mean JCT with them, 22.53 s without)."""
        assert self._profile_of is not None
        return min(self._profile_of(v.name).max_num_batched_tokens for v in views)

    def _move_over(self, move_id: str, ok: bool, now: float) -> None:
        record = self.moves.end(move_id, ok)
        if record is None:
            return
        a = record.action
        if not ok and a.reason == "replicate" and isinstance(a, Transfer):
            # Not that pair again for a while: each try runs the producer leg, whose blocks
            # stay pinned for the lease when no consumer reads them.
            self._replica_backoff[(a.source, a.destination)] = now + REPLICATE_BACKOFF_S
            if len(self._replica_backoff) > 4096:
                self._replica_backoff = {k: t for k, t in self._replica_backoff.items()
                                         if t > now}
        if record.source_load is not None:
            close_dispatch(record.source_load)
        self._dispatch_waiters(record, self._ready, now if ok else None)
        self._load_changed = True

    def _dispatch_waiters(self, record: MoveRecord, actions: list[Action],
                          now: float | None = None) -> None:
        """Send the requests that waited for a move (done, failed or late: a request whose
        prefix did not arrive recomputes it). With `now` (the move is done), a paced request
        whose rest is still more than a free piece waits for its next piece instead."""
        for rid in record.waiters:
            req = self._requests.get(rid)
            if req is None or req.state is not RequestState.AWAITING_KV:
                continue
            assert req.dispatch is not None
            if now is not None and record.action.reason == PACE:
                route = req.call.route
                held = common_prefix(route.block_keys, record.keys)
                tokens = min(held * route.block_size, route.prompt_tokens - 1)
                if req.outstanding is not None:
                    computed_ahead(req.outstanding, tokens)
                if tokens > req.dispatch.cached_tokens:
                    req.dispatch = replace(req.dispatch, cached_tokens=tokens)
                ahead, req.pace_next = req.pace_next, None
                if ahead is not None and self.moves.get(ahead.action.move_id) is ahead:
                    # The piece sent ahead is at the engine and begins now, in the step
                    # after this one: the one after it can go out.
                    following: MoveRecord | None = ahead
                    self._pace_due[rid] = now + PACE_AHEAD_S
                    self._wakeup_moved = True
                else:
                    # A piece another call's chain sends further into this prompt at that
                    # engine (a sibling's, or the one this call waited on) is waited for, not
                    # computed again beside it: each waiter of a piece used to start a chain
                    # of its own over the same blocks.
                    following = self.moves.covering(record.destination, route.block_keys,
                                                    held + 1, now)
                    if following is None:
                        following = self._pace(rid, route, record.destination, held, now,
                                               actions)
                    if following is not None:
                        self._pace_due[rid] = max(now, following.eta) + PACE_AHEAD_S
                        self._wakeup_moved = True
                if following is not None:
                    following.waiters.append(rid)
                    req.move_id = following.action.move_id
                    continue
            self._pace_due.pop(rid, None)
            req.pace_next = None
            if now is None and record.action.reason != PACE and req.outstanding is not None:
                # The prefix did not arrive: the engine computes it, and neither the ledger
                # nor the dispatch may count it as found there.
                engine = req.outstanding.engine
                held = req.call.route.cached_tokens(engine, self._block_size_of(engine))
                if held < req.outstanding.cached_tokens:
                    lost_ahead(req.outstanding, held)
                    req.dispatch = replace(req.dispatch, cached_tokens=held, kv_move=None)
            req.move(RequestState.DISPATCHED)
            actions.append(req.dispatch)
            req.dispatch = None
            req.move_id = None
        record.waiters.clear()

    def _leave_group(self, rid: str) -> None:
        """The request no longer runs with its siblings (it finished, or was cancelled)."""
        group = self._group_of.pop(rid, None)
        if group is None:
            return
        members = self._groups[group]
        engine_name, _ = members.pop(rid)
        if not members:
            del self._groups[group]
        at_engine = self._groups_at[engine_name]
        if at_engine[group] == 1:
            del at_engine[group]
        else:
            at_engine[group] -= 1

    def _stop_waiting(self, req: _Request) -> None:
        """A request awaiting KV leaves: it no longer waits, and its ledger entry closes."""
        self._pace_due.pop(req.call.request_id, None)
        req.pace_next = None
        if req.move_id is not None:
            record = self.moves.get(req.move_id)
            if record is not None and req.call.request_id in record.waiters:
                record.waiters.remove(req.call.request_id)
        if req.outstanding is not None:
            close_dispatch(req.outstanding)
        req.dispatch = None

    def segments_of(self, request_id: str) -> Segments | None:
        """The live request's segments."""
        req = self._requests.get(request_id)
        return req.segments if req is not None else None

    def _tag(self, call: Call) -> Segments:
        """The call's segments: the driver's, else by rule from what its workflow's calls so
        far say (the prefix it shares with its parents is their context, shared when a parent
        expects or has several children)."""
        hints = call.hints
        keys = call.route.block_keys
        lineage = None
        if hints.workflow is not None and hints.task is not None:
            wf = hints.workflow
            lineage = self._lineage.get(wf)
            if lineage is None:
                lineage = self._lineage[wf] = {}
                if len(self._lineage) > LINEAGE_WORKFLOWS:
                    self._forget_lineage(next(iter(self._lineage)))
            else:
                self._lineage.move_to_end(wf)
            for parent in hints.after:
                known = lineage.get(parent)
                if known is not None:
                    known.children += 1
                    lineage[parent] = lineage.pop(parent)  # named again: the last to forget
            old = lineage.get(hints.task)
            lineage[hints.task] = _Lineage(keys, hints.expect_children or 0)
            if wf not in self._submitted:
                # A hint-mode workflow never ends: its calls' parents are its recently named,
                # and all of them together hold at most LINEAGE_HINT_BLOCKS keys.
                grown = len(keys) - (len(old.keys) if old is not None else 0)
                if len(lineage) > LINEAGE_HINT_TASKS:
                    grown -= len(lineage.pop(next(iter(lineage))).keys)
                self._lineage_size[wf] = self._lineage_size.get(wf, 0) + grown
                self._hint_blocks += grown
                while self._hint_blocks > LINEAGE_HINT_BLOCKS:
                    oldest = next((w for w in self._lineage if w in self._lineage_size
                                   and w != wf), None)
                    if oldest is None:
                        break
                    self._forget_lineage(oldest)
        if call.segments is not None:
            return call.segments
        if hints.workflow is not None and hints.task is not None:
            expect = max(hints.expect_children or 0,
                         self._children.get(hints.workflow, {}).get(hints.task, 0))
            joins = self._joins.get(hints.workflow, {})
            if expect > 1 or any(anchor == hints.task for _, anchor in joins.values()):
                # Its own prompt is the context its children extend (or a join extends after
                # sub-agents of another kind have answered).
                return tag_blocks(len(keys), call.static_blocks, len(keys), True)
        context, shared = 0, False
        if lineage is not None:
            # A submitted DAG says how many children each task has before they all ran.
            planned = self._children.get(hints.workflow or "", {})
            for parent in hints.after:
                known = lineage.get(parent)
                if known is None:
                    continue
                n = common_prefix(keys, known.keys)
                if n > context:
                    context = n
                shared = (shared or known.expect_children > 1 or known.children > 1
                          or planned.get(parent, 0) > 1)
        return tag_blocks(len(keys), call.static_blocks, context, shared)

    def _forget_lineage(self, workflow: str) -> None:
        """Forget what the workflow's calls said (for segment tagging and join prefetch)."""
        self._lineage.pop(workflow, None)
        self._hint_blocks -= self._lineage_size.pop(workflow, 0)

    def _home(self, workflow: str, engine: str, now: float) -> None:
        """The workflow's latest call went to `engine`."""
        self._unhome(workflow)
        self._homes[workflow] = (engine, now)
        self._homed[engine] = self._homed.get(engine, 0) + 1

    def _unhome(self, workflow: str) -> None:
        old = self._homes.pop(workflow, None)
        if old is not None:
            self._homed[old[0]] -= 1

    def _expire_homes(self, now: float) -> None:
        homes = self._homes
        while homes:
            workflow, (_, seen) = next(iter(homes.items()))
            if seen >= now - HOME_IDLE_S:
                return
            self._unhome(workflow)

    def _sibling_group(self, hints: RequestHints) -> str | None:
        if not self.siblings or hints.workflow is None:
            return None
        return hints.workflow

    def _withdraw(self, req: _Request) -> None:
        """A request leaves before any engine saw it."""
        rid = req.call.request_id
        if req.state is RequestState.HELD:
            self._held.discard(rid)
        elif self._batch is not None and self._batch.discard(rid):
            pass
        elif req.state is RequestState.QUEUED:
            self._queued.remove(rid)
        req.move(RequestState.CANCELLED)


def reject_message(reject: Reject) -> str:
    """The error a client reads for a `Reject`."""
    return f"no engine available for model {reject.model!r}: {reject.reason}"



def make_planner(
    name: str,
    context: PolicyContext,
    *,
    speculative_ttl_s: float = 0.0,
    engine_block_size: Callable[[str], int] = lambda _: 0,
) -> Planner:
    """The named planner variant (VARIANTS) or routing policy, over `context`'s profiles."""
    settings = planner_settings(name)
    policy = make_policy(settings.routing, context)
    if not settings.homes and hasattr(policy, "homes"):
        policy.homes = False
    cost = getattr(policy, "cost", None)
    if settings.pulls and isinstance(cost, CostModel):
        cost.settings = replace(cost.settings, pulls=True, disaggregate_min_steps=1.0)
    priorities = WorkflowPriorities(context.default_profile) if settings.priorities else None
    return Planner(policy, speculative_ttl_s=speculative_ttl_s,
                   engine_block_size=engine_block_size, release=settings.release,
                   priorities=priorities, profile_of=context.profile,
                   siblings=settings.siblings, link=context.link, prefetch=settings.prefetch,
                   replicate=settings.replicate, pace=settings.pace,
                   pace_in_engine=settings.pace_in_engine, paced_engines=context.paced_engines)
