"""What the chunk table's collaborators see of it: the records, counts and shapes it owns, and
the three things every change to a record does (save it for a capture, know its namespaces,
queue the blend-index writes that follow).

The collaborators (:class:`~kvatlas.directory.chunk_stores.StoreRules`,
:class:`~kvatlas.directory.chunk_removals.RemovalRules`,
:class:`~kvatlas.directory.chunk_digests.InventoryDigests`) are given the table as a
:class:`ChunkState` and own only their own state; the table owns the records and calls them.
They read the table's attributes on every use, never keep them: a restore replaces them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvatlas.directory.blend import BlendOp
from kvatlas.directory.chunk_counts import ChangeJournal, ChunkCounts
from kvatlas.directory.chunk_parts import ChunkPart
from kvatlas.directory.records import Record
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.tenant_bindings import TenantBindings
from kvatlas.keys import BlendNamespace


class ChunkState(Protocol):
    """The chunk table, as its collaborators change it (under the directory's lock)."""

    @property
    def parts(self) -> list[ChunkPart]:
        """The records, by the first byte of the chunk hash (changed in place)."""

    @property
    def shapes(self) -> ShapeTable: ...

    @property
    def tenants(self) -> TenantBindings:
        """The per-salt bindings of the chunks held under keys of several salts."""

    @property
    def counts(self) -> ChunkCounts:
        """What follows from the records (changed in place as they change)."""

    @property
    def indexing(self) -> bool:
        """Whether changes queue blend-index writes."""

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk (a content of another length is bound, never indexed)."""

    @property
    def journal(self) -> ChangeJournal | None:
        """The change journal of the capture in progress (``None``: no capture)."""

    @property
    def ops(self) -> list[BlendOp]:
        """The queued index writes, in order (appended to in place; the flush takes the list:
        read it on every use)."""

    def locate(self, h: bytes, sid: int | None) -> tuple[Record, int] | None:
        """Chunk ``h``'s record and its key of shape ``sid``'s position (if held)."""

    def preserve(self, h: bytes, rec: Record | None) -> None:
        """Keep the record a chunk has before its first change of a capture (if capturing)."""

    def namespaces(self, rec: Record) -> set[BlendNamespace]:
        """The namespaces of a record's keys (the index's claims on its content)."""

    def queue(self, ops: Iterable[BlendOp]) -> None:
        """Queue index writes, in the order the changes happened (applied at the flush)."""
