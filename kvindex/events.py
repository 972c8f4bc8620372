"""vLLM's KV-cache event wire format (vllm/distributed/kv_events.py, 0.32), for both directions.

Each ZMQ message is `[topic, seq (8-byte big-endian), payload]`; the payload is a msgpack array
`[ts, events, data_parallel_rank]`. Since 0.32 every event is a msgpack *map* tagged by `"type"`;
earlier releases sent positional arrays with the tag first. `decode_batch` accepts both.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One scheduler step's events, as published."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the engine's prefix cache."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the engine's prefix cache."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The engine's prefix cache was reset."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """A batch whose events decode into the tagged union."""

    events: list[WireEvent]


class KVEventDecodeError(ValueError):
    """A payload that is neither the 0.32 map layout nor the older positional layout."""


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder = msgspec.msgpack.Decoder()

_POSITIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def encode_batch(batch: EventBatch) -> bytes:
    """Serialise a batch exactly as vLLM's ZmqEventPublisher does."""
    return _encoder.encode(batch)


def _from_positional(item: list[Any]) -> WireEvent:
    tag = item[0]
    fields = _POSITIONAL_FIELDS.get(tag) if isinstance(tag, str) else None
    if fields is None:
        raise KVEventDecodeError(f"unknown KV event tag {tag!r}")
    values = dict(zip(fields, item[1:], strict=False))
    if tag == "BlockStored":
        values.setdefault("lora_id", None)
        values.setdefault("medium", None)
        values.setdefault("lora_name", None)
        return msgspec.convert(values, BlockStored)
    if tag == "BlockRemoved":
        values.setdefault("medium", None)
        return msgspec.convert(values, BlockRemoved)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload in either layout; raises KVEventDecodeError naming the problem."""
    try:
        return _map_decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as e:
        raise KVEventDecodeError(f"KV event payload is not msgpack: {e}") from None
    raw = _raw_decoder.decode(payload)
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventDecodeError("KV event payload is not an [ts, events, dp_rank] array")
    try:
        events = [_from_positional(e) for e in raw[1]]
        rank = raw[2] if len(raw) > 2 else None
        return KVEventBatch(ts=float(raw[0]), events=events, data_parallel_rank=rank)
    except (msgspec.ValidationError, TypeError, IndexError) as e:
        raise KVEventDecodeError(f"malformed KV event: {e}") from None


def encode_seq(seq: int) -> bytes:
    """Sequence number frame: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """Read a sequence number frame (the replay end marker is -1, signed)."""
    return int.from_bytes(frame, "big", signed=True)
