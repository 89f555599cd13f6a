"""The partitions' hash → row maps (row_maps.py, row_map_kernels.py): open addressing over the
rows' hash column, against a plain ``dict[bytes, Record]`` per partition.

Random programs of inserts, replaces, deletes, batches of new chunks (one held: nothing
changed), batch removals, restores (from dicts and from columns) and captures; after every
step each partition has the oracle's keys in its order, equal records, and every row is used
once. The probe's mix is keyed per process; the programs also run with keys that make hashes
collide on purpose (every hash one home, or the home of bytes 8..15 only, with hashes that
share them), and across the tables' growth and shrinking. A negative control shows that the
check catches a probe that misses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import row_maps
from kvatlas.directory.chunk_parts import (
    ChunkPart,
    add_fresh,
    new_parts,
    parts_of_columns,
    remove_chunks,
    rows_of,
)
from kvatlas.directory.records import Record, make_record, new_record, placement_row, split_columns
from kvatlas.directory.row_map_kernels import C_HASHES, C_KEYS
from kvatlas.errors import InvalidInput
from tests.directory.helpers import toks
from tests.helpers import mapping_of

ROW = placement_row("a", 1, "l1", "dram", 10, False, 0.0)
OTHER = placement_row("b", 2, "l2", "fs", 20, False, 1.0)
PARTS = 4
Model = list[dict[bytes, Record]]


def h(n: int, shared: bool) -> bytes:
    """Hash ``n``: partition ``n % 4``; with ``shared``, bytes 8..15 the same for all."""
    body = n.to_bytes(31, "little")
    if shared:
        body = body[:7] + bytes(8) + body[15:]
    return bytes([n % PARTS]) + body


def record(n: int, keys: int) -> Record:
    pairs = [(s, ROW if s % 2 else (ROW, OTHER)) for s in range(keys)]
    return make_record(toks(n, n, n, n) if n % 3 else None, 4 * n - 1, n % 2 == 0, pairs)


KEYS = {"zero": [0, 0, 0, 0], "word1": [0, 1, 0, 0]}
"""The probe's keys: all zero (every hash one home) or bytes 8..15 only."""


def check(parts: list[ChunkPart], model: Model, pool: list[bytes]) -> None:
    """The partitions are the oracle's dicts; every row is used once; batch reads agree."""
    for p, ref in zip(parts, model, strict=True):
        assert list(p) == list(ref) and len(p) == len(ref)
        assert p.values() == list(ref.values()) and p == ref
    want = [parts[x[0]].row.get(x) if x in model[x[0]] else None for x in pool]
    assert rows_of(parts, pool) == want
    assert all(x in parts[x[0]] for x in pool if x in model[x[0]])
    assert not any(x in parts[x[0]] for x in pool if x not in model[x[0]])
    cols = parts[0].cols
    live = sorted(r for p in parts for r in p.row.values())
    assert sorted(live + cols.free.tolist()) == list(range(len(cols.offsets)))


def restored_from_columns(model: Model, as_words: bool) -> list[ChunkPart]:
    """What a snapshot's reader builds: one-key records as columns (the hashes as objects,
    or as the file's words), then the others set."""
    hashes = [x for ref in model for x in ref]
    recs = [rec[:5] for ref in model for rec in ref.values()]
    tokens, offsets, indexed, sids, pls, _ = split_columns(recs)
    flagged = [2 * s + i for s, i in zip(sids, indexed, strict=True)]
    bounds = np.cumsum([0, *map(len, model)]).tolist()
    owners = np.full(len(hashes), -1, np.int64)
    words = np.frombuffer(b"".join(hashes), np.uint64).reshape(-1, 4) if as_words else None
    parts = parts_of_columns(
        PARTS, hashes if words is None else words, bounds, tokens, np.asarray(offsets, np.int64),
        flagged, pls, owners, [], sum(t is not None for t in tokens),
    )  # fmt: skip
    for ref, part in zip(model, parts, strict=True):
        for x, rec in ref.items():
            if len(rec) > 5:
                part[x] = rec
    return parts


Op = tuple[str, int, int]
ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "set", "del", "fresh", "remove", "restore", "columns", "capture"]),
        st.integers(0, 60),
        st.integers(1, 3),
    ),
    max_size=250,
)


def run(program: list[Op], mode: str, shared: bool, hook: Callable[[int, Any], None]) -> None:
    with pytest.MonkeyPatch.context() as m:
        if mode in KEYS:
            m.setattr(row_maps, "mix_keys", KEYS[mode].copy)
        run_keyed(program, shared, hook)


def run_keyed(program: list[Op], shared: bool, hook: Callable[[int, Any], None]) -> None:
    parts, model = new_parts(PARTS), [{} for _ in range(PARTS)]
    pool = [h(n, shared) for n in range(70)]
    for step, (op, n, keys) in enumerate(program):
        x = h(n, shared)
        part, ref = parts[x[0]], model[x[0]]
        if op == "set":
            part[x] = ref[x] = record(n, keys)
        elif op == "del" and x in ref:
            del part[x], ref[x]
        elif op == "fresh":  # a batch of new chunks; with keys 3, one the table holds
            hs = list(dict.fromkeys(h(n + 7 * i, shared) for i in range(keys * 4)))
            held = [y for y in hs if y in model[y[0]]]
            if keys != 3:
                hs = [y for y in hs if y not in model[y[0]]]
            if hs:
                tokens = [toks(1, 2, 3, 4) if i % 3 else None for i in range(len(hs))]
                offs = np.arange(len(hs), dtype=np.int64)
                ok = add_fresh([parts[y[0]] for y in hs], hs, tokens, offs, [True] * len(hs), 2,
                               [ROW] * len(hs))  # fmt: skip
                assert ok == (keys != 3 or not held)
                if ok:
                    for y, tok, o in zip(hs, tokens, offs.tolist(), strict=True):
                        model[y[0]][y] = new_record(tok, o, True, 2, ROW)
        elif op == "remove":  # chunks taken out in bulk (a fence's, a delete's)
            gone = [y for y in dict.fromkeys(h(n + i, shared) for i in range(keys * 5))
                    if y in model[y[0]]]  # fmt: skip
            remove_chunks(parts, gone)
            for y in gone:
                del model[y[0]][y]
        elif op == "restore":
            parts = new_parts(PARTS, [dict(p.items()) for p in parts])
        elif op == "columns":
            parts = restored_from_columns(model, as_words=keys % 2 == 1)
        elif op == "capture":  # what a capture takes under the lock
            for p, r in zip(parts, model, strict=True):
                hashes, rows = p.hashes_and_rows()
                assert hashes == list(r) and p.cols.records(rows) == list(r.values())
        hook(step, parts)
        check(parts, model, pool)


def no_hook(step: int, parts: Any) -> None:
    pass


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops, mode=st.sampled_from(["drawn", "zero", "word1"]), shared=st.booleans())
def test_partitions_are_their_dicts_whatever_the_probes_collide(
    program: list[Op], mode: str, shared: bool
) -> None:
    run(program, mode, shared, no_hook)


@pytest.mark.parametrize("mode", ["drawn", "zero"])
def test_growing_and_shrinking_across_resizes(mode: str) -> None:
    """Partitions grow past many relocations, are emptied by deletes (tombstones, holes),
    then refilled (relocated smaller, then larger again)."""
    program: list[Op] = [("set", n, 1 + n % 3) for n in range(60)]
    program += [("del", n, 1) for n in range(0, 60, 2)] + [("fresh", 100, 2)]
    program += [("del", n, 1) for n in range(60)] + [("set", n, 1) for n in range(59, -1, -3)]
    pool = 61
    with pytest.MonkeyPatch.context() as m:
        if mode in KEYS:
            m.setattr(row_maps, "mix_keys", KEYS[mode].copy)
        parts, model = new_parts(PARTS), [{} for _ in range(PARTS)]
    for rounds in range(3):
        for op, n, keys in program:
            x = h(n + 1000 * rounds, False)
            if op == "set":
                parts[x[0]][x] = model[x[0]][x] = record(n, keys)
            elif op == "del" and x in model[x[0]]:
                del parts[x[0]][x], model[x[0]][x]
        check(parts, model, [h(n + 1000 * rounds, False) for n in range(pool)])
    sizes = {len(s) for s in parts[0].cols.maps.slots}
    assert max(sizes) > 8  # (it grew)


@pytest.mark.parametrize(
    "bad", [bytes(31), bytes(33), b"", "x" * 32, bytearray(32), memoryview(bytes(32)), 7]
)
def test_a_hash_of_another_length_or_type_is_refused_and_nothing_changes(bad: Any) -> None:
    parts = new_parts(PARTS)
    good = [h(n, False) for n in range(8)]
    for n, x in enumerate(good[:4]):
        parts[x[0]][x] = record(n, 1)
    before = [list(p.items()) for p in parts]
    cols = parts[0].cols
    rows_before, free_before = len(cols.offsets), cols.free.tolist()
    with pytest.raises(InvalidInput, match="32 bytes"):
        parts[0][bad] = record(9, 1)
    batch = [*good[4:], bad]
    with pytest.raises(InvalidInput, match="32 bytes"):
        add_fresh([parts[0]] * 5, batch, [None] * 5, np.zeros(5, np.int64), [False] * 5, 0,
                  [ROW] * 5)  # fmt: skip
    assert [list(p.items()) for p in parts] == before
    assert len(cols.offsets) == rows_before and cols.free.tolist() == free_before
    assert bad not in parts[0] and parts[0].get(bad) is None  # a read finds nothing
    assert parts[0].row_of(bad) is None
    with pytest.raises(KeyError):
        del parts[0][bad]


def test_a_bytes_subclass_is_kept_by_value() -> None:
    """An ``ObjectKey`` takes a ``bytes`` subclass: the map keeps its 32 bytes, and reads by
    either form find it."""

    class Sub(bytes):
        pass

    parts = new_parts(PARTS)
    x = Sub(h(5, False))
    parts[x[0]][x] = record(5, 1)
    assert type(next(iter(parts[x[0]]))) is bytes
    assert bytes(x) in parts[x[0]] and x in parts[x[0]]
    assert rows_of(parts, [x, bytes(x)]) == [0, 0]
    assert add_fresh([parts[x[0]]], [Sub(h(9, False))], [None], np.zeros(1, np.int64), [False],
                     0, [ROW])  # fmt: skip
    remove_chunks(parts, [Sub(h(9, False))])
    del parts[x[0]][x]
    assert not any(len(p) for p in parts)


def test_a_hash_filled_twice_keeps_its_later_row_and_no_other_hash_finds_it() -> None:
    """``RowMaps.fill`` of one hash twice (as a dict's ``d[h] = r`` twice): the later row is
    the hash's, its column holds the hash, and after a relocation no hash that was never stored
    finds that row (found by review: the replacing branch left the new row's column unwritten)."""
    maps = row_maps.RowMaps()
    maps.add_part()
    a = bytes([0]) + bytes(range(1, 32))
    none = np.zeros(1, np.int64)
    maps.fill([a, a], np.zeros(2, np.int64), 0)
    assert maps.rows_of([a], none) == [1]
    maps.relocate(0, 0)
    assert maps.rows_of([a], none) == [1]
    assert maps.rows_of([bytes(32)], none) == [None]


def test_a_bytes_subclass_is_kept_by_its_own_value() -> None:
    """A ``bytes`` subclass whose ``__bytes__`` says another hash is kept and found by its own
    32 bytes, as a dict would (found by review: ``bytes(h)`` called ``__bytes__``)."""
    parts = new_parts(PARTS)
    other = h(7, False)

    class Odd(bytes):
        def __bytes__(self) -> bytes:
            return other

    parts[other[0]][other] = record(7, 1)
    x = Odd(h(5, False))
    assert x not in parts[x[0]]
    parts[x[0]][x] = record(5, 2)
    assert rows_of(parts, [bytes(memoryview(x)), other]) == [1, 0]


def test_negative_control_a_probe_that_misses_is_caught() -> None:
    """The probe's keys changed under the map (every later probe homes elsewhere): the
    checks above must fail."""
    program: list[Op] = [("set", n, 1) for n in range(40)]

    def break_probe(step: int, parts: Any) -> None:
        if step == 30:
            ctx = parts[0].cols.maps.ctx
            ctx[C_KEYS] = ctx[C_KEYS] + 2

    with pytest.raises(AssertionError):
        run(program, "drawn", False, break_probe)
    run(program, "drawn", False, no_hook)  # (the same program, unbroken, passes)


WARMED = """
import json, os, sys, tempfile
from kvatlas.bench.directory_workload import CHUNK, workload
from kvatlas.directory import KeyDirectory, warm_up_kernels
from kvatlas.directory import row_map_kernels as k
from kvatlas.directory.snapshot.reader import load_snapshot
from kvatlas.directory.snapshot.writer import save_snapshot
from kvatlas.events import EventBatch
warm_up_kernels()
names = [n for n in dir(k) if hasattr(getattr(k, n), "signatures")]
before = {n: list(map(str, getattr(k, n).signatures)) for n in names}
d = KeyDirectory(CHUNK, enable_blend_lookup=True)
bs = workload(1500, 1)
for b in bs:
    d.consume(b)
d.lookup([e.key for e in bs[0].entries[:5]])
first = bs[0]
d.consume(EventBatch(first.instance_id, first.incarnation, 100, "delete", "l1", "dram",
                     entries=bs[1].entries))
with tempfile.TemporaryDirectory() as t:
    path = os.path.join(t, "snapshot")
    save_snapshot(d, path)
    load_snapshot(KeyDirectory(CHUNK, enable_blend_lookup=True), path)
after = {n: list(map(str, getattr(k, n).signatures)) for n in names}
print(json.dumps({n: [s for s in after[n] if s not in before[n]] for n in names}))
"""


def test_the_warm_up_compiles_every_map_kernel_a_server_calls() -> None:
    """After ``warm_up_kernels`` no row-map kernel compiles for a new signature while a
    directory consumes, looks up, deletes, saves a snapshot and restores it (a fresh
    process: in this one, other tests may have compiled them already)."""
    out = subprocess.run(
        [sys.executable, "-c", WARMED], capture_output=True, text=True, check=True, timeout=600
    )
    new = json.loads(out.stdout.strip().splitlines()[-1])
    assert new and not any(new.values()), new


def test_the_hash_column_grows_in_a_private_map_of_its_own_in_place() -> None:
    """Past ``c_heap.MAPPED_MIN`` bytes the column is an anonymous private map (not the heap,
    where each growth's old copy was a resident hole), grown in place while its room lasts;
    every hash stays found across the growths and the copy into a larger map."""
    maps = row_maps.RowMaps()
    maps.add_part()
    addresses = []
    held = 0
    for batch in (1000, 40_000, 20_000, 60_000, 200_000):  # 32 B a row: 1 MiB at 32,768
        hs = [bytes(1) + (held + i).to_bytes(31, "little") for i in range(batch)]
        maps.fill(hs, np.zeros(batch, np.int64), held)
        held += batch
        addresses.append(maps.hashes.ctypes.data)
        assert maps.ctx[C_HASHES] == maps.hashes.ctypes.data
        if held > 40_000:
            line = mapping_of(addresses[-1])
            assert line is not None and line.split()[1] == "rw-p" and len(line.split()) == 5, line
    assert addresses[1] == addresses[2] == addresses[3] != addresses[4]  # in place, then a copy
    everything = [bytes(1) + i.to_bytes(31, "little") for i in range(held)]
    assert maps.rows_of(everything, row_maps.BY_FIRST_BYTE) == list(range(held))
    assert maps.hashes_of(np.arange(held)) == everything


def test_a_refused_batch_leaves_its_scratch_counts_zero() -> None:
    """A hash refused after others were counted: the counts go back to zero (else the next
    batch's partitions look fuller than they are and move once more than needed)."""
    maps = row_maps.RowMaps()
    maps.add_part()
    good = [bytes(32), bytes([0, 1]) + bytes(30)]
    with pytest.raises(InvalidInput, match="32 bytes, not 5"):
        maps.fill([*good, b"short"], row_maps.BY_FIRST_BYTE, 0)
    assert not maps.counts.any()


def test_a_partition_that_does_not_exist_is_named_not_blamed_on_the_hash() -> None:
    maps = row_maps.RowMaps()
    maps.add_part()
    with pytest.raises(IndexError, match="no partition 3 of 1"):
        maps.fill([bytes(32)], np.array([3], np.int64), 0)
    with pytest.raises(IndexError, match="no partition 7 of 1"):  # (partitions by first byte)
        maps.fill([bytes([7]) + bytes(31)], row_maps.BY_FIRST_BYTE, 0)
    assert maps.rows_of([bytes(32)], np.array([-1], np.int64)) == [None]
    assert maps.remove_many([bytes(32)], np.array([-1], np.int64)) == [-1]


def test_a_removal_mixing_exact_hashes_and_a_bytes_subclass_takes_each_out_once() -> None:
    """The exact hashes are out after the first pass; only the subclass goes again (as its
    exact copy): every row comes back and is freed, none is reported missing."""

    class Sub(bytes):
        pass

    parts = new_parts(PARTS)
    a, b = h(1, False), h(2, False)
    parts[a[0]][a] = record(1, 1)
    parts[b[0]][b] = record(2, 1)
    rows = [parts[a[0]].row[a], parts[b[0]].row[b]]
    remove_chunks(parts, [a, Sub(b)])
    assert not any(len(p) for p in parts)
    assert sorted(parts[0].cols.free.tolist()) == sorted(rows)
