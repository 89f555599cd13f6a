"""JSON wire codec for ingestion: ``{"batches": [...]}`` with LMCache-compatible field names.

Decoding is two-phase — msgspec parses and type-checks the whole body, then every batch is
built and validated — and returns only when all of it is valid, so a malformed body never
yields a partial result. Errors name the field, e.g. ``batches[0].entries[3].key.kv_rank``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

from kvatlas.events.errors import EventDecodeError, EventValidationError, decode_error_from_msgspec
from kvatlas.events.model import UNKNOWN_OFFSET, CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, parse_chunk_hash_hex, unpack_kv_rank
from kvatlas.keys.object_key import check_cache_salt, check_model_name

TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]


class _WireKey(msgspec.Struct, forbid_unknown_fields=True):
    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class _WireEntry(msgspec.Struct):
    key: _WireKey
    size_bytes: int = 0
    token_ids: list[TokenId] | None = None
    token_offset: int = UNKNOWN_OFFSET


class _WireBatch(msgspec.Struct):
    instance_id: str
    incarnation: int
    seq: int
    event_type: str
    tier: str
    backend: str | None = ""
    shared: bool = False
    ts: float = 0.0
    entries: list[_WireEntry] = []
    capacity_bytes: int | None = None
    capacity_revision: int | None = None


class _WireBody(msgspec.Struct):
    batches: list[_WireBatch]


_decoder = msgspec.json.Decoder(_WireBody)
_encoder = msgspec.json.Encoder()


def key_from_parts(
    chunk_hash: Any, model_name: str, kv_rank: int, object_group_id: int, cache_salt: str
) -> ObjectKey:
    """Build an ObjectKey; on failure raise an error naming the first bad field."""
    try:
        return ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)
    except ValueError as exc:
        checks: list[tuple[str, Any]] = [
            ("model_name", lambda: check_model_name(model_name)),
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


def _key_from_wire(wk: _WireKey, strings: dict[str, str]) -> ObjectKey:
    try:
        chunk_hash = parse_chunk_hash_hex(wk.chunk_hash_hex)
    except ValueError as exc:
        raise EventValidationError("chunk_hash_hex", str(exc)) from None
    model = strings.setdefault(wk.model_name, wk.model_name)
    salt = strings.setdefault(wk.cache_salt, wk.cache_salt)
    return key_from_parts(chunk_hash, model, wk.kv_rank, wk.object_group_id, salt)


def _batch_from_wire(wb: _WireBatch, strings: dict[str, str]) -> EventBatch:
    entries = []
    for j, we in enumerate(wb.entries):
        try:
            try:
                key = _key_from_wire(we.key, strings)
            except EventValidationError as exc:
                raise exc.under("key") from None
            tokens = None
            if we.token_ids:
                tokens = np.array(we.token_ids, dtype=np.uint32)
                tokens.flags.writeable = False
            entries.append(CacheEntry(key, we.size_bytes, tokens, we.token_offset))
        except EventValidationError as exc:
            raise exc.under(f"entries[{j}]") from None
    return EventBatch(
        instance_id=strings.setdefault(wb.instance_id, wb.instance_id),
        incarnation=wb.incarnation,
        seq=wb.seq,
        event_type=wb.event_type,
        tier=wb.tier,
        backend=strings.setdefault(wb.backend or "", wb.backend or ""),
        shared=wb.shared,
        ts=wb.ts,
        entries=tuple(entries),
        capacity_bytes=wb.capacity_bytes,
        capacity_revision=wb.capacity_revision,
    )


def decode_json(body: bytes | str) -> list[EventBatch]:
    """Decode ``{"batches": [...]}``; raises :class:`EventDecodeError` naming the bad field."""
    try:
        wire = _decoder.decode(body)
    except msgspec.MsgspecError as exc:
        raise decode_error_from_msgspec(exc) from None
    strings: dict[str, str] = {}
    batches = []
    for i, wb in enumerate(wire.batches):
        try:
            batches.append(_batch_from_wire(wb, strings))
        except EventValidationError as exc:
            raise EventDecodeError(*_rooted(exc, f"batches[{i}]")) from None
    return batches


def _rooted(exc: EventValidationError, prefix: str) -> tuple[str, str]:
    moved = exc.under(prefix)
    return moved.field, moved.reason


def batch_to_wire(batch: EventBatch) -> dict[str, Any]:
    """The JSON-ready dict of one batch (LMCache field names)."""
    out: dict[str, Any] = {
        "instance_id": batch.instance_id,
        "incarnation": batch.incarnation,
        "seq": batch.seq,
        "event_type": batch.event_type,
        "tier": batch.tier,
        "backend": batch.backend,
        "shared": batch.shared,
        "ts": batch.ts,
        "entries": [
            {
                "key": e.key.to_wire(),
                "size_bytes": e.size_bytes,
                "token_ids": None if e.token_ids is None else e.token_ids.tolist(),
                "token_offset": e.token_offset,
            }
            for e in batch.entries
        ],
    }
    if batch.capacity_bytes is not None:
        out["capacity_bytes"] = batch.capacity_bytes
        out["capacity_revision"] = batch.capacity_revision
    return out


def encode_json(batches: list[EventBatch] | tuple[EventBatch, ...]) -> bytes:
    return _encoder.encode({"batches": [batch_to_wire(b) for b in batches]})
