"""JSON wire codec for ingestion: ``{"batches": [...]}`` with LMCache-compatible field names.

Decoding is two-phase — msgspec parses and type-checks the whole body, then every batch is
built and validated — and returns only when all of it is valid, so a malformed body never
yields a partial result. Errors name the field, e.g. ``batches[0].entries[3].key.kv_rank``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.api.events import EventBatchRow, EventEntry, EventKey, EventsBodyOf
from kvatlas.checks import is_plain_int
from kvatlas.events import _cut_types as cut_types
from kvatlas.events._cut_types import CutBody
from kvatlas.events.columns import (
    ColumnBatch,
    EntryColumns,
    column_batch,
    shape_index,
    shape_ok,
)
from kvatlas.events.errors import EventDecodeError, EventValidationError, decode_error_from_msgspec
from kvatlas.events.model import CacheEntry, EventBatch, batch_from_wire, header_to_wire
from kvatlas.keys import (
    MAX_MODEL_NAME_CHARS,
    ObjectKey,
    check_cache_salt,
    check_wire_model_name,
    parse_chunk_hash_hex,
    unpack_kv_rank,
)
from kvatlas.keys.object_key import ShapeParts, shape_parts

_WireEntry = EventEntry[msgspec.Raw]  # token lists handed over raw, parsed in bulk
_WireBatch = EventBatchRow[msgspec.Raw]
_WireBody = EventsBodyOf[msgspec.Raw]

_KEY = attrgetter("key")
_HEX = attrgetter("chunk_hash_hex")
_SIZE = attrgetter("size_bytes")
_OFFSET = attrgetter("token_offset")
_decoder = msgspec.json.Decoder(_WireBody)
_encoder = msgspec.json.Encoder()


def _parse_token_lists(
    raws: Sequence[bytes | msgspec.Raw],
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64], int]:
    """Stand-in for the numba parser until its first use: imports it (so ``import
    kvatlas.events`` loads no numba), rebinds this module's name to it and calls it. Later
    calls go straight to the parser, with no stand-in in between."""
    global _parse_token_lists
    from kvatlas.events._json_tokens import parse_token_lists

    _parse_token_lists = parse_token_lists
    return parse_token_lists(raws)


def _cut_entries(body: bytes) -> CutBody | None:
    """Stand-in for the numba scanner until its first use (as :func:`_parse_token_lists`)."""
    global _cut_entries
    from kvatlas.events._json_cut import cut_entries

    _cut_entries = cut_entries
    return cut_entries(body)


def key_from_parts(
    chunk_hash: Any, model_name: str, kv_rank: int, object_group_id: int, cache_salt: str
) -> ObjectKey:
    """Build an ObjectKey of a wire entry (its model name at most ``MAX_MODEL_NAME_CHARS``
    characters); on failure raise an error naming the first bad field."""
    try:
        if len(model_name) > MAX_MODEL_NAME_CHARS:
            raise ValueError("model_name too long")
        return ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)
    except (ValueError, TypeError) as exc:
        checks: list[tuple[str, Any]] = [
            ("model_name", lambda: check_wire_model_name(model_name)),
            ("kv_rank", lambda: unpack_kv_rank(kv_rank)),
            ("cache_salt", lambda: check_cache_salt(cache_salt)),
        ]
        for name, check in checks:
            try:
                check()
            except ValueError as inner:
                raise EventValidationError(name, str(inner)) from None
        if isinstance(object_group_id, bool) or object_group_id < 0 or object_group_id >= 1 << 64:
            raise EventValidationError("object_group_id", "must be an integer >= 0") from None
        raise EventValidationError("chunk_hash", str(exc)) from None


def _key_from_wire(wk: EventKey, strings: dict[str, str]) -> ObjectKey:
    try:
        chunk_hash = parse_chunk_hash_hex(wk.chunk_hash_hex)
    except ValueError as exc:
        raise EventValidationError("chunk_hash_hex", str(exc)) from None
    model = strings.setdefault(wk.model_name, wk.model_name)
    salt = strings.setdefault(wk.cache_salt, wk.cache_salt)
    return key_from_parts(chunk_hash, model, wk.kv_rank, wk.object_group_id, salt)


def _batch_from_wire(
    wb: _WireBatch, strings: dict[str, str], tokens_of: list[np.ndarray[Any, Any] | None]
) -> EventBatch:
    entries = []
    for j, we in enumerate(wb.entries):
        try:
            try:
                key = _key_from_wire(we.key, strings)
            except EventValidationError as exc:
                raise exc.under("key") from None
            entries.append(CacheEntry(key, we.size_bytes, tokens_of[j], we.token_offset))
        except EventValidationError as exc:
            raise exc.under(f"entries[{j}]") from None
    backend = wb.backend or ""
    return batch_from_wire(
        wb,
        tuple(entries),
        strings.setdefault(wb.instance_id, wb.instance_id),
        strings.setdefault(backend, backend),
    )


def _explain_bad_tokens(raw: bytes) -> tuple[str, str]:
    """Slow path, errors only: which element of a rejected token list is wrong."""
    try:
        values = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return "", "is not valid JSON"
    if not isinstance(values, list):
        return "", "must be null or a list of integers in [0, 2**32)"
    for k, value in enumerate(values):
        if not is_plain_int(value) or not 0 <= value < 1 << 32:
            return f"[{k}]", f"token id {value!r:.40} is not an integer in [0, 2**32)"
    return "", "must be a list of plain integers (no leading zeros, fractions or exponents)"


def _tokens_per_entry(wire: _WireBody) -> list[list[np.ndarray[Any, Any] | None]]:
    """All token lists of the body parsed at once; ``None`` for absent/null/empty lists."""
    raws: list[bytes] = []
    where: list[tuple[int, int]] = []
    out: list[list[np.ndarray[Any, Any] | None]] = []
    for i, wb in enumerate(wire.batches):
        out.append([None] * len(wb.entries))
        for j, we in enumerate(wb.entries):
            raw = bytes(we.token_ids)
            if raw != b"null":
                raws.append(raw)
                where.append((i, j))
    arena, lengths, bad = _parse_token_lists(raws)
    if bad >= 0:
        i, j = where[bad]
        field, reason = _explain_bad_tokens(raws[bad])
        raise EventDecodeError(f"batches[{i}].entries[{j}].token_ids{field}", reason)
    start = 0
    for (i, j), n in zip(where, lengths.tolist(), strict=True):
        if n:
            tokens = arena[start : start + n].copy()  # own memory: a chunk never pins the body
            tokens.flags.writeable = False
            out[i][j] = tokens
        start += n
    return out


def decode_json(body: bytes | str) -> list[EventBatch]:
    """Decode ``{"batches": [...]}``; raises :class:`EventDecodeError` naming the bad field."""
    try:
        wire = _decoder.decode(body)
    except msgspec.MsgspecError as exc:
        raise decode_error_from_msgspec(exc) from None
    tokens = _tokens_per_entry(wire)
    strings: dict[str, str] = {}
    batches = []
    for i, wb in enumerate(wire.batches):
        try:
            batches.append(_batch_from_wire(wb, strings, tokens[i]))
        except EventValidationError as exc:
            raise EventDecodeError(*_rooted(exc, f"batches[{i}]")) from None
    return batches


def decode_json_columns(body: bytes | str) -> list[ColumnBatch]:
    """:func:`decode_json` into columns (``POST /events``): the same batches, accepted and
    refused alike, without an object per entry. Store batches' entries become
    :class:`EntryColumns`; any rule broken anywhere hands the body to :func:`decode_json`,
    which names the entry and the reason (the 422 reply), so errors cannot differ.

    The entries are cut out of the body and parsed into columns in one compiled pass
    (``_json_cut.py``) before msgspec decodes the rest (the batch headers): the fast path. A
    body that path is not sure of, or finds a rule broken in, takes the slow one
    (:func:`_slow_columns`: the token lists as ``Raw`` slices, parsed afterwards; the same
    answers)."""
    batches = _fast_columns(body) if isinstance(body, bytes) else None
    return _slow_columns(body) if batches is None else batches


def _fast_columns(body: bytes) -> list[ColumnBatch] | None:
    """The batches of ``body`` through the compiled pass; ``None``: the slow path decides."""
    cut = _cut_entries(body)
    if cut is None:
        return None
    try:
        wire = _decoder.decode(cut.small.data)
    except msgspec.MsgspecError:
        return None
    if len(wire.batches) != len(cut.counts) or any(wb.entries for wb in wire.batches):
        return None
    return _cut_column_batches(body, wire, cut)


def _run_shapes(body: bytes, cut: CutBody) -> list[ShapeParts] | None:
    """The key shape of each run of entries (``None``: one is not valid, or its strings are
    not UTF-8: the per-entry path says which)."""
    shapes: list[ShapeParts] = []
    cols = cut.cols
    c = cut_types
    for e in cut.runs.tolist():  # (a row by fancy indexing would release the GIL: numpy's take)
        row = cols[:, e].tolist()
        try:
            model = body[row[c.MODEL_AT] : row[c.MODEL_END]].decode()
            salt = body[row[c.SALT_AT] : row[c.SALT_END]].decode()
        except UnicodeDecodeError:
            return None
        shape = (model, row[c.KV_RANK], row[c.GROUP], salt)
        if not shape_ok(shape):
            return None
        shapes.append(shape)
    return shapes


def _cut_column_batches(body: bytes, wire: _WireBody, cut: CutBody) -> list[ColumnBatch] | None:
    """The batches of a body whose entries the compiled pass took (``None``: a rule broken)."""
    shapes = _run_shapes(body, cut)
    if shapes is None:
        return None
    cols = cut.cols  # (sizes and offsets in range: the cut took no other entry)
    lengths, starts = cols[cut_types.TOKENS], cols[cut_types.START]
    run_of, sizes, offsets = cols[cut_types.RUN], cols[cut_types.SIZE], cols[cut_types.OFFSET]
    hashes = cut.hashes.reshape(-1).data  # sliced per batch: views, not copies
    out = []
    first = 0
    for wb, n in zip(wire.batches, cut.counts.tolist(), strict=True):
        end = first + n
        runs = run_of[first:end]
        r0 = int(runs[0]) if n else 0  # the batch's runs are r0, r0 + 1, ... (rising)
        batch_shapes, by_run = shape_index(shapes[r0 : int(runs[-1]) + 1] if n else [])
        entries = EntryColumns(
            split_hashes(hashes[32 * first : 32 * end], n),
            batch_shapes,
            by_run[runs - r0] if len(batch_shapes) > 1 else np.zeros(n, np.intp),
            sizes[first:end].copy(),
            offsets[first:end].copy(),
            cut.arena,
            starts[first:end],
            lengths[first:end],
        )
        cb = column_batch(wb, wb.backend or "", entries)
        if cb is None:
            return None
        out.append(cb)
        first = end
    return out


def _slow_columns(body: bytes | str) -> list[ColumnBatch]:
    """:func:`decode_json_columns` with the token lists handed over by msgspec as ``Raw``
    (any body; a broken rule: the per-entry decoder's verdict)."""
    try:
        wire = _decoder.decode(body)
    except msgspec.MsgspecError:
        return explain(decode_json, body)
    raws = [we.token_ids for wb in wire.batches for we in wb.entries]
    arena, lengths, bad = _parse_token_lists(raws)
    if bad >= 0:
        return explain(decode_json, body)
    return _column_batches(body, wire, arena, lengths)


def _column_batches(
    body: bytes | str,
    wire: _WireBody,
    arena: npt.NDArray[np.uint32],
    lengths: npt.NDArray[np.int64],
) -> list[ColumnBatch]:
    """The batches of a decoded body whose entries' tokens are ``arena``, ``lengths[j]`` ids
    each, one after the other (entries of all batches, in order)."""
    starts = np.cumsum(lengths) - lengths
    out = []
    first = 0
    for wb in wire.batches:
        n = len(wb.entries)
        cols = _columns_from_wire(
            wb.entries, arena, starts[first : first + n], lengths[first : first + n]
        )
        first += n
        cb = None if cols is None else column_batch(wb, wb.backend or "", cols)
        if cb is None:
            return explain(decode_json, body)
        out.append(cb)
    return out


def _columns_from_wire(
    entries: list[_WireEntry],
    arena: npt.NDArray[np.uint32],
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> EntryColumns | None:
    keys = list(map(_KEY, entries))
    hexes = list(map(_HEX, keys))
    if hexes and set(map(len, hexes)) != {64}:
        return None
    try:
        raw = bytes.fromhex("".join(hexes))
    except ValueError:
        return None
    if len(raw) != 32 * len(hexes):  # fromhex skips white space; a hash holds none
        return None
    return EntryColumns.checked(
        split_hashes(raw, len(hexes)),
        list(map(shape_parts, keys)),
        list(map(_SIZE, entries)),
        list(map(_OFFSET, entries)),
        arena,
        starts,
        lengths,
    )


def split_hashes(raw: bytes | memoryview, n: int | None = None) -> list[bytes]:
    """``raw`` (``32 * n`` bytes, or a view of them; ``n`` by default all of it) cut into its
    ``n`` 32-byte chunk hashes (one C call for a batch of usual size, no copy of ``raw``
    first)."""
    if n is None:
        n = len(raw) // 32
    if n > _SPLIT_MAX:
        view = memoryview(raw).cast("B")
        return [view[i : i + 32].tobytes() for i in range(0, 32 * n, 32)]
    return list(_hash_layout(n).unpack(raw))


_SPLIT_MAX = 4096  # bounds what the cached layouts below hold


@lru_cache(maxsize=64)
def _hash_layout(n: int) -> struct.Struct:
    """``n`` 32-byte chunk hashes back to back."""
    return struct.Struct("32s" * n)


def explain(decode: Callable[[Any], list[EventBatch]], body: bytes | str) -> list[ColumnBatch]:
    """The per-entry decoder's verdict on a body the columnar one found a rule broken in: it
    raises the error naming the entry (the reply). Should it accept the body after all, its
    batches are the answer (the columnar checks must never be stricter; the differential
    test ``tests/directory/test_columnar_ingest.py`` holds them to that)."""
    return [ColumnBatch.of(b) for b in decode(body)]


def _rooted(exc: EventValidationError, prefix: str) -> tuple[str, str]:
    moved = exc.under(prefix)
    return moved.field, moved.reason


def batch_to_wire(batch: EventBatch) -> EventBatchRow[list[int]]:
    """The JSON wire form of one batch (LMCache's field names and defaults: no tokens is
    ``[]``, which both decoders read as unknown content)."""
    entries: list[EventEntry[list[int]]] = [
        EventEntry(
            EventKey(
                chunk_hash_hex=(k := e.key).chunk_hash.hex(), model_name=k.model_name,
                kv_rank=k.kv_rank, object_group_id=k.object_group_id, cache_salt=k.cache_salt,
            ),
            e.size_bytes,
            [] if e.token_ids is None else e.token_ids.tolist(),  # [] as LMCache
            e.token_offset,
        )
        for e in batch.entries
    ]  # fmt: skip
    return header_to_wire(batch, EventBatchRow, entries=entries)


def encode_json(batches: list[EventBatch] | tuple[EventBatch, ...]) -> bytes:
    return _encoder.encode(EventsBodyOf([batch_to_wire(b) for b in batches]))
