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
    columns,
    decode_json,
    decode_json_columns,
    decode_msgpack,
    decode_msgpack_columns,
)
from kvatlas.events._cut_types import TOKENS
from kvatlas.events._json_cut import cut_entries
from kvatlas.events.json_codec import batch_to_wire
from kvatlas.events.msgpack_codec import FORMAT_VERSION, pack_batch
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


# The strategies are built once, here: one built inside a draw is validated, labelled and
# has its properties computed again at every draw (hypothesis caches them per object), which
# took most of these tests' time. The same strategies, drawn in the same order.
_KEY = st.sampled_from(KEYS)
_SIZE = st.integers(0, 1 << 20)
_CONTENT = st.none() | st.sampled_from(CONTENTS)
_OFFSET = st.sampled_from([-1, 0, CHUNK, 2 * CHUNK])


@st.composite
def entry_st(draw: st.DrawFn) -> CacheEntry:
    return CacheEntry(draw(_KEY), draw(_SIZE), draw(_CONTENT), draw(_OFFSET))


_KIND = st.sampled_from(["store"] * 5 + ["delete", "access", "config", "resync"])
_ENTRIES = st.lists(entry_st(), max_size=6)
_CAPACITY = st.integers(0, 1 << 30)
_INSTANCE = st.sampled_from(["a", "b"])
_INCARNATION = st.integers(1, 2)
_SEQ = st.integers(1, 4)
_TIER = st.sampled_from(["l1", "l2"])
_BACKEND = st.sampled_from(["dram", "disk"])
_TS = st.integers(0, 5)
_DROPPED = st.sampled_from([0, 0, 2])


@st.composite
def batch_st(draw: st.DrawFn) -> EventBatch:
    kind = draw(_KIND)
    es = tuple(draw(_ENTRIES)) if kind != "config" else ()
    extra: dict[str, Any] = {}
    if kind == "config":
        extra = {"capacity_bytes": draw(_CAPACITY), "capacity_revision": 1}
    if kind == "resync":
        extra = {"prefixes": tuple(sorted({e.key.chunk_hash[:1].hex() for e in es})) or ("00",)}
    return EventBatch(
        draw(_INSTANCE),
        draw(_INCARNATION),
        draw(_SEQ),
        kind,
        draw(_TIER),
        draw(_BACKEND),
        kind != "resync" and draw(st.booleans()),
        ts=float(draw(_TS)),
        entries=es,
        dropped_events=draw(_DROPPED),
        **extra,
    )


BATCHES = st.lists(batch_st(), min_size=1, max_size=3)
"""One body's batches (1 to 3)."""


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
    wire = [msgspec.to_builtins(batch_to_wire(b)) for b in batches]
    _break(wire, brk, at, lambda e: e["key"])
    return msgspec.json.encode({"batches": wire})


def _packed_body(batches: list[EventBatch], brk: tuple[str, Any, Any] | None, at: int) -> bytes:
    wire = [msgspec.to_builtins(pack_batch(b), builtin_types=(bytes,)) for b in batches]
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


_BODIES = st.integers(1, 6)
_BREAK = {
    msgpack: st.none() | st.sampled_from(PACKED_BREAKS if msgpack else JSON_BREAKS)
    for msgpack in (False, True)
}  # by whether the format is compact msgpack
_AT = st.integers(0, 20)


@pytest.mark.parametrize("listed", [16, 0], ids=["short batches bounded as lists", "as arrays"])
@pytest.mark.parametrize("fmt", ["json", "msgpack", "json-shaped msgpack"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_columns_equal_per_entry_path(fmt: str, listed: int, data: st.DataObject) -> None:
    """Batches of up to 6 entries: their sizes and offsets bounded as lists, and with the
    lists' bound at 0 the way longer batches' are (numpy)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(columns, "LISTED_ENTRIES", listed)
        _columns_equal_per_entry_path(fmt, data)


def _columns_equal_per_entry_path(fmt: str, data: st.DataObject) -> None:
    old_decode, new_decode = {
        "json": (decode_json, decode_json_columns),
        "msgpack": (decode_msgpack, decode_msgpack_columns),
        "json-shaped msgpack": (decode_msgpack, decode_msgpack_columns),
    }[fmt]
    old_dir = KeyDirectory(CHUNK, enable_blend_lookup=True)
    new_dir = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for _ in range(data.draw(_BODIES)):
        batches = data.draw(BATCHES)
        brk = data.draw(_BREAK[fmt == "msgpack"])
        at = data.draw(_AT)
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
        kept = [cb.columns is not None for cb in new]  # entries as columns: all but these
        assert kept == [b.event_type not in ("resync", "config") for b in old]
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


class Lit(str):
    """JSON text written as it is (a number spelled oddly, a broken value)."""


class Twice(list):  # type: ignore[type-arg]
    """A key written once per value: a duplicate key."""


TOKEN_VALUES = [
    [1, 2, 3, 4], [], None, [4294967295, 0, 7, 9], Lit("[1e3]"), Lit("[1E3,2,3,4]"),
    Lit("[-1,2,3,4]"), Lit("[-0]"), Lit("[1.0,2,3,4]"), Lit("[4294967296,1,2,3]"),
    Lit("[9999999999,1,2,3]"), Lit("[42949672950,1,2,3]"), Lit("[01,2,3,4]"), Lit("[1,2,3,4,]"),
    Lit("[ 1 ,\n2,\t3 , 4 ]"), Lit("[[1],2,3,4]"), Lit('["1",2,3,4]'), Lit("[true]"),
    Lit("null"), Lit("nul"), Lit('"x"'), Lit("{}"), Lit("[1,2,3,4"), Lit("[1 2]"),
    Lit("[18446744073709551617]"), Twice([[1, 2, 3, 4], [5, 6, 7, 8]]), Twice([None, [1, 2]]),
]  # fmt: skip
DECOYS = [  # unknown fields, where a careless scanner would take names for structure
    {"token_ids": [9, 9, 9, 9]},
    {"entries": [{"token_ids": [9, 9, 9, 9]}], "batches": [{"entries": []}]},
    '"token_ids":[9,9,9,9]',
    'a \\"token_ids\\": [1] \\\\',
    ["token_ids", {"token_ids": None}],
    {"token_ids": [9, 9, 9, 9]},
    [9, 9, 9, 9],
]


def _dump(v: Any, rnd: Any, spaced: bool, escaped: bool) -> str:
    """JSON text of ``v`` with random white space and, now and then, a key spelled with an
    escape (``escaped``); :class:`Lit` verbatim, :class:`Twice` as a duplicate key."""

    def ws() -> str:
        return rnd.choice(["", "", " ", "\n", "\t ", "\r\n"]) if spaced else ""

    def key(k: str) -> str:
        if escaped and rnd.random() < 0.1:
            at = rnd.randrange(len(k))
            return '"' + k[:at] + f"\\u{ord(k[at]):04x}" + k[at + 1 :] + '"'
        return msgspec.json.encode(k).decode()

    if isinstance(v, Lit):
        return str(v)
    if isinstance(v, dict):
        items = [
            f"{ws()}{key(k)}{ws()}:{ws()}{_dump(x, rnd, spaced, escaped)}{ws()}"
            for k, xs in v.items()
            for x in (xs if isinstance(xs, Twice) else [xs])
        ]
        return "{" + ",".join(items) + ws() + "}"
    if isinstance(v, list):
        return "[" + ",".join(ws() + _dump(x, rnd, spaced, escaped) + ws() for x in v) + "]"
    return msgspec.json.encode(v).decode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_json_token_cut_equals_per_entry_decoder(data: st.DataObject) -> None:
    """Adversarial JSON (white space, escapes in keys and strings, decoy fields named like the
    structure, duplicate keys, numbers with exponents, signs, fractions, past 2**32 - 1,
    ``null``, empty lists, truncated and mutated bodies): the columnar decoder, which cuts
    the token lists out of the body in one compiled pass where it can, gives exactly the
    per-entry decoder's batches or its error."""
    batches = data.draw(BATCHES)
    wire: dict[str, Any] = {"batches": [msgspec.to_builtins(batch_to_wire(b)) for b in batches]}
    rnd = data.draw(st.randoms(use_true_random=True))
    for b in wire["batches"]:
        for e in b["entries"]:
            if rnd.random() < 0.3:
                e["token_ids"] = rnd.choice(TOKEN_VALUES)
            if rnd.random() < 0.2:
                e[rnd.choice(["x", "key2", "token_ids_"])] = rnd.choice(DECOYS)
            if rnd.random() < 0.1:
                e["key"]["token_ids"] = rnd.choice(DECOYS)  # refused: unknown key field
            if rnd.random() < 0.05:
                del e["token_ids"]
            if rnd.random() < 0.5:  # any key order
                items = list(e.items())
                rnd.shuffle(items)
                e.clear()
                e.update(items)
        if rnd.random() < 0.3:  # an int list under a followed name, in the wrong object
            b[rnd.choice(["notes", "token_ids", "token_ids", "batches"])] = rnd.choice(DECOYS[-2:])
        if rnd.random() < 0.05:
            b["entries"] = Twice([b["entries"], b["entries"][:1]])
    if rnd.random() < 0.1:
        wire[rnd.choice(["extra", "token_ids", "entries"])] = rnd.choice(DECOYS)
    if rnd.random() < 0.05:
        wire["batches"] = Twice([wire["batches"], []])
    text = _dump(wire, rnd, data.draw(st.booleans()), data.draw(st.booleans()))
    body = text.encode()
    cut = data.draw(st.sampled_from(["none"] * 6 + ["truncate", "mutate"]))
    if cut == "truncate":
        body = body[: data.draw(st.integers(0, len(body)))]
    elif cut == "mutate" and body:
        at = data.draw(st.integers(0, len(body) - 1))
        body = body[:at] + bytes([data.draw(st.sampled_from(b'"\\[]{},: 0-e'))]) + body[at + 1 :]
    old, old_err = _outcome(decode_json, body)
    new, new_err = _outcome(decode_json_columns, body)
    if old_err is not None or new_err is not None:
        assert type(new_err) is type(old_err), (body, old_err, new_err)
        assert new_err is not None and old_err is not None
        assert (new_err.detail, new_err.extra) == (old_err.detail, old_err.extra)
        return
    assert [cb.batch() for cb in new] == old


def test_json_token_cut_takes_plain_bodies_and_refuses_what_it_is_not_sure_of() -> None:
    """The one-pass cut is what decodes an ordinary body (the differential test above tests
    it, not only the Raw path), and gives up on what only the per-entry path may judge."""
    batch = EventBatch(
        "a", 1, 1, "store", "l1", "dram", entries=(CacheEntry(KEYS[0], 1, CONTENTS[0], 0),)
    )
    body = msgspec.json.encode({"batches": [batch_to_wire(batch)]})
    cut = cut_entries(body)
    assert cut is not None
    assert b'"entries":[]' in bytes(cut.small) and b"token_ids" not in bytes(cut.small)
    assert cut.cols[TOKENS].tolist() == [CHUNK] and cut.counts.tolist() == [1]
    assert cut.arena[:CHUNK].tolist() == CONTENTS[0].tolist()
    assert cut.hashes.tobytes() == KEYS[0].chunk_hash
    for refused in (
        body.replace(b'"token_ids"', b'"token\\u005fids"'),
        body.replace(b'"entries"', b'"entri\\u0065s"'),
        body.replace(b"[0,1,2,3]", b"[0,1,2,3e0]"),
        body.replace(b'"token_ids":[0,1,2,3]', b'"token_ids":[0,1,2,3],"token_ids":null'),
        body.replace(b'"size_bytes":1', b'"size_bytes":1.0'),
        body.replace(b'"size_bytes":1', b'"size_bytes":-0'),
        body.replace(b'"size_bytes":1', b'"size_bytes":1,"note":1'),  # msgspec ignores it
        body.replace(b'"model_name":"m"', b'"model_name":"\\u006d"'),
        body.replace(b'"kv_rank":', b'"kv_rank":1,"kv_rank":'),
        body[:-3],
    ):
        assert refused != body and cut_entries(refused) is None, refused
