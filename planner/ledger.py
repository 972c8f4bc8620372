"""The gateway's own account of what it has outstanding at each engine (sans-IO).

The live proxy and the virtual-time benchmark driver both open a `Dispatch` when they send a
request, mark its first token and close it when it ends; policies read the resulting
`GatewayLoad` through `EngineView`. Counting here, in one place, keeps both drivers identical.
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
class Dispatch:
    """One request at one engine, from dispatch to finish."""

    engine: str
    load: GatewayLoad
    cached_tokens: int
    uncached_tokens: int
    blocks: int
    prefilling: bool = True
    open: bool = True
    streamed_tokens: int = 0
    """Output events seen (the live proxy counts SSE chunks; the benchmark counts tokens)."""


def open_dispatch(
    request: RouteRequest, engine: str, load: GatewayLoad, engine_block_size: int = 0
) -> Dispatch:
    """Count `request` against `engine`'s load; undone by `close_dispatch`."""
    cached = request.cached_tokens(engine, engine_block_size)
    d = Dispatch(engine, load, cached, max(0, request.prompt_tokens - cached),
                 len(request.block_keys))
    load.in_flight += 1
    load.prefilling += 1
    load.queued_prefill_tokens += d.uncached_tokens
    load.active_blocks += d.blocks
    return d


def prefill_done(d: Dispatch) -> bool:
    """The request's first token arrived; False if that was already counted."""
    if not d.prefilling:
        return False
    d.prefilling = False
    d.load.prefilling -= 1
    d.load.queued_prefill_tokens -= d.uncached_tokens
    return True


def close_dispatch(d: Dispatch) -> bool:
    """The request finished or failed; False if it was already closed."""
    if not d.open:
        return False
    prefill_done(d)
    d.open = False
    d.load.in_flight -= 1
    d.load.active_blocks -= d.blocks
    return True
