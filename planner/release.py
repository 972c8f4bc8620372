"""`batch` release (SBS, ANCHORS.md): the gateway's buffer and when its calls may go out.

Work-conserving: a call goes out at once while the engine the routing policy picks for it has
headroom (`fits`: it takes another sequence, and the call's uncached prompt is small or still
fits in `PREFILL_STEPS_QUEUED` full prefill steps of the gateway's prompts queued there), else
to the best of the engines that have headroom and hold about as much of its prompt
(`stand_ins`). When every engine a call could go to is backed up, it waits in the buffer; the
Planner offers the buffer again, highest priority first, on every admission and load change
and at least once per interval (`interval`: the engines' observed gap between first tokens
while backed up, their prefill step in effect; a full prefill step of the profile until one is
observed). Each call of a release is placed with the ledger its predecessors in that release
left, so a release water-fills the engines by the cost model's estimates, and with the prompts
placed lately counted as held where they went (`with_recent_placements`), so siblings that
share a prefix follow each other onto the engine that holds it.

Sans-IO state only: the Planner (planner/core.py) owns the requests and the routing policy and
calls in here; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kvindex.index import BlockKey, EngineMatch
from planner.ledger import Outstanding
from planner.policy import EngineView, RouteRequest
from planner.profiles import EngineProfile
from planner.segments import common_prefix

PREFILL_STEPS_QUEUED = 2.0
"""Under `batch` release, an engine has headroom while the gateway's prompts waiting there for
their first token add up to fewer than this many full prefill steps (`max_num_batched_tokens`):
enough queued to keep its batches full, no more committed to it ahead of time."""

RECENT_PLACEMENT_S = 2.0
"""How long a placement counts as holding its prompt for buffered requests (the index's own
speculative entries live as long, by default)."""

RECENT_PLACEMENTS = 256
"""At most this many recent placements are compared with each buffered call (a bound on the
work of a release at high rates)."""

SMALL_PREFILL = 1 / 16
"""A prompt whose uncached part is at most this share of a prefill step never waits: it adds
next to nothing to the engine's prefill queue (a cached continuation, a short question)."""

EWMA_ALPHA = 0.2
"""Weight of the newest gap between first tokens in an engine's observed step gap."""


class BatchRelease:
    """The buffer of calls waiting for headroom, the release interval and the recent
    placements a buffered call's matches are brought up to date with."""

    def __init__(self, profile_of: Callable[[str], EngineProfile]) -> None:
        self._profile_of = profile_of
        self.buffer: list[str] = []
        """Request ids waiting for headroom (ranked at each release)."""
        self.wakeup: float | None = None
        """When the next release is due while calls wait (None: nothing waits)."""
        self._step_gap: dict[str, float] = {}
        self._last_first_token: dict[str, float] = {}
        self._placed: deque[tuple[float, str, tuple[BlockKey, ...]]] = deque()
        """The prompts placed lately: (when, engine, block keys)."""
        self._placed_engines: dict[str, int] = {}
        """How many of `_placed` went to each engine."""

    def __len__(self) -> int:
        return len(self.buffer)

    def due(self, now: float) -> bool:
        """The interval has passed since the last release left calls waiting."""
        return self.wakeup is not None and now >= self.wakeup

    def discard(self, rid: str) -> bool:
        """Take a call out of the buffer (it left before any engine saw it); False if it was
        not there."""
        try:
            self.buffer.remove(rid)
        except ValueError:
            return False
        return True

    def release(self, ranked: list[str], offer: Callable[[str], bool], now: float,
                first_engine: str) -> None:
        """Offer `ranked` (the buffer and the newly admitted calls, in priority order); the
        calls `offer` does not place wait for the next release, due one interval from now."""
        self.buffer = ranked
        waiting = [rid for rid in ranked if not offer(rid)]
        self.buffer = waiting
        self.wakeup = now + self.interval(first_engine) if waiting else None

    def placed(self, now: float, engine: str, keys: tuple[BlockKey, ...]) -> None:
        """A call with these prompt keys went to `engine`."""
        self._placed.append((now, engine, keys))
        self._placed_engines[engine] = self._placed_engines.get(engine, 0) + 1

    def with_recent_placements(self, route: RouteRequest, now: float) -> RouteRequest:
        """The request's index matches as of now: a request that waited in the buffer was
        matched when it was admitted, before the planner placed its siblings; the prefixes
        the planner sent since (`RECENT_PLACEMENT_S`) count as held where they went, as the
        index's speculative entries would."""
        placed = self._placed
        counts = self._placed_engines
        while placed and (placed[0][0] < now - RECENT_PLACEMENT_S
                          or len(placed) > RECENT_PLACEMENTS):
            gone = placed.popleft()[1]
            counts[gone] -= 1
            if not counts[gone]:
                del counts[gone]
        if not placed or not route.block_keys:
            return route
        keys = route.block_keys
        whole = len(keys)
        best: dict[str, int] = {}
        full = 0
        engines = len(counts)
        for _, engine, sent in placed:
            # Cheap exits, the same result as comparing every placement in full: a placement
            # shares more than the `b` blocks its engine already matches only if it agrees
            # with the prompt at block `b` (at block 0: most recent prompts differ from the
            # first block on; prompts that open with one system prompt differ after it); an
            # engine matched in full can not match more; once every engine placed to is,
            # nothing can change.
            b = best.get(engine, 0)
            if b == whole or len(sent) <= b or sent[b] != keys[b]:
                continue
            n = common_prefix(keys, sent)
            if n > b:
                best[engine] = n
                if n == whole:
                    full += 1
                    if full == engines:
                        break
        matches = dict(route.matches)
        changed = False
        for engine, n in best.items():
            m = matches.get(engine)
            if m is None or m.blocks < n:
                matches[engine] = EngineMatch(engine, n, m.confirmed_blocks if m else 0,
                                              float(max(n, m.weighted_blocks if m else 0)))
                changed = True
        return replace(route, matches=matches) if changed else route

    def fits(self, route: RouteRequest, engine: EngineView) -> bool:
        """The request may go to `engine` now: the engine takes another sequence, and the
        request's uncached prompt is small or still fits in the engine's prefill headroom
        (`PREFILL_STEPS_QUEUED` full steps of the gateway's prompts awaiting a first token)."""
        profile = self._profile_of(engine.name)
        if engine.in_flight >= profile.max_num_seqs:
            return False
        uncached = route.prompt_tokens - route.cached_tokens(engine.name, engine.block_size)
        budget = profile.max_num_batched_tokens
        return (engine.queued_prefill_tokens == 0 or uncached <= SMALL_PREFILL * budget
                or engine.queued_prefill_tokens + uncached <= PREFILL_STEPS_QUEUED * budget)

    def stand_ins(self, route: RouteRequest, chosen: EngineView, views: list[EngineView]
                  ) -> list[EngineView]:
        """The engines that may take the call now in place of `chosen`, which cannot (`fits`):
        those with headroom that hold as much of its prompt as `chosen` does, give or take one
        prefill step (`max_num_batched_tokens`). Where the call would lose more of its cache it
        waits for `chosen`; where it loses less, waiting would leave it idle while another
        engine could be computing it. Measured (2026-11-28, fanout with 32k contexts on 8 x
        `h100x4-llama3-70b`, RDMA, 48 workflows, rate 1.03/s): the roots, 32k tokens new
        everywhere, waited 1.1 s on average in the buffer for the engine chosen first while
        another engine had room; with stand-ins, 0 s."""
        bs = chosen.block_size
        floor = (route.cached_tokens(chosen.name, bs)
                 - self._profile_of(chosen.name).max_num_batched_tokens)
        return [v for v in views if v.name != chosen.name and self.fits(route, v)
                and route.cached_tokens(v.name, v.block_size) >= floor]

    def interval(self, first_engine: str) -> float:
        """The batch interval: the engines' observed gap between first tokens while backed up
        (their prefill step, in effect), else one full prefill step of `first_engine`'s
        profile."""
        if self._step_gap:
            return min(self._step_gap.values())
        profile = self._profile_of(first_engine)
        return profile.prefill_time(profile.max_num_batched_tokens)

    def forget_engine(self, engine: str) -> None:
        """The engine left the pool: its pace no longer sets the interval."""
        self._step_gap.pop(engine, None)
        self._last_first_token.pop(engine, None)

    def observe_step(self, out: Outstanding, now: float) -> None:
        """Learn the engine's pace from first tokens that arrive while more prefills wait."""
        engine = out.engine
        last = self._last_first_token.get(engine)
        if last is not None and now - last < self._profile_of(engine).decode_step_time(1, 0):
            # Closer than the shortest step the engine takes: first tokens of one step, which
            # reach a live gateway microseconds apart (the virtual driver's share an instant).
            # Taken as a gap they shrank the interval toward nothing, and the gateway released
            # its whole buffer back to back.
            return
        self._last_first_token[engine] = now
        if last is None or out.load.prefilling <= 0:
            return
        gap = now - last
        old = self._step_gap.get(engine)
        self._step_gap[engine] = gap if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * gap
