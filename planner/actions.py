"""What the planner tells drivers to do (frozen data; `Planner.release`).

A `Dispatch` is the whole decision for one request: where it goes, what the planner expects it
to cost there, and which index entries the driver records for it. A `Reject` names why no engine
can take it. Drivers carry them out and report back with events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvindex.index import BlockKey
from planner.cost import PlacementCost
from planner.segments import NO_SEGMENTS, Segments

PREFILL_CAP_ARG = "kvgate_prefill_cap"
"""The `vllm_xargs` key that carries `Dispatch.prefill_cap` to an engine running kvgate's
scheduler plugin (adapters/vllm_plugins/kvgate_pace.py) or the simulated engine."""


PREFILL_CAPS_ARG = "kvgate_prefill_caps"
"""The `vllm_xargs` key that carries `Dispatch.prefill_caps`, flattened (`[t0, c0, t1, c1,
...]`: vLLM takes no nested list as a `vllm_xargs` value)."""


@dataclass(frozen=True)
class Dispatch:
    """Send `request_id` to `engine` now."""

    request_id: str
    engine: str
    cached_tokens: int
    """Prompt tokens the engine is expected to serve from its cache (whole engine blocks)."""
    kv_move: str | None = field(default=None, kw_only=True)
    """The reason of the KV move the request waited for at `engine` (`pull`, `disaggregate`,
    `prefetch`, `replicate`); None if it waited for none."""
    cost: PlacementCost | None = None
    """The placement's estimate, for policies that make one."""
    speculative_keys: tuple[BlockKey, ...] = ()
    """Block keys the driver records as speculatively held by `engine` ..."""
    speculative_ttl_s: float = 0.0
    """... for this long (until the engine's own KV events confirm or expire them)."""
    priority: int | None = None
    """The engine-side priority to send (engines running `--scheduling-policy priority`)."""
    segments: Segments = NO_SEGMENTS
    """The prompt's blocks by kind (static/shared/transient), for per-segment stages."""
    runners_up: tuple[PlacementCost, ...] = ()
    """The placement's estimates for other engines, cheapest first (`Placement.runners_up`)."""
    prefill_cap: int = 0
    """Engine-side pacing (`PlannerSettings.pace_in_engine`): while another request decodes at
    `engine`, it computes at most this many prompt tokens per step (the driver sends it as
    `vllm_xargs.kvgate_prefill_cap`, PREFILL_CAP_ARG); 0 for no cap."""
    prefill_caps: tuple[tuple[int, int], ...] = ()
    """The cap as the prompt gets on: `(computed_tokens, cap)` pairs in rising order, each
    holding once the engine has computed that many of its tokens (`vllm_xargs.
    kvgate_prefill_caps`, PREFILL_CAPS_ARG); before the first, `prefill_cap`."""

    def pace_xargs(self) -> dict[str, int | list[int]]:
        """The caps as `vllm_xargs` entries (adapters/vllm_plugins/kvgate_pace_caps.py: vLLM
        takes a flat list there, not pairs); empty for none."""
        xargs: dict[str, int | list[int]] = {}
        if self.prefill_cap > 0:
            xargs[PREFILL_CAP_ARG] = self.prefill_cap
        if self.prefill_caps:
            xargs[PREFILL_CAPS_ARG] = [v for pair in self.prefill_caps for v in pair]
        return xargs

    @property
    def reason(self) -> str:
        """Why the request goes here, for metrics: the reason of the KV move it waited for,
        else `prefix_hit` (the engine holds part of the prompt) or `load` (nothing cached
        there: chosen by load or cost alone)."""
        if self.kv_move is not None:
            return self.kv_move
        return "prefix_hit" if self.cached_tokens > 0 else "load"


@dataclass(frozen=True)
class Reject:
    """No engine can take `request_id`."""

    request_id: str
    model: str
    reason: str
    model_known: bool
    """Some engine in the pool has ever served the model (else it does not exist)."""
    available_models: tuple[str, ...] = ()
    """Models healthy engines serve now, for the error message."""


@dataclass(frozen=True)
class Transfer:
    """Copy the KV of the leading `tokens` of `origin`'s prompt from `source` to `destination`:
    vLLM's NixlConnector two legs (VLLM_FACTS.md §6), the prefix alone as the prompt, `max_tokens`
    1 on both. Drivers report `TransferDone` or `TransferFailed` with `move_id`."""

    move_id: str
    source: str
    destination: str
    origin: str
    """A request whose prompt starts with the prefix (the driver has its token ids)."""
    tokens: int
    block_keys: tuple[BlockKey, ...]
    """The prefix's block keys (index block size)."""
    num_bytes: int
    """KV bytes the planner expects to move (the destination's missing part)."""
    reason: str
    """`pull` (a placement needs it now), `prefetch` (a task about to be ready) or
    `replicate` (a hot segment)."""


@dataclass(frozen=True)
class Warm:
    """Compute the leading `tokens` of `origin`'s prompt on `engine` ahead of need (a prompt-only
    request, `max_tokens` 1): the fallback where no transfer path exists."""

    move_id: str
    engine: str
    origin: str
    tokens: int
    block_keys: tuple[BlockKey, ...]
    reason: str


Move = Transfer | Warm

Action = Dispatch | Reject | Transfer | Warm
