"""vLLM's ``KVEventBatch`` wire: the event format engines publish and routers consume over ZMQ.

Frames are ``[topic (utf-8), seq (8-byte big-endian, signed), payload (msgpack)]``. Three payload
encodings exist and all decode into the same structs:

* ``vllm``: what vLLM itself emits (checked with vLLM 0.33.0's own publisher): the batch an array
  ``[ts, events, data_parallel_rank]``, each event a map tagged by ``type``, defaulted fields
  omitted (vLLM's ``omit_defaults``) except the ones vLLM declares without a default;
* ``array``: older releases, every struct an array ``[tag, field, ...]``;
* ``map``: the batch a map too; no vLLM release emits it, it is accepted and kept as an option.

Block hashes are 32-byte strings or 64-bit integers (older); unknown and newer fields are ignored
in every encoding. :func:`encode_batch` writes ``vllm`` unless told otherwise. Decoding never
lets a msgspec error out (nor msgspec's ``RecursionError`` for values nested too deep): it
raises :class:`VllmWireError` with a ``reason`` the subscriber counts (``malformed``,
``unknown_event``, ``invalid``). Nor does it hold the GIL for a whole message:
:func:`split_batch` leaves the events as msgpack, in groups of at most
:data:`DECODE_GROUP_BYTES` (a larger event alone), decoded one group per call when asked
(:meth:`SplitBatch.groups`), so other threads run between groups and a message's events never
all live as Python objects at once (a garbage collection would walk each of them). See
docs/kv-events.md.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from kvatlas.events.errors import EventDecodeError

BlockHash = bytes | int
"""A vLLM block hash: 32 bytes (current), a signed or unsigned 64-bit integer (older)."""

EVENT_TAGS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
REPLAY_END_SEQ: Final = -1
"""The seq of the empty reply that ends a replay."""
_SEQ = struct.Struct(">q")


class _OlderBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    """The fields of the older releases (their array layout has exactly these)."""

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


class BlockStored(_OlderBlockStored, tag="BlockStored"):
    # added by vLLM 0.33 (kvatlas neither reads nor writes them; decoded, they survive a
    # re-encode in vLLM's layout, and with them its map header is vLLM's byte for byte)
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _OlderBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class BlockRemoved(_OlderBlockRemoved, tag="BlockRemoved"):
    locality: str | None = None  # vLLM 0.33, as above
    ownership: str | None = None


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


# vLLM's own layout: the batch an array, the events maps; vLLM omits defaulted fields but declares
# ``lora_id``, ``medium`` and ``lora_name`` (``medium`` of a removal) without defaults, so those
# are always written (its decoder refuses an event without them).
class _VllmBlockStored(BlockStored, omit_defaults=True, tag="BlockStored"):
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _VllmBlockRemoved(BlockRemoved, omit_defaults=True, tag="BlockRemoved"):
    medium: str | None


class _VllmAllBlocksCleared(AllBlocksCleared, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class _VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_VllmBlockStored | _VllmBlockRemoved | _VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


# The older array encoding: the older releases' fields, laid out as arrays.
class _ArrayBlockStored(_OlderBlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(_OlderBlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _ArrayKVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayTopicBatch(_ArrayKVEventBatch):
    kvatlas_topic: str = ""


_LAYOUTS: Final[dict[str, dict[type, type]]] = {
    "vllm": {
        BlockStored: _VllmBlockStored,
        BlockRemoved: _VllmBlockRemoved,
        AllBlocksCleared: _VllmAllBlocksCleared,
    },
    "array": {
        BlockStored: _ArrayBlockStored,
        BlockRemoved: _ArrayBlockRemoved,
        AllBlocksCleared: _ArrayAllBlocksCleared,
    },
}
_BASE: Final[dict[type, type]] = {
    cls: base for table in _LAYOUTS.values() for base, cls in table.items()
}
ENCODINGS: Final = ("vllm", "map", "array")
"""``vllm``: exactly what vLLM emits (the default everywhere); ``map``: the batch as a map too
(no vLLM release emits it); ``array``: every struct an array (older vLLM releases)."""
DEFAULT_ENCODING: Final = "vllm"


# Decoding in two steps: the batch with its events left as raw msgpack (a view into the
# payload), then the events a bounded group at a time, each group one decoder call.
class _RawArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: msgspec.Raw  # the events' array, as it is in the payload
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


DECODE_GROUP_BYTES: Final = 1 << 20
"""Most bytes of events one decoder call takes: the call holds the GIL, so this bounds a stall."""
_RAW_ARRAY_DECODER: Final = msgspec.msgpack.Decoder(_RawArrayBatch)
_RAW_MAP_DECODER: Final = msgspec.msgpack.Decoder(_RawMapBatch)
_MAP_EVENTS: Final = msgspec.msgpack.Decoder(list[KVEvent])
_ARRAY_EVENTS: Final = msgspec.msgpack.Decoder(
    list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
)
_RAW_EVENTS: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
_RAW_DECODER: Final = msgspec.msgpack.Decoder()
_ENCODER: Final = msgspec.msgpack.Encoder()


class VllmWireError(EventDecodeError):
    """A payload or frame that is not a valid ``KVEventBatch``; ``kind`` says how (a counter)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__("payload", message)
        self.kind = kind

    def under(self, prefix: str) -> VllmWireError:
        return type(self)(self.kind, self.reason)


def _is_array(payload: bytes | memoryview) -> bool:
    """Whether the top-level msgpack value is an array (fixarray, array16, array32)."""
    first = payload[0]
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode any of the three encodings into :class:`KVEventBatch`, or raise
    :class:`VllmWireError`. A top-level array is vLLM's layout (events as maps) or, when its
    events are arrays, the older one; every event of a batch has its first event's layout
    (a map batch: maps)."""
    split = split_batch(payload)
    events = [event for _, group in split.groups() for event in group]
    return KVEventBatch(split.ts, events, split.data_parallel_rank)


@dataclass(frozen=True, slots=True)
class SplitBatch:
    """A batch whose events are still msgpack, in groups of at most :data:`DECODE_GROUP_BYTES`
    (one event larger than that: a group of its own); :meth:`groups` decodes them one group
    per call, as often as asked."""

    ts: float
    data_parallel_rank: int | None
    bodies: tuple[bytes | msgspec.Raw, ...]  # each a msgpack array of a group's events
    maps: bool  # events are maps (vLLM's layout, or a map batch), else arrays (older)

    def groups(self) -> Iterator[tuple[int, list[KVEvent]]]:
        """Each group's index of its first event and its events, decoded; raises
        :class:`VllmWireError` at the first group that is not valid."""
        decoder = _MAP_EVENTS if self.maps else _ARRAY_EVENTS
        start = 0
        for body in self.bodies:
            try:
                decoded: list[Any] = decoder.decode(body)
            except msgspec.ValidationError as exc:
                raise VllmWireError(_unknown_tag_or(body), f"events[{start}:]: {exc}") from None
            except (msgspec.DecodeError, RecursionError) as exc:  # (e.g. a string not UTF-8)
                raise VllmWireError("malformed", _malformed(exc)) from None
            yield start, decoded if self.maps else [_as_layout(e, None) for e in decoded]
            start += len(decoded)


def split_batch(payload: bytes) -> SplitBatch:
    """The batch's own fields decoded and its events grouped, undecoded; a payload that is not
    a batch raises :class:`VllmWireError` here, an invalid event only in
    :meth:`SplitBatch.groups`."""
    if not payload:
        raise VllmWireError("malformed", "empty payload")
    array = _is_array(payload)
    try:
        top = (_RAW_ARRAY_DECODER if array else _RAW_MAP_DECODER).decode(payload)
    except msgspec.ValidationError as exc:  # well-formed msgpack, not a KVEventBatch
        raise VllmWireError("invalid", str(exc)) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise VllmWireError("malformed", _malformed(exc)) from None
    events = memoryview(top.events)
    count, header = _array_header(events)
    maps = not array or not count or not _is_array(events[header:])
    if count <= 1 or events.nbytes - header <= DECODE_GROUP_BYTES:
        # one group (every real vLLM step): the events' array as it is, not a copy of it
        one: tuple[bytes | msgspec.Raw, ...] = (top.events,) if count else ()
        return SplitBatch(top.ts, top.data_parallel_rank, one, maps)
    bodies: list[bytes | msgspec.Raw] = []
    group: list[msgspec.Raw] = []
    size = 0
    try:
        raws = _RAW_EVENTS.decode(top.events)
    except (msgspec.DecodeError, RecursionError) as exc:  # (parsed above, from a shallower stack)
        raise VllmWireError("malformed", _malformed(exc)) from None
    for raw in raws:
        n = memoryview(raw).nbytes
        if group and size + n > DECODE_GROUP_BYTES:
            bodies.append(_array_of(group))
            group, size = [], 0
        group.append(raw)
        size += n
    bodies.append(_array_of(group))
    return SplitBatch(top.ts, top.data_parallel_rank, tuple(bodies), maps)


def _array_header(value: memoryview) -> tuple[int, int]:
    """The item count and header length of a msgpack array, or :class:`VllmWireError`
    (``invalid``) when ``value`` is not one (a batch's ``events``)."""
    first = value[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first == 0xDC:
        return int.from_bytes(value[1:3], "big"), 3
    if first == 0xDD:
        return int.from_bytes(value[1:5], "big"), 5
    raise VllmWireError("invalid", "events must be an array")


def _array_of(items: list[msgspec.Raw]) -> bytes:
    """One msgpack array of already encoded items (array32 header: any count)."""
    return b"".join([b"\xdd" + len(items).to_bytes(4, "big"), *items])


def _malformed(exc: Exception) -> str:
    """What a msgpack that does not decode is refused for (msgspec raises ``RecursionError``,
    not a ``DecodeError``, for values nested deeper than it follows)."""
    if isinstance(exc, RecursionError):
        return "msgpack nested too deeply"
    return str(exc)


def _unknown_tag_or(events_body: bytes | msgspec.Raw) -> str:
    """``unknown_event`` when some event's tag is not one of :data:`EVENT_TAGS`, ``malformed``
    when the events are not valid msgpack after all (the typed decoder stops at the first
    invalid value: a string further on that is not UTF-8, nesting too deep), else ``invalid``
    (only on the error path: a second, untyped decode)."""
    try:
        events = _RAW_DECODER.decode(events_body)
    except (msgspec.DecodeError, RecursionError):
        return "malformed"
    for event in events:
        tag = event.get("type") if isinstance(event, dict) else None
        if isinstance(event, list) and event:
            tag = event[0]
        if isinstance(tag, str) and tag not in EVENT_TAGS:
            return "unknown_event"
    return "invalid"


def _as_layout(event: msgspec.Struct, encoding: str | None) -> Any:
    """The same event as the struct of ``encoding``'s layout (``None``: the plain structs)."""
    cls: Any = _BASE.get(type(event), type(event))
    if encoding in _LAYOUTS:
        cls = _LAYOUTS[encoding][cls]
    if type(event) is cls:
        return event
    fields = event.__struct_fields__  # the older layout has fewer: the rest keep defaults
    return cls(**{name: getattr(event, name) for name in cls.__struct_fields__ if name in fields})


def encode_batch(batch: KVEventBatch, encoding: str = DEFAULT_ENCODING) -> bytes:
    """``vllm`` (byte for byte what vLLM's own encoder writes), ``map`` or ``array``. A
    :class:`TopicBatch` keeps its topic in ``map`` and ``array`` (a trailing element there,
    ignored by decoders); in ``vllm`` the topic travels only in the frames, as vLLM's does."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    events: list[Any] = [_as_layout(e, encoding) for e in batch.events]
    if encoding == "vllm":
        return _ENCODER.encode(_VllmKVEventBatch(batch.ts, events, batch.data_parallel_rank))
    if encoding == "map":
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
    "DECODE_GROUP_BYTES",
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "EVENT_TAGS",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "SplitBatch",
    "TopicBatch",
    "VllmWireError",
    "decode_batch",
    "encode_batch",
    "pack_seq",
    "split_batch",
    "split_topic",
    "unpack_seq",
]
