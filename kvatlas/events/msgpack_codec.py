"""Compact binary codec (msgpack) for high-rate producers.

Same in-memory model as the JSON codec, smaller on the wire: token ids travel as little-endian
uint32 bytes, once per distinct chunk content in a batch (``contents``) rather than once per
rank/tier entry; entries are positional arrays referencing a content by index. Decoded token
arrays are read-only views of the received bytes, so entries of one chunk share one array.
"""

from __future__ import annotations

import re
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.api.events import PACKED_FORMAT_VERSION, PackedBatch, PackedEntry, PackedEventsBody
from kvatlas.events.columns import ColumnBatch, EntryColumns, column_batch
from kvatlas.events.errors import EventDecodeError, EventValidationError, decode_error_from_msgspec
from kvatlas.events.json_codec import decode_json, decode_json_columns, explain, key_from_parts
from kvatlas.events.model import CacheEntry, EventBatch, batch_from_wire, header_to_wire
from kvatlas.keys import TokenArray
from kvatlas.keys.object_key import chunk_hash_of, shape_parts

FORMAT_VERSION = PACKED_FORMAT_VERSION
_ENTRY_FIELDS = PackedEntry.__struct_fields__

_SIZE = attrgetter("size_bytes")
_OFFSET = attrgetter("token_offset")
_CONTENT = attrgetter("content")


_decoder = msgspec.msgpack.Decoder(PackedEventsBody)
_encoder = msgspec.msgpack.Encoder()
_ENTRY_PATH = re.compile(r"entries\[(\d+)\]\[(\d+)\]")
_LE_U32 = np.dtype("<u4")


def _name_entry_fields(field: str) -> str:
    def repl(m: re.Match[str]) -> str:
        k = int(m.group(2))
        name = _ENTRY_FIELDS[k] if k < len(_ENTRY_FIELDS) else f"[{k}]"
        return f"entries[{m.group(1)}].{name}"

    return _ENTRY_PATH.sub(repl, field)


def _contents(pb: PackedBatch) -> list[TokenArray | None]:
    out: list[TokenArray | None] = []
    for k, raw in enumerate(pb.contents):
        if len(raw) % 4:
            raise EventValidationError(f"contents[{k}]", "length must be a multiple of 4 bytes")
        arr = np.frombuffer(raw, dtype=_LE_U32) if raw else None
        out.append(arr if arr is None or arr.dtype == np.uint32 else arr.astype(np.uint32))
    return out


def _batch_from_packed(pb: PackedBatch, strings: dict[str, str]) -> EventBatch:
    contents = _contents(pb)
    entries = []
    for j, pe in enumerate(pb.entries):
        try:
            if not -1 <= pe.content < len(contents):
                raise EventValidationError("content", f"no content #{pe.content} in this batch")
            key = key_from_parts(
                pe.chunk_hash,
                strings.setdefault(pe.model_name, pe.model_name),
                pe.kv_rank,
                pe.object_group_id,
                strings.setdefault(pe.cache_salt, pe.cache_salt),
            )
            tokens = contents[pe.content] if pe.content >= 0 else None
            entries.append(CacheEntry(key, pe.size_bytes, tokens, pe.token_offset))
        except EventValidationError as exc:
            raise exc.under(f"entries[{j}]") from None
    return batch_from_wire(
        pb,
        tuple(entries),
        strings.setdefault(pb.instance_id, pb.instance_id),
        strings.setdefault(pb.backend or "", pb.backend or ""),
    )


def decode_msgpack(body: bytes) -> list[EventBatch]:
    """Decode a compact body; any malformed input raises only :class:`EventDecodeError`.

    Liberal in what it accepts: a msgpack body shaped like the JSON body (entries as maps with
    a ``key`` map, ``token_ids`` as a list or as little-endian uint32 bytes) is decoded too.
    """
    try:
        wire = _decoder.decode(body)
    except msgspec.MsgspecError as exc:
        err = decode_error_from_msgspec(exc)
        compact_error = EventDecodeError(_name_entry_fields(err.field), err.reason)
        json_shaped = _json_shaped(body)
        if json_shaped is None:
            raise compact_error from None
        return decode_json(json_shaped)
    except (RecursionError, MemoryError, OverflowError) as exc:
        raise EventDecodeError("body", f"undecodable msgpack: {type(exc).__name__}") from None
    if wire.v != FORMAT_VERSION:
        raise EventDecodeError("v", f"unsupported format version {wire.v}")
    strings: dict[str, str] = {}
    batches = []
    for i, pb in enumerate(wire.batches):
        try:
            batches.append(_batch_from_packed(pb, strings))
        except EventValidationError as exc:
            moved = exc.under(f"batches[{i}]")
            raise EventDecodeError(moved.field, moved.reason) from None
    return batches


def decode_msgpack_columns(body: bytes) -> list[ColumnBatch]:
    """:func:`decode_msgpack` into columns (see :func:`~kvatlas.events.json_codec.
    decode_json_columns`): the same batches and the same errors, no object per entry."""
    try:
        wire = _decoder.decode(body)
    except msgspec.MsgspecError:
        json_shaped = _json_shaped(body)
        if json_shaped is not None:
            return decode_json_columns(json_shaped)
        return explain(decode_msgpack, body)
    except (RecursionError, MemoryError, OverflowError):
        return explain(decode_msgpack, body)
    if wire.v != FORMAT_VERSION:
        return explain(decode_msgpack, body)
    # every batch's contents in one arena (batches of one arena may be stored at once:
    # ``directory/store_runs.py``), each batch's rows from its first id on
    joined = b"".join([c for pb in wire.batches for c in pb.contents])
    if len(joined) % 4:  # a content not whole ids
        return explain(decode_msgpack, body)
    arena = np.frombuffer(joined, dtype=_LE_U32).astype(np.uint32, copy=False)
    out = []
    first = 0
    for pb in wire.batches:
        cols = _columns_from_packed(pb, arena, first)
        first += sum(map(len, pb.contents)) // 4
        cb = None if cols is None else column_batch(pb, pb.backend or "", cols)
        if cb is None:
            return explain(decode_msgpack, body)
        out.append(cb)
    return out


def _packed_rows(sizes: Any, refs: Any, firsts: Any, starts: Any, lengths: Any) -> bool:
    """Stand-in for the compiled step until its first use (``_packed_rows.py``): imports it
    (so ``import kvatlas.events`` loads no numba), rebinds this module's name to it and
    calls it."""
    global _packed_rows
    from kvatlas.events._packed_rows import packed_rows

    _packed_rows = packed_rows
    return packed_rows(sizes, refs, firsts, starts, lengths)


def _columns_from_packed(
    pb: PackedBatch, arena: npt.NDArray[np.uint32], first: int
) -> EntryColumns | None:
    """The entries of ``pb`` as columns, its contents in ``arena`` from id ``first`` on."""
    contents, entries = pb.contents, pb.entries
    hashes = list(map(chunk_hash_of, entries))
    if hashes and set(map(len, hashes)) != {32}:
        return None
    n = len(entries)
    sizes = np.fromiter(map(len, contents), dtype=np.int64, count=len(contents))
    try:
        refs = np.fromiter(map(_CONTENT, entries), dtype=np.int64, count=n)
    except OverflowError:  # a reference outside int64: the slow path names the entry
        return None
    firsts = np.empty(len(contents) + 1, np.int64)
    starts, lengths = np.empty(n, np.int64), np.empty(n, np.int64)
    if not _packed_rows(sizes, refs, firsts, starts, lengths):
        return None  # (a content not whole ids, a reference to no content)
    starts += first
    return EntryColumns.checked(
        hashes,
        list(map(shape_parts, entries)),
        list(map(_SIZE, entries)),
        list(map(_OFFSET, entries)),
        arena,
        starts,
        lengths,
    )


def _json_shaped(body: bytes) -> bytes | None:
    """The JSON text of a msgpack body that mirrors the JSON wire form, else ``None``."""
    try:
        doc = msgspec.msgpack.decode(body)
        batches = doc["batches"]
        entries = [e for batch in batches for e in batch.get("entries", ())]
        if not entries or not all(isinstance(e, dict) for e in entries):
            return None
        for batch in batches:
            for entry in batch.get("entries", ()):
                tokens = entry.get("token_ids")
                if isinstance(tokens, bytes):
                    if len(tokens) % 4:
                        return None
                    entry["token_ids"] = np.frombuffer(tokens, dtype=_LE_U32).tolist()
        return msgspec.json.encode(doc)
    except Exception:  # anything unexpected: not JSON-shaped; the compact error stands
        return None


def pack_batch(batch: EventBatch) -> PackedBatch:
    """The compact wire form of one batch: each distinct token content once."""
    contents: list[bytes] = []
    index: dict[bytes, int] = {}
    by_array: dict[int, int] = {}
    entries = []
    for e in batch.entries:
        ref = -1
        if e.token_ids is not None:
            ref = by_array.get(id(e.token_ids), -1)
            if ref < 0:
                raw = e.token_ids.astype(_LE_U32, copy=False).tobytes()
                ref = index.setdefault(raw, len(contents))
                if ref == len(contents):
                    contents.append(raw)
                by_array[id(e.token_ids)] = ref
        k = e.key
        entries.append(
            PackedEntry(
                k.chunk_hash,
                k.model_name,
                k.kv_rank,
                k.object_group_id,
                k.cache_salt,
                e.size_bytes,
                e.token_offset,
                ref,
            )
        )
    return header_to_wire(batch, PackedBatch, contents=contents, entries=entries)


def encode_msgpack(batches: list[EventBatch] | tuple[EventBatch, ...]) -> bytes:
    return _encoder.encode(PackedEventsBody(batches=[pack_batch(b) for b in batches]))
