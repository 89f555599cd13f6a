"""The chunk table's store rules, removal rules and digests are collaborators
given the table (``chunk_state.ChunkState``), not bases of it: each owns only its own state,
and a restore restarts them in place (issue 31 item 2)."""

from __future__ import annotations

from kvatlas.directory.chunk_digests import InventoryDigests
from kvatlas.directory.chunk_removals import RemovalRules
from kvatlas.directory.chunk_state import ChunkState
from kvatlas.directory.chunk_stores import StoreRules
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.key_directory import KeyDirectory


def test_the_table_and_its_collaborators_inherit_nothing() -> None:
    for cls in (ChunkTable, StoreRules, RemovalRules, InventoryDigests):
        assert cls.__mro__ == (cls, object), cls


def test_the_collaborators_are_given_the_table_and_keep_no_copy_of_its_state() -> None:
    table = ChunkTable(4)
    view: ChunkState = table  # (mypy checks the table is a ChunkState)
    for collaborator in (table.stores, table.removals, table.digests):
        assert collaborator._table is view  # type: ignore[attr-defined]
        own = set(vars(collaborator)) if hasattr(collaborator, "__dict__") else set()
        assert not own & {"parts", "shapes", "counts", "indexing", "journal", "ops"}
    assert not {"digested", "_tags"} & set(vars(table))  # the collaborators' own


def test_a_restore_restarts_the_collaborators_in_place() -> None:
    d = KeyDirectory(4)
    table = d._chunks
    collaborators = table.stores, table.removals, table.digests
    digests = table.digests
    table.restore(table.shapes, [{} for _ in range(256)], table.counts)
    assert (table.stores, table.removals, table.digests) == collaborators
    assert not any(digests.digested)  # built partition by partition after a restore
    assert d.digest("nobody", "l1") == [0] * 256 and all(digests.digested)
