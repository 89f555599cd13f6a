"""Compact token storage (``directory/token_store.py``): a chunk's ids are kept as uint16 when
every one fits, else as uint32, and every reader — lookups, listings, the blend index,
snapshots — sees exactly the ids that were stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import BlendIndex, KeyDirectory, load_snapshot, save_snapshot, token_store
from kvatlas.directory.records import record_stored_tokens, record_tokens
from kvatlas.directory.snapshot.format import PREFIX, Header
from kvatlas.directory.token_store import (
    COMPACT_LIMIT,
    stored_batch,
    stored_from_arena,
    stored_one,
    widened,
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
NS = BlendNamespace("m")  # the namespace of the helpers' keys


def ro(values: list[int]) -> Any:
    a = np.array(values, dtype=np.uint32)
    a.flags.writeable = False
    return a


def check_stored(stored: Any, values: list[int]) -> None:
    """Same ids, the right width, read-only and owning its memory."""
    assert stored.tolist() == values
    fits = all(v < COMPACT_LIMIT for v in values)
    assert stored.dtype == (np.uint16 if fits else np.uint32)
    assert not stored.flags.writeable and stored.flags.c_contiguous
    assert stored.flags.owndata or stored.base is None


token_ids = st.one_of(st.integers(0, COMPACT_LIMIT - 1), st.sampled_from(BIG))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(token_ids, max_size=40)), max_size=12))
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
            assert widened(s).dtype == np.uint32 and widened(s).tolist() == a.tolist()
    if len(arrays) > 1 and arrays[0] is not None:
        assert stored[-1] is stored[0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(token_ids, max_size=20), max_size=10))
def test_stored_from_arena_round_trips_every_row(rows: list[list[int]]) -> None:
    arena = np.array([t for r in rows for t in r], dtype=np.uint32)
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    for row, stored in zip(rows, stored_from_arena(arena, starts, lengths), strict=True):
        if not row:
            assert stored is None
        else:
            check_stored(stored, row)
            assert stored.base is None  # its own memory: never a view pinning the arena


def test_a_single_id_that_does_not_fit_keeps_the_chunk_wide() -> None:
    for big in (COMPACT_LIMIT, 70_000, (1 << 32) - 1):
        values = [1, 2, big, 3]
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
    widths = {}
    for n, t in contents.items():
        rec = captured(d)[key(n).chunk_hash]
        stored = record_stored_tokens(rec)
        assert stored is not None
        widths[n] = stored.dtype.itemsize
        public = record_tokens(rec)
        assert public is not None and public.dtype == np.uint32 and public.tolist() == t
        (kp,) = [kp for kp in d.list_keys(limit=10).items if kp.key == key(n)]
        assert kp.content is not None and kp.content.dtype == np.uint32
        assert kp.content.tolist() == t
        m = d.blend_match(np.array([9, 9, *t, 9], dtype=np.uint32), NS)
        assert [(x.chunk_hash, x.old_st, x.cur_st) for x in m] == [(key(n).chunk_hash, 4 * n, 2)]
    assert widths == {1: 2, 2: 4, 3: 4}
    stats = d.stats().blend
    assert stats is not None and stats.token_bytes == (2 + 4 + 4) * CS
    assert stats.token_bytes_owned == 0  # the index shares the directory's arrays


def test_a_content_stored_again_wide_is_the_same_content() -> None:
    """The same ids arriving as a uint32 array for a chunk bound compactly: no rebind."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    d.consume(em.batch("store", [entry(key(1), ro([1, 2, 3, 4]), 0)]))
    before = record_stored_tokens(captured(d)[key(1).chunk_hash])
    d.consume(em.batch("store", [entry(key(1), ro([1, 2, 3, 4]), 0)], tier="l2", backend="fs"))
    assert record_stored_tokens(captured(d)[key(1).chunk_hash]) is before


def downgrade_to_v1(v2: bytes) -> bytes:
    """The version-1 file of the same directory: no widths, every token a uint32."""
    _, header_len = PREFIX.unpack_from(v2)
    header = msgspec.msgpack.decode(v2[PREFIX.size : PREFIX.size + header_len], type=Header)
    widths = np.frombuffer(header.chunk_token_widths, np.uint8)
    lens = np.frombuffer(header.chunk_token_lens, "<u4")
    arena, pos, tokens = v2[PREFIX.size + header_len :], 0, []
    for n, w in zip(lens.tolist(), widths.tolist(), strict=True):
        tokens.append(np.frombuffer(arena, "<u2" if w == 2 else "<u4", n, pos).astype("<u4"))
        pos += n * w
    old = msgspec.structs.replace(header, version=1, chunk_token_widths=b"")
    raw = msgspec.msgpack.encode(old)
    return PREFIX.pack(PREFIX.unpack_from(v2)[0], len(raw)) + raw + np.concatenate(tokens).tobytes()


@pytest.mark.parametrize("version", [2, 1])
def test_snapshots_keep_every_width_and_version_1_files_load_compacted(
    tmp_path: Path, version: int
) -> None:
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    contents = {n: [n, n, n, n] for n in range(1, 6)} | {6: [1, 2, 3, 1 << 20], 7: [*BIG, 0]}
    d.consume(em.batch("store", [entry(key(n), ro(t), 4 * n) for n, t in contents.items()]))
    d.consume(em.batch("store", [entry(key(8))]))  # unknown content
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    header_len = PREFIX.unpack_from(path.read_bytes())[1]
    assert path.stat().st_size == PREFIX.size + header_len + (5 * 2 + 2 * 4) * CS
    if version == 1:
        path.write_bytes(downgrade_to_v1(path.read_bytes()))
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    for n, t in contents.items():
        stored = record_stored_tokens(captured(restored)[key(n).chunk_hash])
        assert stored is not None and stored.tolist() == t
        assert stored.dtype == (np.uint16 if n <= 5 else np.uint32)
        q = np.array([0, *t], dtype=np.uint32)
        assert [m.old_st for m in restored.blend_match(q, NS)] == [4 * n]
    assert record_stored_tokens(captured(restored)[key(8).chunk_hash]) is None
    assert restored.list_keys(limit=100).items == d.list_keys(limit=100).items


def stored_form(tokens: list[int], how: int) -> Any:
    """The same ids handed to the index as the directory hands them (compact or wide, shared),
    as a wide read-only array (shared as is), or as a list (copied)."""
    if how == 0:
        return stored_one(np.array(tokens, dtype=np.uint32))
    if how == 1:
        return ro(tokens)
    return list(tokens)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_blend_answers_with_mixed_widths_equal_the_brute_force_oracle(
    workload: tuple[int, int, int | None, list[list[int]], list[tuple[Any, ...]]],
    data: st.DataObject,
) -> None:
    """The oracle workloads with ids spread over both widths (0 and 1 stay compact, others do
    not), each write handing the index one of the three forms: contents stored compactly are
    compared, found and removed exactly as wide ones."""
    chunk_size, stride, bits, _, ops = workload
    spread = {0: 0, 1: COMPACT_LIMIT - 1, 2: COMPACT_LIMIT}
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
            getattr(index, op[0])(stored_form(tokens, how), *op[2:])
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
    stored, allocated = token_store.stored_columns(cols)
    assert allocated
    assert [None if s is None else s.tolist() for s in stored] == [
        None if e["token_ids"] is None else e["token_ids"] for e in entries
    ]
