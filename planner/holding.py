"""Requests a policy holds at the gateway, and the order in which they are offered again (sans-IO).

A policy that raises `Hold` from `choose` keeps the request out of every engine for now. The
driver parks it here with whatever it needs to carry the request on (`token`), and calls
`release` whenever load changes (a first token, a finish, a metrics scrape). Held requests are
offered in arrival order; the first one the policy still holds stops the round for its model,
so a later request never overtakes an earlier one of the same model (first come, first served,
as Dynamo's router queue, one per model) while another model's go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Token = TypeVar("Token")


class HoldQueue(Generic[Token]):
    """Held requests by id, oldest first."""

    def __init__(self) -> None:
        self._held: dict[str, Token] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, token: Token) -> None:
        """Park a request the policy held; it keeps its place behind earlier ones."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already held")
        self._held[request_id] = token

    def discard(self, request_id: str) -> bool:
        """Forget a held request (its client went away or waited too long); False if absent."""
        return self._held.pop(request_id, None) is not None

    def release(self, offer: Callable[[Token], bool],
                queue_of: Callable[[Token], str] | None = None) -> int:
        """Offer held requests oldest first; those `offer` accepts leave the queue. The first
        one the policy holds still (`offer` False) stops the round for its queue: for every
        request with `queue_of` (a model's own queue, as Dynamo keeps one router per model),
        others' requests are still offered. Returns how many left."""
        released = 0
        stopped: set[str] = set()
        for request_id, token in list(self._held.items()):
            queue = queue_of(token) if queue_of is not None else ""
            if queue in stopped:
                continue
            if not offer(token):
                stopped.add(queue)
                if queue_of is None:
                    break
                continue
            del self._held[request_id]
            released += 1
        return released
