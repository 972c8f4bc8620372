"""ZMQ side of KV-event ingestion: sockets, continuous polling, replays, applying index ops.

Bind mode: one SUB socket bound at `kv_events_bind`; engines connect to it (vLLM does when its
endpoint has no wildcard) and are told apart by message topic. Connect mode: one SUB socket
connected to every engine endpoint given in config (engines bind, several gateways subscribe).
Either way the socket is polled continuously from start-up: a bound SUB that is not being read
never sends its subscription to a newly connected PUB, which then drops everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvindex.events import decode_seq
from kvindex.index import IndexUnavailable, KVIndexBackend
from kvindex.ingest import AddKeys, EventIngestor, IndexOp, RemoveKeys, RequestReplay

log = logging.getLogger(__name__)



def _update_failed(error: Exception, message: str, engine: str) -> None:
    """Log an index update that failed: one line when the index's store is away (every
    batch meets it then), the traceback for anything else."""
    if isinstance(error, IndexUnavailable):
        log.warning(message + " (%s)", engine, error)
    else:
        log.exception(message, engine)

class BadEndpoint(ValueError):
    """A KV-event endpoint libzmq will not connect to (the message says why)."""

REPLAY_TIMEOUT_S = 2.0
HEARTBEAT_IVL_S = 5.0
"""The SUB socket pings each engine's publisher this often (ZMTP heartbeats, which vLLM's
libzmq answers by itself)."""
HEARTBEAT_TIMEOUT_S = 15.0
"""A connection that answers nothing for this long is dropped and made again: a publisher's
node that died or a network cut without a FIN or RST otherwise left a connect-mode subscriber
deaf to that engine for good (a SUB never sends, so TCP never notices)."""
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_UNKNOWN_TOPICS = 1000
"""Unknown topics remembered (each logged once); more are counted, not kept."""
PROBE_INTERVAL_S = 2.0
RESTART_SEEN_S = 30.0
"""How recent a restart the events showed must be for a restart seen on /metrics (scraped
every half second) to be taken as the same one."""


@dataclass(frozen=True)
class EventSource:
    """Where one engine's events come from and how to recognise them."""

    engine: str
    topic: str
    endpoint: str | None = None
    """Connect-mode PUB endpoint of the engine (None in bind mode)."""
    replay_endpoint: str | None = None


class KVEventListener:
    """Feeds every engine's KV events through an EventIngestor into an index backend."""

    def __init__(
        self,
        index: KVIndexBackend,
        ingestor: EventIngestor,
        sources: Sequence[EventSource],
        bind: str | None = None,
    ) -> None:
        self.index = index
        self.ingestor = ingestor
        self.bind = bind
        self._ctx = zmq.asyncio.Context()
        self._sources = {s.engine: s for s in sources}
        self._by_topic = {s.topic.encode(): s.engine for s in sources}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._replays: set[asyncio.Task[None]] = set()
        self._sub: zmq.asyncio.Socket | None = None
        self._unknown_topics: set[bytes] = set()
        self.malformed_messages = 0
        self.unknown_topic_messages = 0

    def _lock(self, engine: str) -> asyncio.Lock:
        return self._locks.setdefault(engine, asyncio.Lock())

    async def start(self) -> None:
        """Open the SUB socket and start reading it at once."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # vLLM's publisher queues up to 100,000 batches (its `hwm`); so may we. A message
        # past MAXMSGSIZE drops its sender's connection (a batch of a 1M-token prompt's
        # blocks is about 5 MB).
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        if self.bind:
            sub.bind(self.bind)
        for s in self._sources.values():
            if s.endpoint:
                sub.connect(s.endpoint)
        self._sub = sub
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._receive()))
        self._tasks.append(loop.create_task(self._keep_subscribed()))
        self._tasks.append(loop.create_task(self._probe_silent()))

    async def stop(self) -> None:
        """Stop reading and close sockets."""
        for t in [*self._tasks, *self._replays]:
            t.cancel()
        for t in [*self._tasks, *self._replays]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._sub is not None:
            self._sub.close(linger=0)
        self._ctx.term()

    def add_source(self, source: EventSource) -> None:
        """An engine joined: recognise its topic (and connect to it in connect mode)."""
        owner = self._by_topic.get(source.topic.encode())
        if owner is not None and owner != source.engine:
            raise ValueError(f"KV-event topic {source.topic!r} already identifies {owner!r}")
        if source.endpoint and self._sub is not None:
            try:
                self._sub.connect(source.endpoint)
            except zmq.ZMQError as e:  # a well-formed endpoint libzmq still refuses
                raise BadEndpoint(f"cannot subscribe to KV events at {source.endpoint!r}: "
                                  f"{e}") from None
        self._sources[source.engine] = source
        self._by_topic[source.topic.encode()] = source.engine
        if source.replay_endpoint and (self.bind or source.endpoint):
            self.ingestor.replay_available.add(source.engine)
        else:
            # Not subscribed to its events (a replica of several sharing one index, fed by
            # another): it must not replay them either. Its probe was a first contact that
            # cleared the engine's shared entries, its subscriber's counts with them.
            self.ingestor.replay_available.discard(source.engine)

    async def remove_source(self, engine: str) -> None:
        """An engine left: stop listening to it and purge its index entries."""
        source = self._sources.pop(engine, None)
        if source is None:
            return
        if self._by_topic.get(source.topic.encode()) == engine:
            del self._by_topic[source.topic.encode()]
        if source.endpoint and self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(source.endpoint)
        self.ingestor.replay_available.discard(engine)
        async with self._lock(engine):
            await self.apply(self.ingestor.forget(engine))

    async def reset_engine(self, engine: str, reason: str) -> None:
        """Forget the engine's blocks and sequence (its process restarted, seen on /metrics);
        keep listening to it. Unless its events showed that restart already
        (RESTART_SEEN_S ago at most): what the index holds for it then is the new process's,
        which vLLM never announces again, so forgetting it would hide its cache for good
        where the engine has no replay endpoint."""
        async with self._lock(engine):
            if self.ingestor.restart_seen(engine, RESTART_SEEN_S):
                log.info("%s: %s, as its KV events showed already; its index entries are "
                         "the new process's and stay", engine, reason)
                return
            await self.apply(self.ingestor.forget(engine, reason))

    async def _keep_subscribed(self) -> None:
        """Call into the socket regularly: libzmq sends a SUB's subscription to a newly
        connected PUB only while the application processes the socket's commands, and an
        edge-triggered wake-up that was missed would otherwise leave an engine unheard."""
        while True:
            await asyncio.sleep(0.5)
            self._poke()

    def _poke(self) -> None:
        """Process the socket's pending commands. Through the asyncio socket's `get`, which
        re-arms the reader when messages are waiting: plain `getsockopt(EVENTS)` (the C
        method) would consume libzmq's one edge-triggered wake-up, and a message that arrived
        while the loop was busy would leave `recv_multipart` asleep for good."""
        assert self._sub is not None
        self._sub.get(zmq.EVENTS)

    async def _probe_silent(self) -> None:
        """Every PROBE_INTERVAL_S, replay from 0 any engine with a replay endpoint that we have
        not heard from: its first batches may have gone out before it was subscribed."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for engine in list(self._sources):
                async with self._lock(engine):
                    if engine not in self._sources:
                        continue
                    result = self.ingestor.probe(engine)
                    try:
                        await self.apply(result.ops)
                    except Exception as e:
                        # The index is unreachable (Redis away): no replay starts, and the
                        # engine is a first contact again at the next probe or batch (it
                        # would otherwise wait for a replay nobody started, holding its
                        # batches for good).
                        _update_failed(e, "index update for %s failed; probing it again later",
                                       engine)
                        self.ingestor.forget(engine, "index update failed")
                        continue
                if result.replay is not None:
                    self._start_replay(result.replay)

    def _start_replay(self, request: RequestReplay) -> None:
        task = asyncio.get_running_loop().create_task(self._replay(request))
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def _receive(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                await self._handle(frames)
            except Exception:  # one bad message must never stop ingestion
                log.exception("failed to ingest a KV event message")

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed_messages += 1
            return
        topic, seq_frame, payload = frames
        engine = self._by_topic.get(topic)
        if engine is None:
            self.unknown_topic_messages += 1
            if (topic not in self._unknown_topics
                    and len(self._unknown_topics) < MAX_UNKNOWN_TOPICS):
                self._unknown_topics.add(topic)
                log.warning("KV events with unknown topic %r ignored", topic[:200])
            return
        async with self._lock(engine):
            if engine not in self._sources:
                return  # it left the pool while this batch waited for the lock
            try:
                result = self.ingestor.on_message(engine, decode_seq(seq_frame), payload)
            except Exception:
                # The batch was taken in part: start over for this engine rather than keep
                # a view that may hold what the engine has dropped.
                log.exception("KV event batch from %s could not be applied; resyncing it",
                              engine)
                self.malformed_messages += 1
                await self.apply(self.ingestor.forget(engine, "a batch could not be applied"))
                return
            try:
                await self.apply(result.ops)
            except Exception as e:
                # The index missed operations (e.g. Redis was unreachable): start over for this
                # engine rather than keep a view that silently diverged.
                _update_failed(e, "index update for %s failed; resyncing it", engine)
                result.replay = None
                self.ingestor.forget(engine, "index update failed")
        if result.replay is not None:
            self._start_replay(result.replay)

    async def _replay(self, request: RequestReplay) -> None:
        """Ask the engine's replay endpoint for its buffered batches from `from_seq`, again
        from where a round broke off while the ingestor says so, then apply what was held."""
        engine = request.engine
        failed = False
        try:
            round_: RequestReplay | None = request
            while round_ is not None:
                if not await self._replay_round(round_):
                    failed = True  # the index refused the round's updates: resynced already
                    return
                async with self._lock(engine):
                    round_ = self.ingestor.resume_replay(engine, request.generation)
                if round_ is not None:
                    log.info("replay from %s broke off; asking again from %d", engine,
                             round_.from_seq)
        except Exception:
            log.exception("replay from %s failed", engine)
        finally:
            async with self._lock(engine):
                ops = [] if failed else self.ingestor.replay_done(engine, request.generation)
                try:
                    await self.apply(ops)
                except Exception as e:
                    # As everywhere else: the index missed operations, so start over for this
                    # engine (its task used to die here, the index short of those keys).
                    _update_failed(e, "index update for %s failed after its replay; "
                                   "resyncing it", engine)
                    with contextlib.suppress(Exception):  # at once, if the index is back
                        await self.apply(self.ingestor.forget(engine, "index update failed"))

    async def _replay_round(self, request: RequestReplay) -> bool:
        """One request to the replay endpoint, read until its end marker, a silence of
        `REPLAY_TIMEOUT_S` or a jump in it; False when the index refused its updates."""
        engine = request.engine
        source = self._sources.get(engine)
        if source is None or not source.replay_endpoint:
            return True
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart([b"", request.from_seq.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("replay from %s timed out", engine)
                    return True
                frames = await dealer.recv_multipart()
                # [b"", topic, seq, payload]; releases before mid-2025 omit the topic frame.
                body = frames[1:]
                if len(body) == 2:
                    body = [b"", *body]
                if len(body) != 3:
                    self.malformed_messages += 1
                    continue
                seq = decode_seq(body[1])
                if seq < 0:
                    return True
                async with self._lock(engine):
                    ops = self.ingestor.on_replayed(engine, seq, body[2], request.generation)
                    try:
                        await self.apply(ops)
                    except Exception as e:
                        # As for a live batch: the index missed operations, so start over for
                        # this engine rather than keep a view that silently diverged.
                        _update_failed(e, "index update for %s failed during its replay; "
                                       "resyncing it", engine)
                        clear = self.ingestor.forget(engine, "index update failed in a replay")
                        with contextlib.suppress(Exception):  # at once, if the index is back
                            await self.apply(clear)
                        return False
                    if self.ingestor.replay_cut(engine, request.generation):
                        return True
        finally:
            dealer.close(linger=0)

    async def apply(self, ops: Sequence[IndexOp]) -> None:
        """Perform index operations in order."""
        for op in ops:
            if isinstance(op, AddKeys):
                await self.index.add(op.engine, op.keys, op.tier)
            elif isinstance(op, RemoveKeys):
                await self.index.remove(op.engine, op.keys, op.tier)
            else:
                log.info("clearing index entries of %s: %s", op.engine, op.reason)
                await self.index.clear_engine(op.engine)
