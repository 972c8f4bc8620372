"""The gateway's own account of what it has outstanding at each engine (sans-IO).

The planner (`planner.core.Planner`) opens an `Outstanding` when it dispatches a request, marks
its first token and closes it when it ends; policies read the resulting `GatewayLoad` through
`EngineView`. Both drivers reach it only through the planner's events.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.policy import RouteRequest


@dataclass
class GatewayLoad:
    """Requests the gateway has sent to one engine and not yet seen finish."""

    in_flight: int = 0
    prefilling: int = 0
    """Of `in_flight`, those without a first token yet."""
    queued_prefill_tokens: int = 0
    """Uncached prompt tokens of the `prefilling` requests."""
    active_blocks: int = 0
    """Index blocks of the in-flight requests' prompts."""


@dataclass
class Outstanding:
    """One request at one engine, from dispatch to finish."""

    engine: str
    load: GatewayLoad
    cached_tokens: int
    uncached_tokens: int
    blocks: int
    prefilling: bool = True
    open: bool = True
    sequences: int = 1
    """The sequences it decodes (vLLM's `n`): each counts in flight, its prompt's blocks each
    time (the engine computes the prompt once, so it is queued prefill once)."""


def open_dispatch(
    request: RouteRequest, engine: str, load: GatewayLoad, engine_block_size: int = 0
) -> Outstanding:
    """Count `request` against `engine`'s load; undone by `close_dispatch`."""
    cached = request.cached_tokens(engine, engine_block_size)
    d = Outstanding(engine, load, cached, max(0, request.prompt_tokens - cached),
                    len(request.block_keys), sequences=max(1, request.sequences))
    load.in_flight += d.sequences
    load.prefilling += 1
    load.queued_prefill_tokens += d.uncached_tokens
    load.active_blocks += d.blocks * d.sequences
    return d


def prefill_done(d: Outstanding) -> bool:
    """The request's first token arrived; False if that was already counted."""
    if not d.prefilling:
        return False
    d.prefilling = False
    d.load.prefilling -= 1
    d.load.queued_prefill_tokens -= d.uncached_tokens
    return True


def computed_ahead(d: Outstanding, cached_tokens: int) -> None:
    """The engine now holds the request's first `cached_tokens` (its paced prefill's pieces
    are done): only the rest is still to prefill."""
    gained = min(d.uncached_tokens, cached_tokens - d.cached_tokens)
    if gained <= 0 or not d.open:
        return
    d.cached_tokens += gained
    d.uncached_tokens -= gained
    if d.prefilling:
        d.load.queued_prefill_tokens -= gained


def lost_ahead(d: Outstanding, cached_tokens: int) -> None:
    """A prefix the request was counted as finding did not arrive (its move failed or came
    late): it holds only its first `cached_tokens` and computes the rest."""
    lost = d.cached_tokens - max(0, cached_tokens)
    if lost <= 0 or not d.open:
        return
    d.cached_tokens -= lost
    d.uncached_tokens += lost
    if d.prefilling:
        d.load.queued_prefill_tokens += lost


def close_dispatch(d: Outstanding) -> bool:
    """The request finished or failed; False if it was already closed."""
    if not d.open:
        return False
    prefill_done(d)
    d.open = False
    d.load.in_flight -= d.sequences
    d.load.active_blocks -= d.blocks * d.sequences
    return True
