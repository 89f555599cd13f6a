"""The chunk table's records as columns (chunk_parts.py): a partition reads and writes as the
``dict[bytes, Record]`` it replaced, and a capture built outside the lock still holds the
records as they were when it took the partition."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvatlas.directory.capture as capture_module
from kvatlas.directory import KeyDirectory
from kvatlas.directory.chunk_parts import (
    ChunkColumns,
    ChunkPart,
    add_fresh,
    new_parts,
    remove_chunks,
)
from kvatlas.directory.records import make_record, new_record, placement_row
from kvatlas.errors import InvalidInput
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.directory.helpers import CS, Emitter, captured, entry, toks

ROW = placement_row("a", 1, "l1", "dram", 10, False, 0.0)
OTHER = placement_row("b", 2, "l2", "fs", 20, False, 1.0)


def record(n: int, keys: int) -> Any:
    pairs = [(s, ROW if s % 2 else (ROW, OTHER)) for s in range(keys)]
    return make_record(toks(n, n, n, n) if n % 3 else None, 4 * n - 1, n % 2 == 0, pairs)


def h(n: int) -> bytes:
    return bytes([n % 4]) + n.to_bytes(31, "big")


ops = st.lists(
    st.tuples(st.sampled_from(["set", "del", "fresh"]), st.integers(0, 40), st.integers(1, 3)),
    max_size=300,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
@example(ops=[("set", 1, 1), ("set", 2, 1), ("del", 1, 1), ("del", 2, 1), ("fresh", 3, 2)])
def test_partitions_behave_as_dicts_as_rows_are_freed_and_reused(
    ops: list[tuple[str, int, int]],
) -> None:
    parts, model = new_parts(4), [{} for _ in range(4)]
    for op, n, keys in ops:
        part, ref = parts[h(n)[0]], model[h(n)[0]]
        if op == "set":
            part[h(n)] = ref[h(n)] = record(n, keys)
        elif op == "del" and h(n) in ref:
            del part[h(n)], ref[h(n)]
        elif op == "fresh":  # a batch of new chunks, through free rows first
            hs = [x for x in (h(n + i) for i in range(keys * 3)) if x not in model[x[0]]]
            hs = list(dict.fromkeys(hs))
            if hs:
                tokens = [toks(1, 2, 3, 4) if i % 3 else None for i in range(len(hs))]
                parts_of = [parts[x[0]] for x in hs]
                offs = np.arange(len(hs), dtype=np.int64)
                assert add_fresh(parts_of, hs, tokens, offs, [True] * len(hs), 2, [ROW] * len(hs))
                for x, tok, o in zip(hs, tokens, offs.tolist(), strict=True):
                    model[x[0]][x] = new_record(tok, o, True, 2, ROW)
        for p, r in zip(parts, model, strict=True):
            assert list(p) == list(r) and len(p) == len(r)
            assert p.values() == list(r.values()) and p == r
        known = sum(rec[0] is not None for r in model for rec in r.values())
        assert parts[0].cols.bound == known  # the count stats read, kept by every write
    cols = parts[0].cols
    assert all(p.cols is cols for p in parts)
    live = sorted(r for p in parts for r in p.row.values())
    assert sorted(live + cols.free.tolist()) == list(
        range(len(cols.offsets))
    )  # every row used once


def test_a_fresh_batch_with_a_held_chunk_changes_nothing() -> None:
    parts = new_parts(4)
    parts[h(1)[0]][h(1)] = new_record(None, 0, False, 0, ROW)
    parts[h(2)[0]][h(2)] = new_record(None, 0, False, 0, ROW)
    del parts[h(2)[0]][h(2)]  # a free row
    cols: ChunkColumns = parts[0].cols
    before = (list(cols.objs), list(cols.offsets), [dict(p.row) for p in parts], list(cols.free))
    hashes = [h(n) for n in (5, 6, 1, 7)]
    parts_of: list[ChunkPart] = [parts[x[0]] for x in hashes]
    tokens = [toks(n, n, n, n) for n in range(4)]
    ok = add_fresh(parts_of, hashes, tokens, np.arange(4) * CS, [True] * 4, 0, [ROW] * 4)
    assert not ok
    after = (list(cols.objs), list(cols.offsets), [dict(p.row) for p in parts], list(cols.free))
    assert after == before


@pytest.mark.parametrize("n", [2, 3, 6])
def test_a_fresh_batch_naming_a_chunk_twice_changes_nothing(n: int) -> None:
    """A hash twice in one batch is as a held chunk: ``False``, nothing changed (the bulk
    store relies on it instead of checking the hashes distinct), chunk by chunk
    (``FEW_FRESH``) as in the batch kernel."""
    parts = new_parts(4)
    parts[h(2)[0]][h(2)] = new_record(None, 0, False, 0, ROW)
    del parts[h(2)[0]][h(2)]  # a free row
    cols: ChunkColumns = parts[0].cols
    before = (list(cols.objs), list(cols.offsets), [dict(p.row) for p in parts], list(cols.free))
    hashes = [h(5 + i) for i in range(n - 1)] + [h(5)]
    parts_of: list[ChunkPart] = [parts[x[0]] for x in hashes]
    tokens = [toks(i, i, i, i) for i in range(n)]
    ok = add_fresh(parts_of, hashes, tokens, np.arange(n) * CS, [True] * n, 0, [ROW] * n)
    assert not ok
    after = (list(cols.objs), list(cols.offsets), [dict(p.row) for p in parts], list(cols.free))
    assert after == before


def in_part_1(i: int) -> ObjectKey:
    return ObjectKey(bytes([1]) + bytes([i]) * 31, "m", pack_kv_rank(1, 0, 1, 0))


def test_a_capture_holds_the_records_taken_while_others_change_them() -> None:
    """A partition's records are built from the columns after the lock is let go: changes to
    that partition's chunks in that window (re-store, new content, delete, new chunk) must not
    show in the capture."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    d.consume(
        em.batch("store", [entry(in_part_1(i), toks(i, i, i, i), 4 * i) for i in range(1, 7)])
    )
    before = captured(d)
    original = capture_module.copy_rows
    changed = []

    def change_then_copy(objs: Any, offsets: Any, rows: list[int]) -> Any:
        if rows and not changed:  # partition 1, taken: change its chunks before the copy
            changed.append(True)
            d.consume(em.batch("store", [entry(in_part_1(1), None, -1, size=99)], tier="l2"))
            d.consume(em.batch("store", [entry(in_part_1(2), toks(7, 7, 7, 7), 8)]))
            d.consume(em.batch("delete", [entry(in_part_1(3))]))
            d.consume(em.batch("store", [entry(in_part_1(9), toks(9, 9, 9, 9), 4)]))
        return original(objs, offsets, rows)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(capture_module, "copy_rows", change_then_copy)
        during = captured(d)
    assert changed and during == before
    assert captured(d) != before  # (the changes happened)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 39), max_size=40),
    st.integers(0, 39),
    st.integers(0, 40),
)
def test_copied_rows_are_the_rows_fields_whichever_way_they_are_gathered(
    scattered: list[int], first: int, run: int
) -> None:
    """Any rows (scattered, repeated, or one run of consecutive rows — what a batch of new
    chunks is given, copied as two slices) copy each row's fields as they are, in order, and
    the copy stays as it was when the columns change afterwards."""
    cols = ChunkColumns()
    for n in range(40):
        cols.append(record(n + 1, 1 + n % 3))
    consecutive = list(range(first, min(first + run, 40)))
    for rows in (scattered, consecutive, scattered + consecutive):
        copied = cols.copy(rows)
        want = [cols.record(r) for r in rows]
        assert cols.records(rows) == want
        assert list(copied.offsets) == [rec[1] for rec in want]
        assert [list(f) for f in copied.fields()] == [
            [cols.objs[4 * r + k] for r in rows] for k in range(4)
        ]
        for r in rows:
            cols.put(r, record(99, 2))
        assert list(copied.fields()[0]) == [rec[0] for rec in want]
        for r, rec in zip(rows, want, strict=True):
            cols.put(r, rec)


def test_key_placements_of_rows_whose_first_key_is_not_the_one_asked() -> None:
    """A lookup's read of one shape over many rows (compared, not read key by key) answers as
    the key-by-key read: rows whose first key is another shape answer from their other keys,
    or ``None``."""
    cols = ChunkColumns()
    recs = [record(n + 1, 1 + n % 3) for n in range(30)]  # shapes 0.., first key shape 0
    rows = [cols.append(rec) for rec in recs]
    for sid in (0, 1, 2, 5):
        found, contents = cols.key_placements(rows, [sid] * len(rows))
        want = [
            next(
                (rec[4 + 2 * k] for k in range((len(rec) - 3) // 2) if rec[3 + 2 * k] == sid), None
            )
            for rec in recs
        ]
        assert found == want and list(contents) == [rec[0] for rec in recs]
    shifted = [cols.append(make_record(None, 0, False, [(1, ROW), (0, OTHER)])) for _ in range(3)]
    found, _ = cols.key_placements(rows + shifted, [0] * (len(rows) + 3))
    assert found[-3:] == [OTHER] * 3 and found[: len(rows)] == [rec[4] for rec in recs]


def test_freed_rows_are_kept_as_machine_words_not_an_int_object_each() -> None:
    """A mass removal (an eviction, a fence) frees many rows: the free list keeps each as
    8 bytes (a list kept a slot and, past 256, an ``int`` object: ≈40 B a row), and rows are
    still reused last freed first."""
    parts = new_parts(4)
    n = 20_000
    hs = [h(i) for i in range(n)]
    offs = np.zeros(n, np.int64)
    assert add_fresh([parts[x[0]] for x in hs], hs, [None] * n, offs, [False] * n, 0, [ROW] * n)
    cols = parts[0].cols
    rows = [parts[x[0]].row[x] for x in hs]
    remove_chunks(parts, hs[999:1000])  # (the kernel compiled or loaded before tracing)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        remove_chunks(parts, hs[1000:])
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown / (n - 1000) < 16, grown / (n - 1000)
    assert cols.free.tolist() == rows[999:]
    assert add_fresh([parts[0]], [h(4 * n)], [None], offs[:1], [False], 0, [ROW])
    assert parts[0].row[h(4 * n)] == rows[-1]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_few_fresh_chunks_land_as_a_batch_of_them_does(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk-by-chunk path for a few new chunks (``FEW_FRESH``) against the batch
    kernels: the same rows (free ones last freed first), records, L1 owners and refusals
    (a held chunk: nothing changed; a hash not 32 bytes: ``InvalidInput``, nothing changed)."""
    import kvatlas.directory.chunk_parts as chunk_parts

    states = []
    for few in (0, 100):
        monkeypatch.setattr(chunk_parts, "FEW_FRESH", few)
        parts = new_parts(4)
        cols = parts[0].cols
        outcomes = []
        for step in range(12):
            hs = [h(step * 10 + i) for i in range(size)]
            if step % 4 == 3:  # one held: refused
                hs[-1] = h(0)
            tokens = [toks(step, 1, 2, 3) if i % 2 else None for i in range(size)]
            offs = np.arange(size, dtype=np.int64) + step
            pls = [ROW if step % 2 else OTHER] * size
            outcomes.append(add_fresh(parts, hs, tokens, offs, [True] * size, 2, pls))
            if step % 3 == 2:  # rows freed for the next steps to reuse
                remove_chunks(parts, [x for x in hs if x in parts[x[0]] and x != h(0)])
        with pytest.raises(InvalidInput):
            bad = [h(500 + i) for i in range(size - 1)] + [b"short"]
            add_fresh(parts, bad, [None] * size, np.zeros(size, np.int64), [False] * size, 0,
                      [ROW] * size)  # fmt: skip
        states.append((
            outcomes,
            [[(k, repr(v)) for k, v in p.items()] for p in parts],
            [dict(p.row) for p in parts],
            cols.free.tolist(),
            np.frombuffer(cols.l1.owner, np.int32).tolist(),
            cols.bound,
        ))  # fmt: skip
    assert states[0] == states[1]
