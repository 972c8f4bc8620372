"""Routing policies behind one interface: given a request and the pool's state, pick an engine.

Sans-IO: a policy sees immutable views of the engines and a `now`, and returns a decision. The live
gateway and the virtual-time benchmark call the same objects. Adding a policy touches one class
and one registry line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvindex.index import BlockKey, EngineMatch
from planner.profiles import DEFAULT_PROFILE, EngineProfile, get_profile
from planner.transfer import NO_LINK, Pull, TransferLink

if TYPE_CHECKING:
    from planner.cost import PlacementCost


@dataclass(frozen=True)
class EngineView:
    """What a policy may know about one engine at decision time."""

    name: str
    healthy: bool
    models: frozenset[str]
    num_running: int = 0
    """Scraped `vllm:num_requests_running` (may lag by a scrape interval)."""
    num_waiting: int = 0
    """Scraped `vllm:num_requests_waiting`."""
    kv_usage: float = 0.0
    """Scraped `vllm:kv_cache_usage_perc`, 0-1."""
    in_flight: int = 0
    """Requests the gateway has sent to the engine and not seen finish."""
    prefilling: int = 0
    """Of `in_flight`, those that have not produced their first token yet."""
    queued_prefill_tokens: int = 0
    """Uncached prompt tokens of the `prefilling` requests (the gateway's own estimate)."""
    active_blocks: int = 0
    """KV blocks (index block size) held by the gateway's in-flight requests at the engine."""
    block_size: int = 0
    """The engine's own KV block size as its events report it (0 while unknown)."""
    foreign: int = 0
    """Requests the last scrape counted beyond what the gateway had in flight there then
    (other clients, other replicas)."""
    homed_workflows: int = 0
    """Workflows in flight whose latest call went here (their context lives here, and their
    next calls most likely come back here), whether a call of theirs runs now or not. Only
    the planner knows it (from the workflow hints)."""

    grouped: int = 0
    """Of `in_flight`, the calls that belong to a workflow the planner tracks as a sibling
    group (only the planner knows, from the workflow hints)."""
    groups: int = 0
    """Distinct such workflows among them."""

    @property
    def workflows(self) -> int:
        """Workflows with a call in flight here: each tracked workflow once, every other call
        (no workflow known, foreign) as its own. A delay at the engine lengthens a workflow
        once however many of its calls run here in parallel."""
        return self.groups + max(0, self.in_flight - self.grouped) + self.foreign

    @property
    def load(self) -> int:
        """Requests at the engine: the larger of the gateway's own count and the engine's last
        scrape (which may be a scrape interval old)."""
        return max(self.in_flight, self.num_running + self.num_waiting)

    @property
    def fresh_load(self) -> int:
        """Requests at the engine now: the gateway's own, which it sees start and finish, plus
        the foreign ones the last scrape showed. Unlike `load`, a burst of finishes is seen at
        once rather than at the next scrape."""
        return self.in_flight + self.foreign


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about the request being placed."""

    request_id: str
    model: str
    session_id: str | None = None
    prompt_tokens: int = 0
    """Prompt length in tokens (0 when the gateway could not tokenise it)."""
    block_keys: tuple[BlockKey, ...] = ()
    """The prompt's chained block keys at the index block size."""
    block_size: int = 16
    """Tokens per index block."""
    matches: Mapping[str, EngineMatch] = field(default_factory=dict)
    """Per engine, how much of `block_keys` the KV index says it holds."""
    prompt_text: str = ""
    """The prompt as text (rendered chat template), for character-level baselines."""
    max_tokens: int | None = None
    """The request's output limit, if it set one."""
    group_finish_s: float = 0.0
    """Seconds from now until the slowest of its workflow's other calls in flight (its
    siblings: the workflow ends only when every branch has) is predicted to finish; 0 without
    any. Only the planner knows it (from the workflow hints)."""
    group_at: Mapping[str, int] = field(default_factory=dict)
    """Those siblings in flight per engine."""
    arriving: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    """Per engine, leading blocks of `block_keys` a KV move in flight brings there, and the
    seconds until it lands (only the planner knows; only for policies that move KV)."""
    link_wait: Mapping[str, float] = field(default_factory=dict)
    """Per engine, seconds until its NIC is done with the transfers already under way."""
    workflow_root: bool = False
    """The first call of a workflow the planner knows (no parents, no earlier call): where it
    runs is where the workflow's context will live."""
    sequences: int = 1
    """Sequences its engine decodes for it (vLLM's `n`): each steps and reads the prompt's KV
    as a call of its own would, so it counts that many times in its engine's load."""
    streams: bool = True
    """The answer is streamed, so its first token is seen when the prompt is in. A call that is
    not (a plain `create()`) shows nothing until it is over: the planner takes its prompt as
    computed once its placement's estimate says so (`Planner` `_assumed`)."""

    def cached_tokens(self, engine: str, engine_block_size: int = 0) -> int:
        """Prompt tokens the engine is expected to serve from its cache.

        Like vLLM: whole engine blocks only, and the last prompt token is always computed.
        """
        m = self.matches.get(engine)
        if m is None or self.prompt_tokens <= 0:
            return 0
        cached = min(m.blocks * self.block_size, self.prompt_tokens - 1)
        if engine_block_size > 0:
            cached -= cached % engine_block_size
        return cached


@dataclass(frozen=True)
class Placement:
    """A policy's whole decision for one request: the engine, and the estimate behind it for
    policies that make one. The planner hands it back to the policy in `on_dispatch`."""

    engine: str
    cost: PlacementCost | None = None
    pull: Pull | None = None
    """Copy the prompt's leading KV here from a peer first (only policies that declare
    `moves_kv`; the planner sends a `Transfer` and dispatches once it is done)."""
    runners_up: tuple[PlacementCost, ...] = ()
    """The best estimates for other engines, cheapest first (policies that estimate every
    engine; empty for the others). Traces show them next to the choice."""


class NoEngineAvailable(Exception):
    """No healthy engine serves the requested model."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"no engine available for model {model!r}: {reason}")
        self.model = model
        self.reason = reason


class Hold(Exception):
    """The policy keeps the request at the gateway for now: drivers park it in a
    `planner.holding.HoldQueue` and offer it again when load changes."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RoutingPolicy(Protocol):
    """Chooses one engine for a request; told when its choices start and finish."""

    name: str
    speculative_entries: bool
    """The peer records its routing decisions as short-lived index entries (the gateway's
    speculative entries). Drivers add them only for policies that declare it, so a baseline
    never gets a mechanism its peer does not ship by default."""
    moves_kv: bool
    """The peer copies KV between engines (a `Placement.pull`, prefetch, replication); the
    planner moves KV only for policies that declare it."""

    def choose(
        self, request: RouteRequest, engines: Sequence[EngineView], now: float
    ) -> str | Placement:
        """Return the chosen engine's name (or a `Placement` with the estimate behind it); raise
        NoEngineAvailable if none can serve, or Hold to keep the request at the gateway until
        load changes."""
        ...

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """The request was sent where `placement` says (policies that learn from their routing
        use this)."""
        ...

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """The engine started answering the request (its prefill is done)."""
        ...

    def on_finish(
        self, request_id: str, engine: str, now: float, output_tokens: int = 0
    ) -> None:
        """The request finished (or failed) at `engine`; `output_tokens` if the gateway saw them
        stream (0 when unknown)."""
        ...


def placement_of(choice: str | Placement) -> Placement:
    """A policy's answer as a `Placement`."""
    return choice if isinstance(choice, Placement) else Placement(choice)


def reads_index(policy: RoutingPolicy) -> bool:
    """Whether `policy` reads the KV index (its requests' `matches`): a policy that declares
    `reads_index = False` (it routes by load, by session or by a prefix record of its own)
    never does, so a driver may skip matching its prompts and ingesting the engines' KV events
    for it. Undeclared: it does."""
    return bool(getattr(policy, "reads_index", True))


def scrape_interval(policy: RoutingPolicy, default_s: float) -> float:
    """How often drivers refresh engine metrics for `policy`: its peer's own refresh interval
    (a `metrics_interval_s` attribute) when it declares a fresher one, else `default_s`."""
    declared = getattr(policy, "metrics_interval_s", None)
    if isinstance(declared, int | float) and 0 < declared < default_s:
        return float(declared)
    return default_s


class StatelessPolicy:
    """Base for policies that keep no per-request state."""

    name = "stateless"
    speculative_entries = False
    moves_kv = False

    def on_dispatch(self, request: RouteRequest, placement: Placement, now: float) -> None:
        """Nothing to remember."""

    def on_first_token(self, request_id: str, engine: str, now: float) -> None:
        """Nothing to learn."""

    def on_finish(
        self, request_id: str, engine: str, now: float, output_tokens: int = 0
    ) -> None:
        """Nothing to forget."""


def candidates(request: RouteRequest, engines: Sequence[EngineView]) -> list[EngineView]:
    """Healthy engines serving the request's model, in pool order; raises if there are none."""
    if not engines:
        raise NoEngineAvailable(request.model, "the pool has no engines")
    healthy = [e for e in engines if e.healthy]
    if not healthy:
        raise NoEngineAvailable(request.model, "no engine is healthy")
    serving = [e for e in healthy if request.model in e.models]
    if not serving:
        raise NoEngineAvailable(request.model, "no healthy engine serves this model")
    return serving


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is built with: the pool's engine profiles and the index's block size."""

    profiles: dict[str, EngineProfile] = field(default_factory=dict)
    """Roofline profile per engine name (engines absent use `default_profile`); engines that
    join at run time are added here, and policies holding this dict see them."""
    default_profile: EngineProfile = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    block_size: int = 16
    seed: int = 0
    link: TransferLink = NO_LINK
    """The KV transfer path between engines (none by default: every miss is recomputed)."""
    paced_engines: set[str] = field(default_factory=set)
    """Engines whose scheduler applies kvgate's per-request prefill cap (the vLLM plugin
    adapters/vllm_plugins/kvgate_pace.py): a pacing planner sends them a long prompt once with
    a cap instead of in pieces. Engines that join at run time are added here."""

    def profile(self, engine: str) -> EngineProfile:
        """The engine's profile."""
        return self.profiles.get(engine, self.default_profile)


PolicyFactory = Callable[[PolicyContext], RoutingPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class decorator: make a policy available by `name` in config and on the command line."""

    def wrap(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


POLICY_MODULES = (
    "planner.policies.basic",
    "planner.policies.kvgate",
    "planner.policies.session",
    "planner.policies.sglang_like",
    "planner.policies.llmd_like",
    "planner.policies.llmd_approx_like",
    "planner.policies.llmd_p2p_like",
    "planner.policies.llmd_p2p_affinity_like",
    "planner.policies.llmd_affinity_like",
    "planner.policies.dynamo_like",
)
"""Every module that registers a routing policy, listed explicitly (a new policy adds its
module here and one `@register` line)."""


def _load_policies() -> None:
    import importlib

    for module in POLICY_MODULES:
        importlib.import_module(module)


def policy_names() -> list[str]:
    """Every registered policy name, sorted."""
    _load_policies()
    return sorted(_REGISTRY)


def make_policy(name: str, context: PolicyContext | None = None) -> RoutingPolicy:
    """Instantiate a policy by its registered name; the error lists the known names."""
    _load_policies()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown routing policy {name!r}; known policies: {known}") from None
    return factory(context or PolicyContext())
