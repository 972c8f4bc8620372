"""The gateway's KV-event listener (`gateway/kv_events.py`) over real ZMQ sockets: it keeps
reading through a busy event loop, and a batch it cannot apply resyncs its engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from gateway.kv_events import EventSource, KVEventListener
from kvgate.procs import free_port
from kvindex.events import BlockStored, KVEventBatch, encode_batch, encode_seq
from kvindex.index import InMemoryIndex
from kvindex.ingest import EventIngestor
from kvindex.keys import chain_keys

E = "engine-a"
TOKENS = list(range(1000, 1160))


def stored(i: int) -> bytes:
    """A batch storing block `i` of TOKENS (a chain from block 0)."""
    return encode_batch(KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[100 + i], parent_block_hash=100 + i - 1 if i else None,
        token_ids=TOKENS[16 * i:16 * (i + 1)], block_size=16, lora_id=None, medium="GPU",
        lora_name=None)], data_parallel_rank=0))


class Rig:
    def __init__(self) -> None:
        self.index = InMemoryIndex()
        self.ingestor = EventIngestor(16)
        port = free_port()
        self.listener = KVEventListener(self.index, self.ingestor, [EventSource(E, E)],
                                        bind=f"tcp://127.0.0.1:{port}")
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.connect(f"tcp://127.0.0.1:{port}")
        self.seq = 0

    def send(self, payload: bytes) -> None:
        self.pub.send_multipart([E.encode(), encode_seq(self.seq), payload])
        self.seq += 1

    def held(self) -> int:
        match = self.index.match_sync(chain_keys(TOKENS, 16), 0.0).get(E)
        return match.confirmed_blocks if match else 0

    async def until(self, blocks: int, timeout_s: float = 5.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.held() != blocks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.held()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    await r.listener.start()
    # The subscription reaches the PUB once the SUB is read: send block 0 until it lands.
    deadline = time.monotonic() + 10
    while r.held() == 0 and time.monotonic() < deadline:
        r.seq = 0
        r.send(stored(0))
        await asyncio.sleep(0.05)
    assert r.held() == 1
    yield r
    r.pub.close(0)
    await r.listener.stop()


async def test_a_batch_that_arrives_while_the_loop_is_busy_is_still_read(rig: Rig) -> None:
    for i in range(1, 4):
        rig.send(stored(i))
        time.sleep(0.1)  # the loop is busy: the socket's wake-up waits
        rig.listener._poke()  # the listener's periodic call into the socket lands first
        assert await rig.until(i + 1, 2.0) == i + 1
    # And it goes on reading.
    rig.send(stored(4))
    assert await rig.until(5) == 5


async def test_a_batch_the_ingestor_cannot_apply_resyncs_its_engine(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.send(stored(1))
    assert await rig.until(2) == 2

    def broken(*_: Any) -> None:
        raise OverflowError("a token id the keys cannot pack")

    with monkeypatch.context() as m:
        m.setattr(rig.ingestor, "_apply", broken)
        rig.send(stored(2))
        assert await rig.until(0) == 0  # dropped, not half-kept
    assert rig.listener.malformed_messages == 1
    # The next batch is a first contact again: what it stores is held.
    rig.seq = 0
    rig.send(stored(0))
    assert await rig.until(1) == 1


class Replayer:
    """An engine's replay endpoint (a real ROUTER): answers each request with the buffered
    batches from its start, then the end marker."""

    def __init__(self, buffer: dict[int, bytes]) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.buffer = buffer
        self.requests = 0
        self._router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._router.bind(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self._router.recv_multipart()
            self.requests += 1
            first = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= first:
                    await self._router.send_multipart(
                        [ident, b"", E.encode(), encode_seq(seq), self.buffer[seq]])
            await self._router.send_multipart(
                [ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._task.cancel()
        self._router.close(0)


class FailsOnce(InMemoryIndex):
    """An index whose named operation fails once when armed (Redis away for a moment)."""

    def __init__(self, operation: str) -> None:
        super().__init__()
        self.operation = operation
        self.armed = False

    async def clear_engine(self, engine: str) -> None:
        self._fail("clear_engine")
        await super().clear_engine(engine)

    async def remove(self, *args: Any, **kwargs: Any) -> Any:
        self._fail("remove")
        return await super().remove(*args, **kwargs)

    def _fail(self, operation: str) -> None:
        if self.armed and operation == self.operation:
            self.armed = False
            raise ConnectionError("the index is unreachable")


def held(index: InMemoryIndex, blocks: int) -> int:
    match = index.match_sync(chain_keys(TOKENS[:16 * blocks], 16), 0.0).get(E)
    return match.confirmed_blocks if match else 0


async def test_a_probe_whose_index_write_fails_probes_again_and_holds_nothing_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The silent-engine probe's first write fails: the engine is probed again, and its
    live batches are applied (they were held for a replay nobody started, for good)."""
    import gateway.kv_events as kv_events

    monkeypatch.setattr(kv_events, "PROBE_INTERVAL_S", 0.1)
    replayer = Replayer({})
    index = FailsOnce("clear_engine")
    index.armed = True
    ingestor = EventIngestor(16, {E})
    port = free_port()
    listener = KVEventListener(index, ingestor, [EventSource(E, E, None, replayer.endpoint)],
                               bind=f"tcp://127.0.0.1:{port}")
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    await listener.start()
    try:
        deadline = time.monotonic() + 10
        while (index.armed or replayer.requests == 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not index.armed and replayer.requests >= 1  # failed once, then probed again
        for _ in range(100):
            pub.send_multipart([E.encode(), encode_seq(0), stored(0)])
            await asyncio.sleep(0.05)
            if held(index, 1) == 1:
                break
        for i in range(1, 4):
            pub.send_multipart([E.encode(), encode_seq(i), stored(i)])
        deadline = time.monotonic() + 5
        while held(index, 4) != 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert held(index, 4) == 4
        assert all(not t.done() for t in listener._tasks)  # the probe loop lives on
    finally:
        pub.close(0)
        replayer.close()
        await listener.stop()


async def test_a_replayed_removal_the_index_misses_resyncs_the_engine() -> None:
    """A gap is filled by a replay whose batch removes blocks; that write fails: the engine is
    started over, not left credited with what it dropped."""
    from kvindex.events import BlockRemoved

    removal = encode_batch(KVEventBatch(ts=0.0, events=[
        BlockRemoved(block_hashes=[100, 101], medium="GPU")], data_parallel_rank=0))
    replayer = Replayer({2: removal})
    index = FailsOnce("remove")
    ingestor = EventIngestor(16, {E})
    listener = KVEventListener(index, ingestor, [EventSource(E, E, None, replayer.endpoint)])
    try:
        await listener._handle([E.encode(), encode_seq(0), stored(0)])
        await listener._handle([E.encode(), encode_seq(1), stored(1)])
        assert held(index, 2) == 2
        index.armed = True
        await listener._handle([E.encode(), encode_seq(3), stored(2)])  # a gap: replay from 2
        deadline = time.monotonic() + 5
        while listener._replays and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not index.armed and held(index, 2) == 0
        assert ingestor.last_seq(E) is None  # forgotten: the next batch is a first contact
    finally:
        replayer.close()


async def test_a_restart_the_events_showed_is_not_forgotten_again_when_metrics_show_it() -> None:
    index = InMemoryIndex()
    ingestor = EventIngestor(16)
    listener = KVEventListener(index, ingestor, [EventSource(E, E)])
    for i in range(3):
        await listener._handle([E.encode(), encode_seq(i), stored(i)])
    # The new process's first batch: the sequence goes back to 0.
    await listener._handle([E.encode(), encode_seq(0), stored(0)])
    await listener._handle([E.encode(), encode_seq(1), stored(1)])
    assert held(index, 2) == 2
    await listener.reset_engine(E, "engine process restarted (seen on /metrics)")
    assert held(index, 2) == 2  # the new process's blocks, which it never announces again
    # A restart only /metrics saw (its first batches lost) is forgotten as before.
    ingestor.forget(E)
    await listener._handle([E.encode(), encode_seq(5), stored(0)])
    await listener.reset_engine(E, "engine process restarted (seen on /metrics)")
    assert held(index, 1) == 0


class FloodingReplayer:
    """A replay endpoint as vLLM 0.32 serves one (`ZmqEventPublisher._service_replay`): a
    ROUTER that sends every buffered batch in one tight loop, then the end marker, with no
    regard for its send queue, which drops what does not fit. Its queue here is smaller than
    vLLM's 1,000 messages, so that the drop happens on any machine."""

    def __init__(self, buffer: dict[int, bytes], hwm: int = 200) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.buffer = buffer
        self.requests: list[int] = []
        self._router = zmq.Context.instance().socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, hwm)
        self._router.setsockopt(zmq.SNDBUF, 16 * 1024)
        self._router.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            ident, _, start = self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            for seq in sorted(self.buffer):
                if seq >= first:
                    self._router.send_multipart(
                        [ident, b"", E.encode(), encode_seq(seq), self.buffer[seq]])
            self._router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                         b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(0)


async def test_a_replay_whose_sender_drops_part_of_it_is_asked_again_from_the_break(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM sends a whole replay at once and its ROUTER drops what its queue cannot hold:
    the listener used to read the jump as history the engine no longer has and clear the
    engine's index, the part just rebuilt included."""
    import gateway.kv_events as kv_events

    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 0.5)
    blocks = 2000
    tokens = list(range(10_000, 10_000 + 16 * (blocks + 1)))

    def chained(i: int) -> bytes:
        return encode_batch(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[100 + i], parent_block_hash=100 + i - 1 if i else None,
            token_ids=tokens[16 * i:16 * (i + 1)], block_size=16, lora_id=None, medium="GPU",
            lora_name=None)], data_parallel_rank=0))

    replayer = FloodingReplayer({i: chained(i) for i in range(1, blocks)})
    index = InMemoryIndex()
    ingestor = EventIngestor(16, {E})
    listener = KVEventListener(index, ingestor, [EventSource(E, E, None, replayer.endpoint)])
    try:
        await listener._handle([E.encode(), encode_seq(0), chained(0)])
        await listener._handle([E.encode(), encode_seq(blocks), chained(blocks)])  # a gap
        deadline = time.monotonic() + 60
        while listener._replays and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        match = index.match_sync(chain_keys(tokens, 16), 0.0).get(E)
        assert match is not None and match.confirmed_blocks == blocks + 1
        assert ingestor.stats.resyncs == 0 and ingestor.last_seq(E) == blocks
        # It was asked again from where each round broke off, always further on.
        assert len(replayer.requests) >= 2 and replayer.requests[0] == 1
        assert replayer.requests == sorted(set(replayer.requests))
        assert ingestor.stats.replay_rounds == len(replayer.requests) - 1
    finally:
        replayer.close()


class FreezingProxy:
    """A TCP relay in front of a publisher whose connections can be frozen: bytes stop
    moving both ways while the sockets stay open, as when the publisher's node dies or the
    network is cut with no FIN or RST. Connections made after the freeze relay as usual."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target_port = target_port
        self.frozen: list[asyncio.Event] = []
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    def freeze(self) -> None:
        for event in self.frozen:
            event.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        frozen = asyncio.Event()
        self.frozen.append(frozen)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while not frozen.is_set():
                data = await src.read(65536)
                if not data or frozen.is_set():
                    break
                dst.write(data)
            await asyncio.Event().wait()  # frozen: hold both sockets open, move nothing

        for task in (asyncio.create_task(pump(reader, up_writer)),
                     asyncio.create_task(pump(up_reader, writer))):
            self._tasks.add(task)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()


async def test_a_connection_that_goes_silent_without_closing_is_made_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.kv_events as kv_events

    monkeypatch.setattr(kv_events, "HEARTBEAT_IVL_S", 0.2)
    monkeypatch.setattr(kv_events, "HEARTBEAT_TIMEOUT_S", 0.6)
    pub_port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")  # vLLM's publisher binds; the gateway connects
    proxy = FreezingProxy(pub_port)
    await proxy.start()
    index = InMemoryIndex()
    ingestor = EventIngestor(16)
    listener = KVEventListener(index, ingestor,
                               [EventSource(E, E, f"tcp://127.0.0.1:{proxy.port}")])
    await listener.start()
    seq = 0
    try:
        async def heard(last: int, timeout_s: float) -> bool:
            nonlocal seq
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                pub.send_multipart([E.encode(), encode_seq(seq), stored(seq % 10)])
                seq += 1
                await asyncio.sleep(0.05)
                if (ingestor.last_seq(E) or -1) >= last:
                    return True
            return False

        assert await heard(0, 10)
        proxy.freeze()
        frozen_at = seq
        # The publisher goes on; the subscriber hears again only over a new connection.
        assert await heard(frozen_at + 1, 10), "the subscriber stayed on the frozen connection"
        assert proxy.connections >= 2
    finally:
        pub.close(0)
        await listener.stop()
        await proxy.close()


async def test_a_held_batch_the_index_misses_after_a_replay_resyncs_the_engine() -> None:
    """The replay is over and the batches held meanwhile are applied; that write fails: the
    engine is started over. Its task used to die there, leaving the index short of those keys
    while the ingestor counted them in."""

    class FailsThirdAdd(InMemoryIndex):
        adds = 0

        async def add(self, *args: Any, **kwargs: Any) -> Any:
            self.adds += 1
            if self.adds == 3:
                raise ConnectionError("the index is unreachable")
            return await super().add(*args, **kwargs)

    replayer = Replayer({1: stored(1)})
    index = FailsThirdAdd()
    ingestor = EventIngestor(16, {E})
    listener = KVEventListener(index, ingestor, [EventSource(E, E, None, replayer.endpoint)])
    try:
        await listener._handle([E.encode(), encode_seq(0), stored(0)])  # add 1
        await listener._handle([E.encode(), encode_seq(2), stored(2)])  # a gap: held
        deadline = time.monotonic() + 5
        while listener._replays and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not listener._replays and index.adds == 3  # replayed seq 1, then held seq 2
        assert ingestor.last_seq(E) is None and held(index, 3) == 0  # started over
    finally:
        replayer.close()
