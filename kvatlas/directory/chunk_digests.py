"""Inventory digests of the chunk table: per (instance, tier) the XOR digest of that
instance's own placements (see :mod:`kvatlas.events.inventory`), kept in
:attr:`ChunkCounts.digests <kvatlas.directory.chunk_counts.ChunkCounts.digests>` as the records
change. After a restore the digests are built partition by partition
(:meth:`InventoryDigests.digest_partition`); until a partition is, changes to it leave the
digests alone.
"""

from __future__ import annotations

import numpy as np

from kvatlas.directory.chunk_counts import PARTS, ChunkCounts, Partition
from kvatlas.directory.records import (
    placements_of,
    record_keys,
    row_backend,
    row_instance,
    row_shared,
    row_tier,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.events.inventory import element, shape_tag, tag_multiplier


class InventoryDigests:
    """The digest bookkeeping of :class:`~kvatlas.directory.chunk_table.ChunkTable` (a base
    class: it reads the table's records, shapes and counts)."""

    shapes: ShapeTable
    parts: list[Partition]
    counts: ChunkCounts
    # (shape id, tier, backend) -> the inventory element's multiplier
    _tags: dict[tuple[int, str, str], int]
    digested: bytearray  # partitions counted in counts.digests
    _all_digested: bool

    def _start_digests(self, built: bool) -> None:
        """Forget the tag cache; every partition is digested (``built``) or none is."""
        self._tags = {}
        self.digested = bytearray(b"\x01" * PARTS) if built else bytearray(PARTS)
        self._all_digested = built

    def digest_partition(self, b: int) -> None:
        """Add partition ``b``'s own placements to the digests (once, after a restore: the
        restore itself stays one pass over columns, and building the digests holds the lock
        one partition at a time)."""
        if self.digested[b]:
            return
        acc: dict[tuple[str, str], int] = {}
        tag = self._tag
        for h, rec in self.parts[b].items():
            for sid, pls in record_keys(rec):
                for p in placements_of(pls):
                    if not row_shared(p):
                        where = (row_instance(p), row_tier(p))
                        e = element(h, tag(sid, row_tier(p), row_backend(p)))
                        acc[where] = acc.get(where, 0) ^ e
        for (inst, tier), value in acc.items():
            self.counts.digest_for(inst, tier)[b] ^= np.uint64(value)
        self.digested[b] = 1
        self._all_digested = all(self.digested)

    def _tag(self, sid: int, tier: str, backend: str) -> int:
        t = self._tags.get((sid, tier, backend))
        if t is None:
            tag = shape_tag(*self.shapes[sid].parts, tier, backend)
            t = self._tags[(sid, tier, backend)] = tag_multiplier(tag)
        return t

    def _xor(self, inst: str, tier: str, h: bytes, sid: int, backend: str) -> None:
        """Add or remove (the same thing) one own placement in its digest."""
        if self.digested[h[0]]:
            e = np.uint64(element(h, self._tag(sid, tier, backend)))
            self.counts.digest_for(inst, tier)[h[0]] ^= e

    def digest_of_prefix(self, inst: str, tier: str, prefix: bytes) -> list[int]:
        """The digest of ``inst``'s own placements on ``tier`` under a one-byte ``prefix``
        (computed from that partition: 1/256 of the directory)."""
        out = [0] * PARTS
        for h, rec in self.parts[prefix[0]].items():
            if not h.startswith(prefix):
                continue
            for sid, pls in record_keys(rec):
                for p in placements_of(pls):
                    if row_instance(p) == inst and row_tier(p) == tier and not row_shared(p):
                        out[h[1]] ^= element(h, self._tag(sid, tier, row_backend(p)))
        return out
