"""The gateway's KV-event listener (`gateway/kv_events.py`) over real ZMQ sockets: it keeps
reading through a busy event loop, and a batch it cannot apply resyncs its engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq

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
