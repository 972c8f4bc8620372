"""Bookkeeping a proxied call's answer does not wait for: spans, Prometheus counters and
histograms. The proxy hands it here instead of doing it on the way to the engine or between the
engine's answer and the client's; it runs while the gateway has nothing better to do.

It runs, oldest first, at the first of:
- the moment the gateway has sent a call to an engine and waits for the answer (the upstream
  client calls `flush` then): the engine works while the gateway catches up, so a client
  calling in a loop does not wait for the previous call's spans;
- `backstop_s` after the first item arrived, when no call goes out to run it sooner;
- `max_pending` items waiting (bounded memory under load);
- anything that reads what it produces: `/metrics`, the trace endpoints and shutdown flush it
  first, so a reader never sees a call's answer without its counters and spans; and so does
  the end of a workflow's task or root span, so an exporter gets the calls before the spans
  they sit under.

Nothing here decides anything: the planner hears of every dispatch and finish at once (see
`gateway/proxy.py`); only what an operator reads afterwards is deferred. A failing item is
logged and the rest still run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

BACKSTOP_S = 0.005
MAX_PENDING = 256


class Later:
    """A queue of deferred bookkeeping (see the module docstring)."""

    def __init__(self, backstop_s: float = BACKSTOP_S, max_pending: int = MAX_PENDING) -> None:
        """Run items at the latest `backstop_s` after they arrive, or once `max_pending` wait."""
        self.backstop_s = backstop_s
        self.max_pending = max_pending
        self._items: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` later (at once when no event loop runs, as in a synchronous caller)."""
        items = self._items
        items.append((fn, args))
        if len(items) >= self.max_pending:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.backstop_s, self.flush)

    @property
    def pending(self) -> int:
        """Items waiting."""
        return len(self._items)

    def flush(self) -> None:
        """Run every waiting item now, oldest first."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items = self._items
        if not items:
            return
        self._items = []
        for fn, args in items:
            try:
                fn(*args)
            except Exception:
                log.exception("deferred bookkeeping failed: %r", fn)
