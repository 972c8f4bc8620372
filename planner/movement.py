"""KV movement the planner has under way: transfers and warm-ups, and who waits for them.

The planner decides moves (a placement's pull, a prefetch ahead of a fan-out); this module
remembers each move until its driver reports `TransferDone` or `TransferFailed`, tells
placement which prefixes are arriving where and when (so a call admitted while a copy is in
flight counts it as held there, a little later), and estimates each engine's NIC queue the way
the link shares it (one NIC per engine, transfers take turns).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvindex.index import BlockKey
from planner.actions import Move, Transfer, Warm
from planner.ledger import Outstanding
from planner.segments import common_prefix
from planner.transfer import TransferLink

RECENT_ORIGINS = 64
"""A driver keeps the prompts (token ids) of this many finished requests, newest last, for
moves that copy a prefix of one after its request is over (a join's prefetch of its anchor's
prompt). One figure for both drivers, so a move the benchmark makes the gateway makes too (the
benchmark kept 512, the gateway 64; the benchmark's figures are the same with 64)."""

LATE_SLACK_S = 1.0
"""A move still running this long after its estimate plus the time recomputing its prefix
would take is given up on by the requests waiting for it: they go ahead and recompute (vLLM's
`kv_load_failure_policy` recompute, applied by the planner before the engine ever waits).
Until then waiting cannot lose much against recomputing from the start."""


@dataclass
class MoveRecord:
    """One move in flight."""

    action: Move
    started: float
    eta: float
    """When the planner expects it done."""
    recompute_s: float = 0.0
    """What computing the prefix at the destination instead would take."""
    waiters: list[str] = field(default_factory=list)
    """Requests placed on the destination that wait for it before they are dispatched."""
    source_load: Outstanding | None = None
    """A disaggregated prefill's account at its source (closed when the move ends)."""

    @property
    def destination(self) -> str:
        """Where the prefix goes."""
        a = self.action
        return a.destination if isinstance(a, Transfer) else a.engine

    @property
    def keys(self) -> tuple[BlockKey, ...]:
        """The prefix's block keys."""
        return self.action.block_keys

    def deadline(self) -> float:
        """After this, waiting requests stop waiting."""
        return self.eta + self.recompute_s + LATE_SLACK_S


@dataclass
class MoveStats:
    """Every move the planner started, by kind and reason, and how they ended."""

    started: dict[str, int] = field(default_factory=dict)
    done: int = 0
    failed: int = 0
    late: int = 0
    bytes_planned: int = 0


class Moves:
    """Moves in flight, indexed by id, with each engine's NIC queue as the planner sees it."""

    def __init__(self, link: TransferLink) -> None:
        self.link = link
        self._moves: dict[str, MoveRecord] = {}
        self._nic_free: dict[str, float] = {}
        self._seq = 0
        self.stats = MoveStats()

    def __len__(self) -> int:
        return len(self._moves)

    def __iter__(self) -> Iterator[MoveRecord]:
        return iter(list(self._moves.values()))

    def new_id(self) -> str:
        """A fresh move id."""
        self._seq += 1
        return f"move-{self._seq}"

    def transfer_eta(self, source: str, destination: str, num_bytes: int, now: float) -> float:
        """When a transfer asked for now would end, behind the planner's own transfers on
        either NIC."""
        start = max(now + self.link.setup_s, self._nic_free.get(source, 0.0),
                    self._nic_free.get(destination, 0.0))
        return start + num_bytes / self.link.bandwidth_bytes_s

    def nic_wait(self, now: float) -> dict[str, float]:
        """Per engine, seconds until the planner's own transfers leave its NIC free."""
        return {e: t - now for e, t in self._nic_free.items() if t > now}

    def start(self, action: Move, now: float, eta: float, recompute_s: float = 0.0
              ) -> MoveRecord:
        """Remember a move the planner is about to hand to its driver."""
        if isinstance(action, Transfer):
            self._nic_free[action.source] = self._nic_free[action.destination] = eta
            self.stats.bytes_planned += action.num_bytes
        key = f"{'transfer' if isinstance(action, Transfer) else 'warm'}:{action.reason}"
        self.stats.started[key] = self.stats.started.get(key, 0) + 1
        record = MoveRecord(action, now, eta, recompute_s)
        self._moves[action.move_id] = record
        return record

    def get(self, move_id: str) -> MoveRecord | None:
        """The move, while in flight."""
        return self._moves.get(move_id)

    def end(self, move_id: str, ok: bool) -> MoveRecord | None:
        """The driver reported the move's end; its record (None if unknown). A failed
        transfer's time on its NICs is given back where nothing was booked after it."""
        record = self._moves.pop(move_id, None)
        if record is not None:
            if ok:
                self.stats.done += 1
            else:
                self.stats.failed += 1
                a = record.action
                if isinstance(a, Transfer):
                    for engine in (a.source, a.destination):
                        if self._nic_free.get(engine) == record.eta:
                            del self._nic_free[engine]
        return record

    def arriving(self, keys: Sequence[BlockKey], now: float) -> dict[str, tuple[int, float]]:
        """Per destination, the longest prefix of `keys` a move in flight brings there, and
        the seconds until it lands. A move past its deadline brings nothing: its waiters gave
        it up, and a new call priced as finding it there would be booked as holding a prefix
        that may never come (the driver reports such a move's end late, or never)."""
        out: dict[str, tuple[int, float]] = {}
        if not keys:
            return out
        for record in self._moves.values():
            if now >= record.deadline():
                continue
            n = common_prefix(keys, record.keys)
            if n <= 0:
                continue
            dest = record.destination
            wait = max(0.0, record.eta - now)
            have = out.get(dest)
            if have is None or n > have[0] or (n == have[0] and wait < have[1]):
                out[dest] = (n, wait)
        return out

    def covering(self, destination: str, keys: Sequence[BlockKey], blocks: int, now: float
                 ) -> MoveRecord | None:
        """A move in flight to `destination`, not past its deadline, that brings at least
        `blocks` of `keys`."""
        for record in self._moves.values():
            if (record.destination == destination and now < record.deadline()
                    and common_prefix(keys, record.keys) >= blocks):
                return record
        return None

    def overdue(self, now: float) -> list[MoveRecord]:
        """Moves with requests waiting past their deadline."""
        return [r for r in self._moves.values() if r.waiters and now >= r.deadline()]


def warm_of(move_id: str, engine: str, origin: str, keys: tuple[BlockKey, ...],
            block_size: int, reason: str) -> Warm:
    """A warm-up of `keys` (the leading blocks of `origin`'s prompt) on `engine`."""
    return Warm(move_id, engine, origin, len(keys) * block_size, keys, reason)
