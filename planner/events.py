"""What drivers tell the planner happened (frozen data; `Planner.on_event`).

A driver turns I/O into these: an engine's answer starting or ending, a scrape of its metrics, a
health check, an engine joining or leaving, a client going away. The planner never asks; it is
told, with a `now` from the driver's clock (real or virtual).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FirstToken:
    """The engine started answering `request_id` (its prefill is done)."""

    request_id: str
    observed: bool = True
    """The driver saw the moment itself (a streamed first chunk); False when it only knows the
    prefill is over (a whole JSON answer arrived), so the time says nothing about TTFT."""


@dataclass(frozen=True)
class Finished:
    """`request_id` ended at its engine: answered, failed, or its client went away."""

    request_id: str
    output_tokens: int = 0
    """Output tokens the driver saw (0 when unknown)."""
    error: str | None = None


@dataclass(frozen=True)
class Cancelled:
    """A request not yet dispatched is withdrawn (its client hung up or waited too long)."""

    request_id: str


@dataclass(frozen=True)
class EngineJoined:
    """An engine entered the pool (from config or the admin API)."""

    engine: str
    healthy: bool = False
    models: frozenset[str] = frozenset()


@dataclass(frozen=True)
class EngineLeft:
    """An engine left the pool; requests still running there keep their own accounting."""

    engine: str


@dataclass(frozen=True)
class EngineHealth:
    """A health check (or a failed connection) says whether the engine serves, and what."""

    engine: str
    healthy: bool
    models: frozenset[str] | None = None
    """The models it lists (None: unchanged)."""


@dataclass(frozen=True)
class EngineScraped:
    """Fresh figures from the engine's `/metrics`."""

    engine: str
    num_running: int
    num_waiting: int
    kv_usage: float
    finished_before: int | None = None
    """`Planner.finished_at(engine)` when the scrape was sent (a live driver's scrape takes a
    round trip): the gateway's requests that finished there since may still be counted as
    running in it, and are not taken for other clients' load. None: the figures are of this
    instant (the virtual driver's)."""


@dataclass(frozen=True)
class TransferDone:
    """A `Transfer` or `Warm` finished: its destination holds the prefix."""

    move_id: str


@dataclass(frozen=True)
class TransferFailed:
    """A `Transfer` or `Warm` failed (a leg was refused, the lease ran out, an engine died);
    requests waiting for it go ahead and recompute."""

    move_id: str
    reason: str = ""


@dataclass(frozen=True)
class TaskSpec:
    """What the planner is told of one task of a submitted workflow, for its priorities."""

    task: str
    after: tuple[str, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    think_time_s: float = 0.0
    static_segment: str = ""
    """A name for the static segment (system prompt, tools) its prompt opens with, equal for
    equal content ("" if none): the replication demand the DAG announces ahead."""


@dataclass(frozen=True)
class WorkflowSubmitted:
    """A whole DAG is known ahead (the workflow API, the benchmark): its calls carry
    `RequestHints(workflow=..., task=...)` when they are admitted."""

    workflow: str
    tasks: tuple[TaskSpec, ...]


@dataclass(frozen=True)
class WorkflowOver:
    """A workflow ended (done, failed or cancelled): the planner forgets it."""

    workflow: str


Event = (FirstToken | Finished | Cancelled | EngineJoined | EngineLeft | EngineHealth
         | EngineScraped | TransferDone | TransferFailed | WorkflowSubmitted | WorkflowOver)
