"""Carries out the planner's KV moves against live engines (the driver side of `Transfer` and
`Warm`), and reports each end back as `TransferDone` / `TransferFailed`.

The planner names a move's prefix by an origin request; the proxy lends this module the token
ids of every request it is placing or forwarding (`remember` / `forget`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from adapters.vllm.transport import TransportError, nixl_transfer, warm
from gateway.tracing import MoveTrace
from planner.actions import Transfer, Warm
from planner.events import TransferDone, TransferFailed
from planner.movement import RECENT_ORIGINS

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger("kvgate.moves")


class Origin(NamedTuple):
    """The prompt a move copies a prefix of, and what besides its tokens keys its KV."""

    model: str
    token_ids: tuple[int, ...]
    cache_salt: str | None


class KvMover:
    """Runs each move as a task: the two NIXL legs, or a warm-up."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._origins: dict[str, Origin] = {}
        self._tasks_of: dict[str, tuple[str, str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent: OrderedDict[str, tuple[Origin, tuple[str, str] | None]] = OrderedDict()

    def knows(self, request_id: str) -> bool:
        """A request id whose prompt a move may still copy (in flight, or among the recent)."""
        return request_id in self._origins or request_id in self._recent

    def remember(self, request_id: str, model: str, token_ids: tuple[int, ...],
                 task: tuple[str, str] | None = None, cache_salt: str | None = None) -> None:
        """A request's prompt, while it may be a move's origin; `task` is its (workflow, task)
        when it belongs to one (the workflow's status lists the moves it caused); `cache_salt`
        its salt, which a copy of its prefix keeps."""
        self._origins[request_id] = Origin(model, token_ids, cache_salt)
        if task is not None:
            self._tasks_of[request_id] = task

    def forget(self, request_id: str) -> None:
        """The request is over; its prompt stays among the last RECENT_ORIGINS (a join's
        prefetch may copy a finished parent's prompt)."""
        origin = self._origins.pop(request_id, None)
        of = self._tasks_of.pop(request_id, None)
        if origin is not None:
            self._recent[request_id] = (origin, of)
            if len(self._recent) > RECENT_ORIGINS:
                self._recent.popitem(last=False)

    def carry_out(self, move: Transfer | Warm) -> None:
        """Start the move; its end reaches the planner as an event. The origin's prompt is
        taken now: the origin may end before the move's task first runs."""
        origin = self._origins.get(move.origin)
        of = self._tasks_of.get(move.origin)
        if origin is None and move.origin in self._recent:
            origin, of = self._recent[move.origin]
        trace = self.state.tracing.move(move, of[0] if of is not None else None)
        task = asyncio.get_running_loop().create_task(self._run(move, origin, of, trace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancel moves still under way."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _url(self, engine: str) -> str:
        pool = self.state.pool
        if pool is None or engine not in pool.engines:
            raise TransportError(f"engine {engine} is not in the pool")
        return pool.engines[engine].url

    async def _run(self, move: Transfer | Warm, origin: Origin | None,
                   task: tuple[str, str] | None, trace: MoveTrace) -> None:
        state = self.state
        kind = "transfer" if isinstance(move, Transfer) else "warm"
        started = time.monotonic()
        m = state.metrics
        error: str | None = None
        try:
            if origin is None or len(origin.token_ids) < move.tokens:
                raise TransportError(f"origin request {move.origin} is gone")
            ids = origin.token_ids[:move.tokens]
            session = state.session
            assert session is not None
            if isinstance(move, Transfer):
                await nixl_transfer(session, (move.source, self._url(move.source)),
                                    (move.destination, self._url(move.destination)),
                                    origin.model, ids, headers=trace.headers(),
                                    cache_salt=origin.cache_salt)
                m.kv_move_bytes.labels(move.reason).inc(move.num_bytes)
            else:
                await warm(session, self._url(move.engine), move.engine, origin.model, ids,
                           headers=trace.headers(), cache_salt=origin.cache_salt)
        except TransportError as e:
            error = str(e)
        except asyncio.CancelledError:
            # The gateway is stopping: the move's span and count end as those of a failure.
            m.kv_moves.labels(kind, move.reason, "failed").inc()
            trace.end("cancelled: the gateway stopped")
            state.notify(TransferFailed(move.move_id, "cancelled: the gateway stopped"))
            raise
        except Exception as e:  # whatever ends a move, the planner must hear that it did
            log.exception("%s %s (%s) raised", kind, move.move_id, move.reason)
            error = f"{type(e).__name__}: {e}"
        # The planner first (requests may wait for this move), the workflow's record after.
        if error is not None:
            log.warning("%s %s (%s) failed: %s", kind, move.move_id, move.reason, error)
            m.kv_moves.labels(kind, move.reason, "failed").inc()
            trace.end(error)
            state.notify(TransferFailed(move.move_id, error))
        else:
            m.kv_moves.labels(kind, move.reason, "done").inc()
            trace.end(None)
            m.kv_move_seconds.labels(kind).observe(time.monotonic() - started)
            state.notify(TransferDone(move.move_id))
        try:
            await self._report(task, move, started, error)
        except Exception:  # the workflow store is away: the move itself is over either way
            log.warning("%s %s: could not list it in workflow %s's record", kind,
                        move.move_id, task[0] if task else None, exc_info=True)

    async def _report(self, task: tuple[str, str] | None, move: Transfer | Warm, started: float,
                error: str | None) -> None:
        """List the move in its origin task's record (workflow status)."""
        service = self.state.workflows
        if task is None or service is None:
            return
        info = {"id": move.move_id, "reason": move.reason, "tokens": move.tokens,
                "seconds": round(time.monotonic() - started, 6),
                "outcome": "failed" if error else "done"}
        if isinstance(move, Transfer):
            info |= {"kind": "transfer", "source": move.source,
                     "destination": move.destination, "bytes": move.num_bytes}
        else:
            info |= {"kind": "warm", "destination": move.engine}
        if error:
            info["error"] = error
        await service.note_move(task[0], task[1], info)
