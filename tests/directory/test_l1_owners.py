"""The chunk table's L1 owner column (l1_owners.py): per row, the instances owning an L1
placement of the chunk, kept by every write of a record. Against a brute-force model (a pass
over the records) through stores, re-stores, moves between tiers, deletes, resyncs, fences,
row reuse, captures and restores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.capture import Capture
from kvatlas.directory.chunk_parts import FEW_FRESH, ChunkColumns, add_fresh, new_parts
from kvatlas.directory.l1_owners import NO_OWNER, SEVERAL, L1Owners
from kvatlas.directory.records import (
    l1_owner,
    l1_owners,
    new_record,
    placement_groups,
    placement_row,
    placements_of,
    split_record,
)
from kvatlas.events import EventBatch
from tests.directory.helpers import (
    CS,
    captured,
    entry,
    key,
    l1_chunk_model,
    l1_chunk_sets,
    live_records,
    toks,
)
from tests.directory.test_snapshot_capture import restored_from

INSTANCES = ("a", "b", "c")
PLACES = [("l1", "dram", False), ("gpu", "hbm", False), ("l2", "fs", False), ("l1", "pool", True)]


def check_rows(cols: ChunkColumns) -> None:
    """Every row's owners are its record's (a live row) or none (a free row)."""
    l1 = cols.l1
    assert len(l1.owner) == len(cols.offsets)
    live = {r: h for part in cols.parts for h, r in part.row.items()}
    for r in range(len(cols.offsets)):
        if r in live:
            _, _, _, _, pls, rest = split_record(cols.record(r))
            assert set(l1.owners_at(r)) == set(l1_owners(pls, rest)), r
            assert (l1.owner[r] == SEVERAL) == (r in l1.several)
        else:
            assert l1.owner[r] == NO_OWNER and r not in l1.several, r


def check(d: KeyDirectory) -> None:
    records = live_records(d)
    assert l1_chunk_sets(d) == l1_chunk_model(records)
    check_rows(d._chunks.parts[0].cols)
    want: dict[str, int] = {}  # (the counts still follow the records)
    for rec in records.values():
        for pls in placement_groups(rec):
            for owner in map(l1_owner, placements_of(pls)):
                if owner is not None:
                    want[owner] = want.get(owner, 0) + 1
    assert d.stats().l1_placements_by_instance == want


class Fleet:
    """Each instance's batches, numbered as its emitter would (a restart: incarnation + 1)."""

    def __init__(self) -> None:
        self.inc = dict.fromkeys(INSTANCES, 1)
        self.seq = dict.fromkeys(INSTANCES, 0)

    def batch(
        self,
        inst: str,
        kind: str,
        place: tuple[str, str, bool],
        es: Any,
        prefixes: tuple[str, ...] | None = None,
    ) -> EventBatch:
        self.seq[inst] += 1
        tier, backend, shared = place
        return EventBatch(
            inst, self.inc[inst], self.seq[inst], kind, tier, backend, shared, 0.0, tuple(es),
            prefixes=prefixes,
        )  # fmt: skip


@st.composite
def program(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    chunks = st.lists(st.integers(1, 24), min_size=1, max_size=8, unique=True)
    op = st.one_of(
        st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.sampled_from(PLACES), chunks),
        st.tuples(st.just("delete"), st.sampled_from(INSTANCES), st.sampled_from(PLACES), chunks),
        st.tuples(st.just("move"), st.sampled_from(INSTANCES), chunks),
        st.tuples(st.just("resync"), st.sampled_from(INSTANCES), st.sampled_from(PLACES), chunks),
        st.tuples(st.just("fence"), st.sampled_from(INSTANCES)),
        st.tuples(st.just("restart"), st.sampled_from(INSTANCES)),
        st.tuples(st.just("install")),
        st.tuples(st.just("snapshot")),
    )
    return draw(st.lists(op, min_size=1, max_size=25))


def run(d: KeyDirectory, fleet: Fleet, step: tuple[Any, ...], tmp: Path) -> KeyDirectory:
    kind = step[0]
    if kind in ("store", "delete"):
        _, inst, place, nums = step
        salt = "x" if place[0] == "l2" else ""  # (two keys of one chunk: another shape)
        es = [entry(key(n, salt=salt), toks(n, n, n, n), 4 * n) for n in nums]
        d.consume(fleet.batch(inst, kind, place, es))
    elif kind == "move":  # L1 → L2: the copy is stored in L2, then dropped from L1
        _, inst, nums = step
        es = [entry(key(n), toks(n, n, n, n), 4 * n) for n in nums]
        d.consume(fleet.batch(inst, "store", ("l2", "fs", False), es))
        d.consume(fleet.batch(inst, "delete", ("l1", "dram", False), es))
    elif kind == "resync":  # the chunks under ``nums`` become every other one of them
        _, inst, place, nums = step
        es = [entry(key(n), toks(n, n, n, n), 4 * n) for n in nums[::2]]
        prefixes = tuple(f"{n:02x}" for n in nums)
        d.consume(fleet.batch(inst, "resync", (*place[:2], False), es, prefixes))
    elif kind == "fence":
        d.fence_instance(step[1])
    elif kind == "restart":  # a higher incarnation fences first
        fleet.inc[step[1]] += 1
        fleet.seq[step[1]] = 0
        run(d, fleet, ("store", step[1], PLACES[0], [1, 2]), tmp)
    elif kind == "install":
        copy = KeyDirectory(CS, enable_blend_lookup=True)
        copy.install(restored_from(d))
        return copy
    elif kind == "snapshot":
        save_snapshot(d, tmp / "l1.snap")
        d = KeyDirectory(CS, enable_blend_lookup=True)
        load_snapshot(d, tmp / "l1.snap")
    return d


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=program())
def test_the_l1_owner_column_equals_a_pass_over_the_records(
    steps: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    d, fleet = KeyDirectory(CS, enable_blend_lookup=True), Fleet()
    for step in steps:
        d = run(d, fleet, step, tmp_path)
        check(d)
    for inst in INSTANCES:  # fencing visits exactly the chunks the model names
        want = l1_chunk_model(captured(d)).get(inst, set())
        held = {h for h, rec in captured(d).items() if h not in want}
        d.fence_instance(inst)
        check(d)
        assert inst not in l1_chunk_sets(d)
        assert held <= set(captured(d))  # chunks without its L1 copies are untouched
        assert inst not in d._chunks.parts[0].cols.l1.ids  # its name released


def test_a_chunk_two_instances_hold_in_l1_keeps_the_other_when_one_is_fenced() -> None:
    d, fleet = KeyDirectory(CS), Fleet()
    for inst in ("a", "b"):
        d.consume(fleet.batch(inst, "store", PLACES[0], [entry(key(1)), entry(key(2))]))
    cols = d._chunks.parts[0].cols
    assert len(cols.l1.several) == 2  # both chunks: two owners
    check(d)
    assert d.fence_instance("a") == 2
    check(d)
    assert not cols.l1.several and l1_chunk_sets(d) == {"b": {key(1).chunk_hash, key(2).chunk_hash}}


def test_instances_that_come_and_go_do_not_pile_up_owner_names() -> None:
    """Found in review: names were interned for the columns' life, so a fleet whose nodes
    get a new id at each registration grew the name table without bound. A fence releases
    the id, and the next new name takes it."""
    d = KeyDirectory(CS)
    d.consume(EventBatch("keep", 1, 1, "store", "l1", "dram", entries=(entry(key(1)),)))
    for i in range(200):
        inst = f"mp-{i}"
        d.consume(EventBatch(inst, 1, 1, "store", "l1", "dram", entries=(entry(key(2 + i)),)))
        check(d)
        assert d.deregister(inst) == 1
        check(d)
    l1 = d._chunks.parts[0].cols.l1
    assert set(l1.ids) == {"keep"} and len(l1.names) == 2  # one id reused 200 times
    assert l1_chunk_sets(d) == {"keep": {key(1).chunk_hash}}


def test_a_freed_row_reused_has_only_its_new_owners() -> None:
    """Row reuse: a chunk removed frees its row; the next new chunk (a fresh batch, or one
    record) in that row must not keep the removed chunk's L1 owner."""
    parts = new_parts(4)
    cols = parts[0].cols
    h1, h2, h3 = (bytes([1, n]) + bytes(30) for n in (1, 2, 3))
    parts[1][h1] = new_record(None, 0, False, 0, placement_row("a", 1, "l1", "d", 1, False, 0))
    r = parts[1].row[h1]
    assert cols.l1.owners_at(r) == ("a",)
    del parts[1][h1]
    assert cols.l1.owners_at(r) == ()
    parts[1][h2] = new_record(None, 0, False, 0, placement_row("b", 1, "l2", "d", 1, False, 0))
    assert parts[1].row[h2] == r and cols.l1.owners_at(r) == ()
    del parts[1][h2]
    row = placement_row("c", 1, "l2", "fs", 1, False, 0)
    assert add_fresh([parts[1]], [h3], [None], np.zeros(1, np.int64), [False], 0, [row])
    assert parts[1].row[h3] == r and cols.l1.owners_at(r) == ()
    check_rows(cols)


def test_the_checks_catch_a_freed_row_that_keeps_its_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: a clear that leaves the owner column alone fails the row check, and
    a reuse that then trusts freed rows to have no owner (a fresh L2 batch) leaves the new
    chunk owned by the old chunk's instance: fencing would visit it."""
    fill = L1Owners.fill

    def clear_rows_only(self: ChunkColumns, r: int) -> None:
        self.objs[4 * r : 4 * (r + 1)] = (None, 0, None, ())
        self.free.append(r)

    def fill_if_owned(self: L1Owners, rows: list[int], owner: int) -> None:
        if owner != NO_OWNER:
            fill(self, rows, owner)

    d, fleet = KeyDirectory(CS), Fleet()
    monkeypatch.setattr(ChunkColumns, "clear", clear_rows_only)
    monkeypatch.setattr(L1Owners, "fill", fill_if_owned)
    d.consume(fleet.batch("a", "store", PLACES[0], [entry(key(1))]))
    d.consume(fleet.batch("a", "delete", PLACES[0], [entry(key(1))]))
    with pytest.raises(AssertionError):
        check_rows(d._chunks.parts[0].cols)
    # a batch of new chunks, more than the few added chunk by chunk: the bulk path
    fresh = [entry(key(n), toks(n, n, n, n), 8) for n in range(2, 3 + FEW_FRESH)]
    d.consume(fleet.batch("b", "store", PLACES[2], fresh))  # reuses the row
    assert l1_chunk_sets(d) == {"a": {key(2).chunk_hash}}  # wrong: what the check catches
    with pytest.raises(AssertionError):
        check(d)


def test_an_unsorted_snapshot_restores_the_same_rows_and_owners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose chunks are not in partition order (the reader sorts them, stably)."""
    d, fleet = KeyDirectory(CS, enable_blend_lookup=True), Fleet()
    for inst, place in (("a", PLACES[0]), ("b", PLACES[1]), ("c", PLACES[2]), ("a", PLACES[3])):
        es = [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 40, 1 + len(inst))]
        d.consume(fleet.batch(inst, "store", place, es))
    d.consume(fleet.batch("b", "store", PLACES[0], [entry(key(5, salt="x"))]))  # two keys
    parts_in_order = Capture.parts

    def backwards(self: Capture) -> Any:
        return reversed(list(parts_in_order(self)))

    monkeypatch.setattr(Capture, "parts", backwards)
    save_snapshot(d, tmp_path / "backwards.snap")
    monkeypatch.undo()
    copy = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(copy, tmp_path / "backwards.snap")
    assert plain(captured(copy)) == plain(captured(d))
    for mine, theirs in zip(copy._chunks.parts, d._chunks.parts, strict=True):
        assert list(mine) == list(theirs)  # each partition's order, as the file has it
    check(copy)
    assert l1_chunk_sets(copy) == l1_chunk_sets(d)
    assert copy.fence_instance("a") == d.fence_instance("a")
    assert plain(captured(copy)) == plain(captured(d))
    check(copy)


def plain(value: Any) -> Any:
    """Records with their contents as lists (arrays do not compare as values)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    return tuple(map(plain, value)) if isinstance(value, tuple) else value
