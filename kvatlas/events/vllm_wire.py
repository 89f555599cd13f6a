"""vLLM's ``KVEventBatch`` wire: the event format engines publish and routers consume over ZMQ.

Frames are ``[topic (utf-8), seq (8-byte big-endian, signed), payload (msgpack)]``. Two payload
encodings exist and both decode into the same structs:

* current vLLM: structs as msgpack maps, each event tagged by a ``type`` field;
* older releases: structs as arrays ``[tag, field, ...]`` (the batch ``[ts, events, dp_rank]``).

Block hashes are 32-byte strings (current) or 64-bit integers (older); unknown trailing fields
are ignored in both encodings. :func:`encode_batch` writes the current encoding. Decoding never
lets a msgspec error out: it raises :class:`VllmWireError` with a ``reason`` the subscriber
counts (``malformed``, ``unknown_event``, ``invalid``). See docs/kv-events.md.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import msgspec

from kvatlas.events.errors import EventDecodeError

BlockHash = bytes | int
"""A vLLM block hash: 32 bytes (current), a signed or unsigned 64-bit integer (older)."""

EVENT_TAGS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
REPLAY_END_SEQ: Final = -1
"""The seq of the empty reply that ends a replay."""
_SEQ = struct.Struct(">q")


class BlockStored(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block: its extra keys, or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class TopicBatch(KVEventBatch):
    """What kvatlas publishes: a ``KVEventBatch`` that also names its topic. One kvatlas
    publisher speaks for many instances, and a replay reply is only ``(seq, payload)``, so
    the payload says whose it is; decoders of ``KVEventBatch`` ignore the extra field."""

    kvatlas_topic: str = ""


# The older array encoding: the same structs (``isinstance`` holds), laid out as arrays.
class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _ArrayKVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayTopicBatch(_ArrayKVEventBatch):
    kvatlas_topic: str = ""


_TO_ARRAY: Final[dict[type, type]] = {
    BlockStored: _ArrayBlockStored,
    BlockRemoved: _ArrayBlockRemoved,
    AllBlocksCleared: _ArrayAllBlocksCleared,
}
_FROM_ARRAY: Final[dict[type, type]] = {v: k for k, v in _TO_ARRAY.items()}
ENCODINGS: Final = ("map", "array")
"""``map``: current vLLM per the spec (structs as maps, ``type`` tag); ``array``: structs as
arrays ``[tag, field, ...]`` (what vLLM's ``array_like`` structs and their decoders use)."""


_MAP_DECODER: Final = msgspec.msgpack.Decoder(KVEventBatch)
_ARRAY_DECODER: Final = msgspec.msgpack.Decoder(_ArrayKVEventBatch)
_RAW_DECODER: Final = msgspec.msgpack.Decoder()
_ENCODER: Final = msgspec.msgpack.Encoder()


class VllmWireError(EventDecodeError):
    """A payload or frame that is not a valid ``KVEventBatch``; ``kind`` says how (a counter)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__("payload", message)
        self.kind = kind

    def under(self, prefix: str) -> VllmWireError:
        return type(self)(self.kind, self.reason)


def _is_array(payload: bytes) -> bool:
    """Whether the top-level msgpack value is an array (fixarray, array16, array32)."""
    first = payload[0]
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode either encoding into :class:`KVEventBatch`, or raise :class:`VllmWireError`."""
    if not payload:
        raise VllmWireError("malformed", "empty payload")
    array = _is_array(payload)
    try:
        if not array:
            return _MAP_DECODER.decode(payload)
        legacy = _ARRAY_DECODER.decode(payload)
    except msgspec.ValidationError as exc:  # well-formed msgpack, not a KVEventBatch
        raise VllmWireError(_unknown_tag_or(payload, array), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise VllmWireError("malformed", str(exc)) from None
    return KVEventBatch(legacy.ts, list(legacy.events), legacy.data_parallel_rank)


def _unknown_tag_or(payload: bytes, array: bool) -> str:
    """``unknown_event`` when some event's tag is not one of :data:`EVENT_TAGS`, else ``invalid``
    (only on the error path: a second, untyped decode of a payload that is valid msgpack)."""
    raw = _RAW_DECODER.decode(payload)
    events = raw[1] if array and isinstance(raw, list) and len(raw) > 1 else None
    if not array and isinstance(raw, dict):
        events = raw.get("events")
    if not isinstance(events, list):
        return "invalid"
    for event in events:
        tag = event.get("type") if isinstance(event, dict) else None
        if isinstance(event, list) and event:
            tag = event[0]
        if isinstance(tag, str) and tag not in EVENT_TAGS:
            return "unknown_event"
    return "invalid"


def _as_layout(event: KVEvent, array: bool) -> KVEvent:
    """The same event in the array or the map layout (decoded events keep their wire's)."""
    table = _TO_ARRAY if array else _FROM_ARRAY
    cls = table.get(type(event))
    return event if cls is None else cls(**msgspec.structs.asdict(event))


def encode_batch(batch: KVEventBatch, encoding: str = "map") -> bytes:
    """The current encoding (maps with a ``type`` tag), or ``array``; a :class:`TopicBatch`
    keeps its topic (the array encoding as a trailing element, ignored by decoders)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    array = encoding == "array"
    events: list[Any] = [_as_layout(e, array) for e in batch.events]
    if not array:
        return _ENCODER.encode(msgspec.structs.replace(batch, events=events))
    if isinstance(batch, TopicBatch):
        return _ENCODER.encode(
            _ArrayTopicBatch(batch.ts, events, batch.data_parallel_rank, batch.kvatlas_topic)
        )
    return _ENCODER.encode(_ArrayKVEventBatch(batch.ts, events, batch.data_parallel_rank))


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    """The 8-byte big-endian seq frame; :class:`VllmWireError` (``frames``) if it is not one."""
    if len(frame) != _SEQ.size:
        raise VllmWireError("frames", f"seq frame must be 8 bytes, got {len(frame)}")
    value: int = _SEQ.unpack(frame)[0]
    return value


def split_topic(topic: str) -> tuple[str, str | None]:
    """``kv@<emitter>@<model>`` → ``(emitter, model)``; a topic without a model gives ``None``.
    The emitter is what follows the first ``@`` up to the last one (prefixes other than ``kv``
    are the caller's filter)."""
    _, _, rest = topic.partition("@")
    emitter, sep, model = rest.rpartition("@")
    if not sep:
        return rest, None
    return emitter, model or None


__all__ = [
    "ENCODINGS",
    "EVENT_TAGS",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "TopicBatch",
    "VllmWireError",
    "decode_batch",
    "encode_batch",
    "pack_seq",
    "split_topic",
    "unpack_seq",
]
