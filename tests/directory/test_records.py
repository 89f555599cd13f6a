"""Packed records and placement rows, read and rebuilt only through records.py; key shapes."""

from __future__ import annotations

from kvatlas.directory import KeyDirectory
from kvatlas.directory.records import (
    Placement,
    find_key,
    key_count,
    l1_owner,
    make_record,
    new_record,
    pack_placements,
    placement_groups,
    placement_row,
    placements_at,
    placements_of,
    public_placements,
    rebound,
    record_indexed,
    record_keys,
    record_offset,
    record_stored_tokens,
    record_tokens,
    row_ident,
    shape_ids,
    with_key,
    with_placements_at,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.token_store import stored_one, widened
from kvatlas.events.columns import EntryColumns
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks

A = placement_row("a", 1, "l1", "dram", 10, False, 0.0)
B = placement_row("b", 2, "l2", "fs", 20, False, 1.0)
POOL = placement_row("b", 2, "l2", "pool", 30, True, 2.0)


def test_rows_are_placements() -> None:
    assert Placement(*A) == Placement("a", 1, "l1", "dram", 10, False, 0.0)
    assert row_ident(POOL) == Placement(*POOL).ident == ("l2", "pool", None)
    assert (l1_owner(A), l1_owner(B), l1_owner(POOL)) == ("a", None, None)
    assert placements_of(A) == (A,) and placements_of((B, A)) == (B, A)
    assert pack_placements([]) is None and pack_placements([A]) == A
    assert public_placements((B, A)) == (Placement(*A), Placement(*B))  # sorted


def test_record_accessors_and_rebuilds() -> None:
    tokens = stored_one(toks(1, 2, 3, 4))  # a content as the directory keeps it
    rec = new_record(tokens, 8, True, 5, A)
    assert (record_stored_tokens(rec), record_offset(rec), record_indexed(rec)) == (tokens, 8, True)
    public = record_tokens(rec)
    assert public is not None and public.tolist() == [1, 2, 3, 4]
    rec = with_key(rec, 7, (A, B))
    assert key_count(rec) == 2 and shape_ids(rec) == (5, 7)
    assert placement_groups(rec) == (A, (A, B))
    assert list(record_keys(rec)) == [(5, A), (7, (A, B))]
    assert (find_key(rec, 5), find_key(rec, 7), find_key(rec, 6)) == (0, 1, -1)
    assert placements_at(rec, 1) == (A, B)
    rec = with_placements_at(rec, 0, POOL)
    assert list(record_keys(rec)) == [(5, POOL), (7, (A, B))]
    assert make_record(tokens, 8, True, record_keys(rec)) == rec
    unbound = rebound(rec, None, -1, False)
    assert (record_tokens(unbound), record_offset(unbound), record_indexed(unbound)) == (
        None, -1, False,
    )  # fmt: skip
    assert list(record_keys(unbound)) == list(record_keys(rec))


def test_shape_table_interns_once_and_ids_stay() -> None:
    table = ShapeTable()
    keys = [key(1), key(2), key(3, salt="t"), key(4, ws=2, rank=1), key(5, salt="t")]
    sids = table.intern_columns(EntryColumns.of_entries([entry(k) for k in keys]))
    assert sids == [table.intern(k) for k in keys] == [0, 0, 1, 2, 1]
    assert len(table) == 3 and table.id_of(key(9, model="other")) is None
    assert table[1].key(key(3).chunk_hash) == key(3, salt="t")
    assert table.namespaces([0, 1, 2]) == {
        BlendNamespace("m", "", 1),
        BlendNamespace("m", "t", 1),
        BlendNamespace("m", "", 2),
    }
    assert table.namespaces([1]) == {BlendNamespace("m", "t", 1)}


def test_consume_builds_new_chunks_as_new_record_does() -> None:
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    e = entry(key(1), toks(1, 2, 3, 4), 8, size=12)
    d.consume(em.batch("store", [e], ts=2.5))
    row = placement_row("a", 1, "l1", "dram", 12, False, 2.5)
    rec = captured(d)[key(1).chunk_hash]
    stored = record_stored_tokens(rec)  # the content, stored compactly (token_store.py)
    assert stored is not None and widened(stored).tolist() == [1, 2, 3, 4]
    assert rec == new_record(stored, 8, True, 0, row)
