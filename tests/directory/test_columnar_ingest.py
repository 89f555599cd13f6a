"""Columnar ingest against the per-entry path (differential): the same random bodies — valid
and broken, JSON, compact msgpack and JSON-shaped msgpack — decoded by the per-entry decoders
and applied batch by batch with ``consume``, and decoded into columns and applied with
``apply_columns``, leave identical directories (placements, bound tokens, counts, cursors,
blend answers) and raise identical errors (class, field, detail)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.query import decode_events
from kvatlas.directory import KeyDirectory
from kvatlas.errors import KvatlasError
from kvatlas.events import (
    CacheEntry,
    EventBatch,
    decode_json,
    decode_json_columns,
    decode_msgpack,
    decode_msgpack_columns,
)
from kvatlas.events.json_codec import batch_to_wire
from kvatlas.events.msgpack_codec import FORMAT_VERSION, _pack_batch
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank

CHUNK = 4
HASHES = [bytes([i]) * 31 + bytes([i * 7 % 256]) for i in range(6)]
SHAPES = [
    ("m", pack_kv_rank(1, 0, 1, 0), 0, ""),
    ("m", pack_kv_rank(2, 1, 2, 1), 0, "s"),
    ("other", pack_kv_rank(1, 0, 1, 0), 7, ""),
]
CONTENTS = [np.arange(CHUNK, dtype=np.uint32) + 10 * i for i in range(3)] + [
    np.array([5, 6, 7], dtype=np.uint32)  # not chunk-sized: bound, never indexed
]
KEYS = [ObjectKey(h, *s) for h in HASHES for s in SHAPES]


@st.composite
def entry_st(draw: st.DrawFn) -> CacheEntry:
    return CacheEntry(
        draw(st.sampled_from(KEYS)),
        draw(st.integers(0, 1 << 20)),
        draw(st.none() | st.sampled_from(CONTENTS)),
        draw(st.sampled_from([-1, 0, CHUNK, 2 * CHUNK])),
    )


@st.composite
def batch_st(draw: st.DrawFn) -> EventBatch:
    kind = draw(st.sampled_from(["store"] * 5 + ["delete", "access", "config", "resync"]))
    es = tuple(draw(st.lists(entry_st(), max_size=6))) if kind != "config" else ()
    extra: dict[str, Any] = {}
    if kind == "config":
        extra = {"capacity_bytes": draw(st.integers(0, 1 << 30)), "capacity_revision": 1}
    if kind == "resync":
        extra = {"prefixes": tuple(sorted({e.key.chunk_hash[:1].hex() for e in es})) or ("00",)}
    return EventBatch(
        draw(st.sampled_from(["a", "b"])),
        draw(st.integers(1, 2)),
        draw(st.integers(1, 4)),
        kind,
        draw(st.sampled_from(["l1", "l2"])),
        draw(st.sampled_from(["dram", "disk"])),
        kind != "resync" and draw(st.booleans()),
        ts=float(draw(st.integers(0, 5))),
        entries=es,
        dropped_events=draw(st.sampled_from([0, 0, 2])),
        **extra,
    )


# (where, field, bad value): "h" a batch header field, "k" a JSON key field, "e" a JSON entry
# field, "c" a compact entry position. Some are valid on purpose (the paths must agree).
JSON_BREAKS: list[tuple[str, str, Any]] = [
    ("k", "chunk_hash_hex", "zz" * 32),
    ("k", "chunk_hash_hex", "ab" * 31),
    ("k", "chunk_hash_hex", " " + "ab" * 31 + "a"),
    ("k", "chunk_hash_hex", "AB" * 32),
    ("k", "chunk_hash_hex", "ab" * 31 + "a" + "\u00e9"),
    ("k", "kv_rank", 0),
    ("k", "kv_rank", 1 << 32),
    ("k", "model_name", "a@b"),
    ("k", "model_name", ""),
    ("k", "cache_salt", "x/y"),
    ("k", "object_group_id", -1),
    ("k", "object_group_id", (1 << 64) - 1),
    ("k", "extra_field", 1),
    ("e", "size_bytes", -1),
    ("e", "size_bytes", 1 << 63),
    ("e", "token_offset", -2),
    ("e", "token_offset", (1 << 63) - 1),
    ("e", "token_ids", [1.5]),
    ("e", "token_ids", [-1]),
    ("e", "token_ids", [1 << 32]),
    ("e", "token_ids", "x"),
    ("e", "token_ids", None),
    ("e", "token_ids", []),
    ("e", "token_ids", [True]),
    ("h", "tier", "l3"),
    ("h", "event_type", "bogus"),
    ("h", "seq", 0),
    ("h", "backend", ""),
    ("h", "incarnation", -1),
    ("h", "capacity_bytes", 5),
    ("h", "prefixes", ["00"]),
    ("h", "entries", "x"),
]
PACKED_BREAKS: list[tuple[str, Any, Any]] = [
    ("c", 0, b"x" * 31),
    ("c", 1, "a@b"),
    ("c", 2, 0),
    ("c", 3, -1),
    ("c", 4, "x\x00"),
    ("c", 5, -1),
    ("c", 6, -2),
    ("c", 7, 99),
    ("c", 7, -2),
    ("h", "contents", [b"abc"]),
    ("h", "tier", "l3"),
    ("h", "seq", 0),
    ("h", "v", 2),
]


def _json_body(batches: list[EventBatch], brk: tuple[str, Any, Any] | None, at: int) -> bytes:
    wire = [batch_to_wire(b) for b in batches]
    _break(wire, brk, at, lambda e: e["key"])
    return msgspec.json.encode({"batches": wire})


def _packed_body(batches: list[EventBatch], brk: tuple[str, Any, Any] | None, at: int) -> bytes:
    wire = [_pack_batch(b) for b in batches]
    for b in wire:
        b["entries"] = [list(e) for e in b["entries"]]
    body: dict[str, Any] = {"v": FORMAT_VERSION, "batches": wire}
    if brk is not None and brk[1] == "v":
        body["v"] = brk[2]
    else:
        _break(wire, brk, at, lambda e: e)
    return msgspec.msgpack.encode(body)


def _break(wire: list[dict[str, Any]], brk: tuple[str, Any, Any] | None, at: int, key: Any) -> None:
    if brk is None or not wire:
        return
    where, name, value = brk
    batch = wire[at % len(wire)]
    if where == "h":
        batch[name] = value
        return
    entries = batch["entries"]
    if not entries:
        return
    target = entries[at % len(entries)]
    {"k": key(target), "e": target, "c": target}[where][name] = value


def _outcome(decode: Any, body: bytes) -> tuple[Any, KvatlasError | None]:
    try:
        return decode(body), None
    except KvatlasError as exc:
        return None, exc


def _state(d: KeyDirectory) -> Any:
    """Everything a client can read back: placements and bound content of every key, the
    counters, the blend index's counts and answers, the cursors and the usage view."""
    looked = d.lookup(KEYS)
    held = [(r.placements, None if r.content is None else r.content.tolist()) for r in looked]
    stats = d.stats()
    blend = stats.blend
    assert blend is not None
    counts = (blend.contents, blend.occupants, blend.claims, blend.namespaces)
    plain = {k: getattr(stats, k) for k in stats.__dataclass_fields__ if k != "blend"}
    spaces = sorted({BlendNamespace(s[0], s[3], s[1] >> 24) for s in SHAPES}, key=repr)
    queries = (np.concatenate(CONTENTS), np.concatenate(CONTENTS[::-1]))
    matches = [sorted(d.blend_match(q, ns), key=repr) for ns in spaces for q in queries]
    return held, plain, counts, matches, d.emitters(), d.usage()


@pytest.mark.parametrize("fmt", ["json", "msgpack", "json-shaped msgpack"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_columns_equal_per_entry_path(fmt: str, data: st.DataObject) -> None:
    breaks: list[Any] = PACKED_BREAKS if fmt == "msgpack" else JSON_BREAKS
    old_decode, new_decode = {
        "json": (decode_json, decode_json_columns),
        "msgpack": (decode_msgpack, decode_msgpack_columns),
        "json-shaped msgpack": (decode_msgpack, decode_msgpack_columns),
    }[fmt]
    old_dir = KeyDirectory(CHUNK, enable_blend_lookup=True)
    new_dir = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for _ in range(data.draw(st.integers(1, 6))):
        batches = data.draw(st.lists(batch_st(), min_size=1, max_size=3))
        brk = data.draw(st.none() | st.sampled_from(breaks))
        at = data.draw(st.integers(0, 20))
        if fmt == "msgpack":
            body = _packed_body(batches, brk, at)
        else:
            body = _json_body(batches, brk, at)
            if fmt == "json-shaped msgpack":
                body = msgspec.msgpack.encode(msgspec.json.decode(body))
        old, old_err = _outcome(old_decode, body)
        new, new_err = _outcome(new_decode, body)
        if old_err is not None or new_err is not None:
            assert type(new_err) is type(old_err)
            assert new_err is not None and old_err is not None
            assert (new_err.detail, new_err.extra) == (old_err.detail, old_err.extra)
            continue
        assert [cb.batch() for cb in new] == old
        outcomes = [old_dir.consume(b) for b in old]
        assert new_dir.apply_columns(new) == outcomes
        assert _state(new_dir) == _state(old_dir)


def test_entry_limit_counts_columns() -> None:
    """``--max-batch-entries`` counts a columnar body's entries as the per-entry path did."""
    entries = tuple(CacheEntry(k, 1, CONTENTS[0], 0) for k in KEYS[:5])
    batch = EventBatch("a", 1, 1, "store", "l1", "dram", entries=entries)
    body = msgspec.json.encode({"batches": [batch_to_wire(batch)]})
    assert sum(b.n_entries for b in decode_events(body, "application/json", 5)) == 5
    with pytest.raises(KvatlasError, match="5 entries exceed --max-batch-entries 4"):
        decode_events(body, "application/json", 4)
