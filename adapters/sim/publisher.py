"""ZMQ publisher of KV events with a replay ROUTER, behaving like vLLM's ZmqEventPublisher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping

import zmq
import zmq.asyncio

from adapters.sim import model
from kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireEvent,
    encode_batch,
    encode_seq,
)

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def to_wire(event: model.KVEvent, medium: str = "GPU",
            lora_ids: Mapping[str, int] | None = None) -> WireEvent:
    """Convert an engine-model event into vLLM's wire struct. `lora_ids`: each served LoRA
    adapter's int id (vLLM's `lora_int_id`, 1, 2, ... in `--lora-modules` order), sent as the
    event's `lora_id` beside its `lora_name`."""
    if isinstance(event, model.BlockStored):
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=(None if event.lora_name is None or lora_ids is None
                     else lora_ids.get(event.lora_name)),
            medium=medium,
            lora_name=event.lora_name,
            extra_keys=list(event.extra_keys),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    if isinstance(event, model.BlockRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=medium, group_idx=0)
    return AllBlocksCleared()


def wire_batch(events: list[model.KVEvent], ts: float,
               lora_ids: Mapping[str, int] | None = None) -> KVEventBatch:
    """One step's events as vLLM's wire batch, before encoding."""
    batch = KVEventBatch(ts=ts, events=[to_wire(e, lora_ids=lora_ids) for e in events])
    batch.data_parallel_rank = 0
    return batch


def encode_events(events: list[model.KVEvent], ts: float,
                  lora_ids: Mapping[str, int] | None = None) -> bytes:
    """One step's events as the payload of one vLLM KV-event message."""
    return encode_batch(wire_batch(events, ts, lora_ids))


class KVEventPublisher:
    """PUB socket (bind or connect, as vLLM decides) plus an optional replay ROUTER."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        drop_seqs: frozenset[int] = frozenset(),
        lora_ids: Mapping[str, int] | None = None,
    ) -> None:
        self._lora_ids = dict(lora_ids or {})
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if is_bind_endpoint(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay_task: asyncio.Task[None] | None = None
        # Batches kept for replay but never sent live: a lossy link, for fault-injection tests.
        self._drop = drop_seqs

    def start(self) -> None:
        """Begin serving replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: list[model.KVEvent]) -> None:
        """Send one batch (one engine step's events) with the next sequence number."""
        if not events:
            return
        payload = encode_events(events, time.time(), self._lora_ids)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if seq not in self._drop:
            await self._pub.send_multipart((self._topic, encode_seq(seq), payload))

    @property
    def next_seq(self) -> int:
        """Sequence number the next batch will carry."""
        return self._seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client_id, b"", self._topic, encode_seq(seq), payload)
                    )
            await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        """Stop replay service and close sockets without lingering."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
