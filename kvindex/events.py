"""vLLM's KV-cache event wire format (vllm/distributed/kv_events.py, 0.32), for both directions.

Each ZMQ message is `[topic, seq (8-byte big-endian), payload]`; the payload is a msgpack array
`[ts, events, data_parallel_rank]`. Since 0.32 every event is a msgpack *map* tagged by `"type"`;
earlier releases sent positional arrays with the tag first. `decode_batch` accepts both.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

ExternalBlockHash = int | bytes
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
"""A token id as the index keys it (four bytes); anything else is a malformed event."""


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
    token_ids: list[TokenId]
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


_MAP_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def _from_positional(item: list[Any]) -> WireEvent | None:
    tag = item[0] if item else None
    fields = _POSITIONAL_FIELDS.get(tag) if isinstance(tag, str) else None
    if fields is None:
        return None
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


def _one_event(item: Any) -> WireEvent | None:
    """One event in either layout; None for an event type this module does not know."""
    if isinstance(item, dict):
        kind = _MAP_TYPES.get(item.get("type"))  # type: ignore[arg-type]
        if kind is None:
            return None
        return msgspec.convert(item, kind)  # type: ignore[return-value]
    if isinstance(item, list):
        return _from_positional(item)
    raise TypeError(f"an event is a map or an array, not {type(item).__name__}")


def decode_batch(payload: bytes, unknown: list[str] | None = None) -> KVEventBatch:
    """Decode a payload in either layout; raises KVEventDecodeError naming the problem.

    An event of a type this module does not know (a later vLLM's) is left out, its tag
    appended to `unknown`: the rest of its batch still counts."""
    try:
        return _map_decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as e:
        raise KVEventDecodeError(f"KV event payload is not msgpack: {e}") from None
    try:
        raw = _raw_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KVEventDecodeError(f"KV event payload is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventDecodeError("KV event payload is not an [ts, events, dp_rank] array")
    try:
        events: list[WireEvent] = []
        for item in raw[1]:
            event = _one_event(item)
            if event is not None:
                events.append(event)
            elif unknown is not None:
                tag = item.get("type") if isinstance(item, dict) else item[0] if item else None
                unknown.append(repr(tag))
        ts, rank = raw[0], raw[2] if len(raw) > 2 else None
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise TypeError(f"the batch's timestamp is a {type(ts).__name__}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"the batch's data-parallel rank is a {type(rank).__name__}")
        return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=rank)
    except (msgspec.ValidationError, TypeError, ValueError, IndexError, KeyError) as e:
        raise KVEventDecodeError(f"malformed KV event: {e}") from None


def encode_seq(seq: int) -> bytes:
    """Sequence number frame: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """Read a sequence number frame (the replay end marker is -1, signed)."""
    return int.from_bytes(frame, "big", signed=True)
