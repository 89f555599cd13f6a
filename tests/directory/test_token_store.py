"""Compact token storage (``directory/token_store.py``): a chunk's ids are kept as uint16 when
every one fits, in the planes form (``blend/kernels/planes.py``) when every one is below 2^24
and that is smaller, else as uint32 — the bytes of each form checked against a brute-force
encoder — and every reader (lookups, listings, the blend index, snapshots) sees exactly the
ids that were stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import BlendIndex, KeyDirectory, load_snapshot, save_snapshot, token_store
from kvatlas.directory.blend.kernels.contents import content_count
from kvatlas.directory.blend.kernels.planes import PLANES, planes_count, stored_nbytes
from kvatlas.directory.blend.op_checks import token_nbytes, token_widths
from kvatlas.directory.blend.op_columns import addresses, vouched_addresses
from kvatlas.directory.records import record_stored_tokens, record_tokens
from kvatlas.directory.snapshot.format import PREFIX, Header
from kvatlas.directory.snapshot.integrity import trailer_size
from kvatlas.directory.snapshot.token_section import FILL_PIECE
from kvatlas.directory.token_store import (
    COMPACT_LIMIT,
    stored_batch,
    stored_equal,
    stored_form,
    stored_from_arena,
    stored_one,
    stored_payload,
    stored_shapes,
    stored_view,
    token_count,
    widened,
    widened_many,
)
from kvatlas.events import decode_json_columns
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key
from tests.directory.test_blend_index_oracle import (
    Oracle,
    assert_ascending,
    canonical,
    workloads,
)

BIG = [COMPACT_LIMIT - 1, COMPACT_LIMIT, (1 << 32) - 1]
BOUNDARY = [0, 65_535, 65_536, (1 << 24) - 1, 1 << 24, (1 << 32) - 1]
NS = BlendNamespace("m")  # the namespace of the helpers' keys


def oracle_stored(values: list[int]) -> tuple[str, bytes]:
    """The form and bytes the directory must store ``values`` in, by brute force: uint16 if
    every id fits; else the planes form (h = the largest id's bit length - 16, at most 8:
    header ``h, 0``, the low halves, then h planes of ``2·⌈n/16⌉`` bytes, bit ``16 + p`` of
    id k at bit ``k % 8`` of byte ``k // 8`` of plane p) when it is smaller than uint32;
    else uint32. Little-endian."""
    n, top = len(values), max(values, default=0)
    if top < 1 << 16:
        return "uint16", b"".join(v.to_bytes(2, "little") for v in values)
    h = top.bit_length() - 16
    plane = 2 * ((n + 15) // 16)
    if h <= 8 and 2 + 2 * n + h * plane < 4 * n:
        out = bytearray(2 + 2 * n + h * plane)
        out[0] = h
        for k, v in enumerate(values):
            out[2 + 2 * k : 4 + 2 * k] = (v & 0xFFFF).to_bytes(2, "little")
            for p in range(h):
                if v >> (16 + p) & 1:
                    out[2 + 2 * n + p * plane + k // 8] |= 1 << (k % 8)
        return "planes", bytes(out)
    return "uint32", b"".join(v.to_bytes(4, "little") for v in values)


def ro(values: list[int]) -> Any:
    a = np.array(values, dtype=np.uint32)
    a.flags.writeable = False
    return a


def form_code_name(form: int) -> str:
    return {2: "uint16", 4: "uint32"}.get(form, "planes")


def form_name(stored: Any) -> str:
    return form_code_name(stored_form(stored))


HEADERS = {"uint16": b"\x00\x02", "uint32": b"\x00\x04\x00\x00", "planes": b""}
"""What a content holds before the bytes of its form (``blend/kernels/contents.py``)."""


def check_stored(stored: Any, values: list[int]) -> None:
    """Same ids, the form and bytes of the brute-force encoder after the header naming the
    form, in one immutable ``bytes`` (its ids inline); widened back exactly; its count,
    shape and view read back."""
    form, raw = oracle_stored(values)
    assert type(stored) is bytes and stored == HEADERS[form] + raw
    assert (form_name(stored), bytes(stored_payload(stored))) == (form, raw)
    wide = widened(stored)
    assert wide.dtype == np.uint32 and not wide.flags.writeable and wide.tolist() == values
    assert token_count(stored) == len(values) == content_count(stored)
    assert stored_shapes([stored])[0].tolist() == [len(values)]
    assert stored_shapes([stored])[1].tolist() == [stored_form(stored)]
    view = stored_view(stored)
    assert not view.flags.writeable and view.flags.aligned and view.tobytes() == raw
    assert view.dtype == {"uint16": np.uint16, "uint32": np.uint32}.get(form, PLANES)


token_ids = st.one_of(
    st.integers(0, COMPACT_LIMIT - 1),
    st.integers(COMPACT_LIMIT, 128_255),  # Llama 3's vocabulary
    st.integers(0, (1 << 24) - 1),
    st.integers(0, (1 << 32) - 1),
    st.sampled_from(BOUNDARY),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(token_ids, max_size=300)), max_size=12))
def test_stored_batch_round_trips_every_id(rows: list[list[int] | None]) -> None:
    arrays = [None if r is None else ro(r) for r in rows]
    if len(arrays) > 1 and arrays[0] is not None:
        arrays[-1] = arrays[0]  # ranks of one chunk share their input array
    stored = stored_batch(arrays)
    for a, s in zip(arrays, stored, strict=True):
        if a is None:
            assert s is None
        else:
            check_stored(s, a.tolist())
    if len(arrays) > 1 and arrays[0] is not None:
        assert stored[-1] is stored[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(token_ids, max_size=300)), max_size=12))
def test_widened_many_is_widened_of_each_content(rows: list[list[int] | None]) -> None:
    stored = stored_batch([None if r is None else ro(r) for r in rows])
    if len(stored) > 1:
        stored[-1] = stored[0]  # ranks of one chunk: one content twice
    wide = widened_many(stored)
    assert len(wide) == len(stored)
    for s, w in zip(stored, wide, strict=True):
        if s is None:
            assert w is None
        else:
            assert w is not None and w.dtype == np.uint32 and not w.flags.writeable
            assert w.tolist() == widened(s).tolist()


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 300),
    st.lists(st.sampled_from([None, 1 << 16, 1 << 24, 1 << 32]), min_size=1, max_size=12),
    st.integers(0, 2**32 - 1),
)
def test_widened_many_of_one_length_is_rows_of_one_array(
    n: int, bounds: list[int | None], seed: int
) -> None:
    """Contents of one length (a lookup's chunks), in every form and with absent ones among
    them: each is widened as alone, as a read-only row of one array (the uniform path)."""
    rng = np.random.default_rng(seed)
    rows = [None if b is None else rng.integers(0, b, n, dtype=np.uint64).tolist() for b in bounds]
    stored = stored_batch([None if r is None else ro(r) for r in rows])
    wide = widened_many(stored)
    assert len(wide) == len(stored)
    present = [w for w in wide if w is not None]
    for r, w in zip(rows, wide, strict=True):
        assert (w is None) == (r is None)
        if w is not None:
            assert w.dtype == np.uint32 and w.shape == (n,) and not w.flags.writeable
            assert w.tolist() == r
    if present:  # one buffer: consecutive rows
        base = present[0].ctypes.data
        assert [w.ctypes.data for w in present] == [base + 4 * n * i for i in range(len(present))]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(token_ids, max_size=300), max_size=10))
def test_stored_from_arena_round_trips_every_row(rows: list[list[int]]) -> None:
    arena = np.array([t for r in rows for t in r], dtype=np.uint32)
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    for row, stored in zip(rows, stored_from_arena(arena, starts, lengths), strict=True):
        if not row:
            assert stored is None
        else:
            check_stored(stored, row)  # its own bytes: never a view pinning the arena


@settings(max_examples=200, deadline=None)
@given(st.lists(token_ids, max_size=300), st.sampled_from(["int64", "uint32", "uint16"]))
def test_stored_one_round_trips_every_id(values: list[int], dtype: str) -> None:
    if dtype == "uint16":
        values = [v & 0xFFFF for v in values]
    check_stored(stored_one(np.array(values, dtype=dtype)), values)


def test_boundary_ids_round_trip_in_every_form_and_length() -> None:
    """0, 2^16 - 1, 2^16, 2^24 - 1, 2^24, 2^32 - 1 — alone, among small ids, at the start,
    middle and end of chunks of 1 to 257 ids — through every way in."""
    for v in BOUNDARY:
        for n in (1, 2, 7, 8, 9, 15, 16, 17, 64, 255, 256, 257):
            for at in {0, n // 2, n - 1}:
                values = [(7 * k) % 1000 for k in range(n)]
                values[at] = v
                (a,) = stored_batch([ro(values)])
                (b,) = stored_from_arena(ro([1, *values]), np.array([1]), np.array([n]))
                c = stored_one(np.array(values, dtype=np.int64))
                for stored in (a, b, c):
                    check_stored(stored, values)
                assert stored_equal(a, b) and stored_equal(b, c)
    llama3 = stored_one(np.arange(128_000, 128_256, dtype=np.uint32))
    assert form_name(llama3) == "planes" and len(llama3) == 546  # 17 bits per id + 2


def test_a_single_id_that_does_not_fit_keeps_the_chunk_wide() -> None:
    for big in (COMPACT_LIMIT, 70_000, (1 << 24) - 1, 1 << 24, (1 << 32) - 1):
        values = [1, 2, big, 3] * 8
        (stored,) = stored_batch([ro(values)])
        check_stored(stored, values)
    check_stored(stored_one(np.array([5, COMPACT_LIMIT - 1], dtype=np.int64)), [5, 65535])
    strided = np.arange(8, dtype=np.uint32)[::2]
    strided.flags.writeable = False
    (stored,) = stored_batch([strided])
    check_stored(stored, [0, 2, 4, 6])


def test_stored_from_arena_refuses_rows_outside_it() -> None:
    arena = np.arange(4, dtype=np.uint32)
    for starts, lengths in (([2], [3]), ([-1], [1]), ([0], [-1]), ([0, 1], [1])):
        with pytest.raises(ValueError):
            stored_from_arena(arena, np.array(starts, np.int64), np.array(lengths, np.int64))


def test_directory_answers_exact_ids_for_compact_wide_and_mixed_chunks() -> None:
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    contents = {1: [1, 2, 3, 4], 2: [70_000, 2, 3, 4], 3: [5, 6, 7, (1 << 32) - 1]}
    d.consume(em.batch("store", [entry(key(n), ro(t), 4 * n) for n, t in contents.items()]))
    forms = {}
    for n, t in contents.items():
        rec = captured(d)[key(n).chunk_hash]
        stored = record_stored_tokens(rec)
        assert stored is not None
        forms[n] = form_name(stored)
        public = record_tokens(rec)
        assert public is not None and public.dtype == np.uint32 and public.tolist() == t
        (kp,) = [kp for kp in d.list_keys(limit=10).items if kp.key == key(n)]
        assert kp.content is not None and kp.content.dtype == np.uint32
        assert kp.content.tolist() == t
        m = d.blend_match(np.array([9, 9, *t, 9], dtype=np.uint32), NS)
        assert [(x.chunk_hash, x.old_st, x.cur_st) for x in m] == [(key(n).chunk_hash, 4 * n, 2)]
    assert forms == {1: "uint16", 2: "planes", 3: "uint32"}
    stats = d.stats().blend
    # the ids' bytes (a content's header not counted): planes 2 + 8 + 2
    assert stats is not None and stats.token_bytes == 2 * CS + 12 + 4 * CS
    assert stats.token_bytes_owned == 0  # the index shares the directory's contents


def test_a_content_stored_again_wide_is_the_same_content() -> None:
    """The same ids arriving as a uint32 array for a chunk bound compactly: no rebind."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    d.consume(em.batch("store", [entry(key(1), ro([1, 2, 3, 4]), 0)]))
    before = record_stored_tokens(captured(d)[key(1).chunk_hash])
    d.consume(em.batch("store", [entry(key(1), ro([1, 2, 3, 4]), 0)], tier="l2", backend="fs"))
    assert record_stored_tokens(captured(d)[key(1).chunk_hash]) is before


def downgrade(v3: bytes, version: int) -> bytes:
    """The file an older writer makes of the same directory: version 2 (uint16 and uint32
    only: every planes-form chunk uint32) or version 1 (no widths, every token a uint32);
    ``v3``: the writer's (version 6, its checksums after the token section)."""
    _, header_len = PREFIX.unpack_from(v3)
    header = msgspec.msgpack.decode(v3[PREFIX.size : PREFIX.size + header_len], type=Header[bytes])
    forms = np.frombuffer(header.chunk_token_widths, np.uint8).tolist()
    lens = np.frombuffer(header.chunk_token_lens, "<u4").tolist()
    trailer = trailer_size(len(lens), header.checksum_piece)  # (version 6: the checksums)
    arena, pos, tokens = v3[PREFIX.size + header_len : len(v3) - trailer], 0, []
    for n, form in zip(lens, forms, strict=True):
        size = stored_nbytes(n, form)
        raw = arena[pos : pos + size]
        pos += size
        tokens.append(widened(HEADERS[form_code_name(form)] + raw))
    assert pos == len(arena)
    wide = [4 if f > 4 else f for f in forms] if version == 2 else []
    if version == 2:
        arena_out = b"".join(
            (t.astype("<u2") if w == 2 else t.astype("<u4")).tobytes()
            for t, w in zip(tokens, wide, strict=True)
        )
    else:
        arena_out = np.concatenate(tokens).astype("<u4").tobytes()
    old = msgspec.structs.replace(
        header, version=version, chunk_token_widths=bytes(wide) if version == 2 else b""
    )
    raw_header = msgspec.msgpack.encode(old)
    return PREFIX.pack(PREFIX.unpack_from(v3)[0], len(raw_header)) + raw_header + arena_out


@pytest.mark.parametrize("version", [3, 2, 1])
def test_snapshots_keep_every_form_and_older_files_load_in_the_forms_ids_need(
    tmp_path: Path, version: int
) -> None:
    """A version-3 file keeps each chunk's form; one written before the planes form existed
    (version 2: uint32 where the planes form is smaller; version 1: all uint32) restores the
    same ids, each chunk in the form its ids need, matchable at once."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    contents = {n: [n, n, n, n] for n in range(1, 6)} | {
        6: [1, 2, 3, 1 << 20],
        7: [*BIG, 0],
        8: [70_000, 1, 2, 131_071],
    }
    d.consume(em.batch("store", [entry(key(n), ro(t), 4 * n) for n, t in contents.items()]))
    d.consume(em.batch("store", [entry(key(9))]))  # unknown content
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    header_len = PREFIX.unpack_from(path.read_bytes())[1]
    arena = 5 * 2 * CS + 2 * 4 * CS + 12
    assert path.stat().st_size == PREFIX.size + header_len + arena + trailer_size(9, FILL_PIECE)
    if version < 3:
        path.write_bytes(downgrade(path.read_bytes(), version))
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    for n, t in contents.items():
        stored = record_stored_tokens(captured(restored)[key(n).chunk_hash])
        assert stored is not None
        check_stored(stored, t)
        q = np.array([0, *t], dtype=np.uint32)
        assert [m.old_st for m in restored.blend_match(q, NS)] == [4 * n]
    assert record_stored_tokens(captured(restored)[key(9).chunk_hash]) is None
    assert restored.list_keys(limit=100).items == d.list_keys(limit=100).items


def handed_form(tokens: list[int], how: int) -> Any:
    """The same ids handed to the index as the directory hands them (compact or wide, shared),
    as a wide read-only array (shared as is), or as a list (copied)."""
    if how == 0:
        return stored_one(np.array(tokens, dtype=np.uint32))
    if how == 1:
        return ro(tokens)
    return list(tokens)


SPREAD = [5, 0x1_0005, 0x2_0005, 0x3_0005, 0, 65_535, (1 << 24) - 1, (1 << 32) - 1]
"""Ids for the oracle workloads' tokens: four with the low half 5 (one or two high bits)."""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_blend_answers_with_mixed_widths_equal_the_brute_force_oracle(
    workload: tuple[int, int, int | None, list[list[int]], list[tuple[Any, ...]]],
    data: st.DataObject,
) -> None:
    """The oracle workloads with ids spread over every form (uint16, the planes form with one
    or two high bits, uint32; most of them sharing their low 16 bits, so only the high bits
    tell them apart), each write handing the index one of the three ways: contents stored in
    any form are compared, found and removed exactly as wide ones."""
    chunk_size, stride, bits, _, ops = workload
    values = data.draw(st.lists(st.sampled_from(SPREAD), min_size=3, max_size=3, unique=True))
    spread = dict(enumerate(values))
    kwargs = {} if bits is None else {"_fingerprint_bits": bits}
    index = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)  # type: ignore[arg-type]
    oracle = Oracle(chunk_size, stride)
    for op in ops:
        if op[0] == "match":
            query = [spread[t] for piece in op[1] for t in piece]
            got = index.match(np.array(query, dtype=np.uint32), op[2])
            assert_ascending(got)
            assert canonical(got) == canonical(oracle.match(query, op[2]))
        else:
            tokens = [spread[t] for t in op[1]]
            how = data.draw(st.integers(0, 2))
            getattr(index, op[0])(handed_form(tokens, how), *op[2:])
            getattr(oracle, op[0])(tokens, *op[2:])


def test_a_body_with_token_less_entries_is_stored_straight_from_its_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token-less entry (``null``) has length 0 at the next entry's start: no shared row, so
    the batch is still stored from its arena (not entry by entry through ``stored_batch``)."""
    rank = key(0).kv_rank
    entries = [
        {
            "key": {"chunk_hash_hex": f"{i:02x}" * 32, "model_name": "m", "kv_rank": rank},
            "size_bytes": 1,
            "token_ids": None if i == 1 else [i, i, BIG[i % 3], 7],
            "token_offset": 0,
        }
        for i in range(4)
    ]
    batch = {"instance_id": "a", "incarnation": 1, "seq": 1, "event_type": "store"}
    body = {"batches": [{**batch, "tier": "l1", "backend": "dram", "entries": entries}]}
    cols = decode_json_columns(msgspec.json.encode(body))[0].columns
    assert cols is not None

    def per_entry(*_: Any) -> Any:
        raise AssertionError("stored entry by entry")

    monkeypatch.setattr(token_store, "stored_batch", per_entry)
    stored = token_store.stored_columns(cols)
    assert [None if s is None else widened(s).tolist() for s in stored] == [
        None if e["token_ids"] is None else e["token_ids"] for e in entries
    ]


def test_planes_contents_match_only_with_their_high_bits() -> None:
    """A query whose window has a stored content's low halves but other high bits — one bit
    less, one more, one above the content's planes — is no match; the genuine window is."""
    index = BlendIndex(chunk_size=256)
    rng = np.random.default_rng(7)
    genuine = rng.integers(0, 128_256, 256, dtype=np.uint32)
    genuine[0] = 0x1_0000  # an id of each kind: the planes form with one high bit
    stored = stored_one(genuine)
    assert form_name(stored) == "planes" and len(stored) == 546
    index.add(stored, b"g" * 32, 512, NS)
    pad = np.array([1, 2, 3], dtype=np.uint32)
    for k, flip in ((0, 0x1_0000), (1, 0x2_0000), (200, 0x1_0000), (255, 1 << 31)):
        near = genuine.copy()
        near[k] ^= flip
        assert index.match(np.concatenate([pad, near]), NS) == [], (k, flip)
    (m,) = index.match(np.concatenate([pad, genuine, pad]), NS)
    assert (m.chunk_hash, m.old_st, m.cur_st) == (b"g" * 32, 512, 3)
    stats = index.stats()
    assert stats.token_bytes == 546 and stats.token_bytes_owned == 0  # kept, not copied


def test_a_malformed_planes_array_is_refused_not_read() -> None:
    """An array of the planes dtype whose header or length is wrong never reaches the
    kernels (they would read past it); one of another length is content of another length
    (not indexed), never read as a chunk."""
    index = BlendIndex(chunk_size=4)
    good = stored_one(np.array([70_000, 1, 2, 3], dtype=np.uint32))
    assert form_name(good) == "planes" and token_count(good) == 4

    def planes(raw: bytes) -> Any:
        arr = np.frombuffer(raw, np.uint8).copy().view(PLANES)
        arr.flags.writeable = False
        return arr

    body = good[2:]
    for raw in (b"\x00\x00" + body, b"\x09\x00" + body, good + b"\x00", b"\x01"):
        with pytest.raises(ValueError):
            index.add(planes(raw), b"h", 0, NS)
        with pytest.raises(ValueError):
            index.add_many([(planes(raw), b"h", 0, NS)])
        with pytest.raises(ValueError):  # the same bytes as a content
            index.add(raw, b"h", 0, NS)
        with pytest.raises(ValueError):
            index.add_many([(raw, b"h", 0, NS)])
    for raw, n in ((good[:-2], 3), (good + b"\x00\x00", 5)):
        assert planes_count(planes(raw)) == n == content_count(raw)
        index.add(planes(raw), b"h", 0, NS)
        index.add_many([(planes(raw), b"h", 0, NS)])
        index.add(raw, b"h", 0, NS)
        index.add_many([(raw, b"h", 0, NS)])
    assert index.stats().contents == 0


@pytest.mark.parametrize(
    "raw",
    [b"", b"\x00", b"\x00\x03\x00\x00", b"\x00\x02\x00", b"\x00\x04\x00\x00\x01", b"\x00\x01"],
)
def test_a_malformed_plain_content_is_refused_not_read(raw: bytes) -> None:
    """``bytes`` handed to the index are read as a content only when well formed: a header
    of no form, or a length that is not a whole number of ids after it, is refused."""
    index = BlendIndex(chunk_size=4)
    with pytest.raises(ValueError):
        content_count(raw)
    with pytest.raises(ValueError):
        index.add(raw, b"h", 0, NS)
    with pytest.raises(ValueError):
        index.add_many([(raw, b"h", 0, NS)])
    assert index.stats().contents == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(token_ids, min_size=1, max_size=300), min_size=1, max_size=12))
def test_vouched_contents_widths_and_addresses_in_one_pass(rows: list[list[int]]) -> None:
    """The compiled pass over stored contents' headers (what an ingest batch's index adds
    read) gives each one's bytes per id and ids' address as the call per content does, and
    the bytes of all their ids, as ``token_nbytes`` counts them; arrays take that call (and
    are not counted)."""
    arrays = [ro(r) for r in rows]
    stored = [s for s in stored_batch(arrays) if s is not None]
    for tokens in (stored, arrays):
        widths, addrs, id_bytes = vouched_addresses(tokens)
        assert widths.tolist() == token_widths(tokens).tolist()
        assert addrs.tolist() == addresses(tokens, token_widths(tokens)).tolist()
        assert id_bytes == (sum(map(token_nbytes, stored)) if tokens is stored else None)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 65_535), st.sampled_from([2, 4, 17, 18, 19, 24])),
        max_size=60,
    ),
    st.sampled_from([np.uint16, np.uint32, np.int64]),
)
def test_form_and_content_sizes_are_the_bytes_each_form_takes(
    shapes: list[tuple[int, int]], dtype: Any
) -> None:
    """The sizes the restore allocates and reads by (one compiled pass) against each form's
    layout written out: ``uint16`` and ``uint32`` ids after a header of the id width, the
    planes form's header, low halves and ``h`` planes of ``2·⌈n/16⌉`` bytes."""
    lens = np.array([n for n, _ in shapes], dtype)
    forms = np.array([f for _, f in shapes], np.int64)
    stored = [n * f if f < 16 else 2 + 2 * n + (f - 16) * 2 * (-(-n // 16)) for n, f in shapes]
    assert token_store.form_sizes(lens, forms).tolist() == stored
    headers = [f if f < 16 else 0 for _, f in shapes]
    assert token_store.content_sizes(lens, forms).tolist() == [
        s + h for s, h in zip(stored, headers, strict=True)
    ]
