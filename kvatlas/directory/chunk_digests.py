"""Inventory digests of the chunk table: per (instance, tier) the XOR digest of that
instance's own placements (see :mod:`kvatlas.events.inventory`), kept in
:attr:`ChunkCounts.digests <kvatlas.directory.chunk_counts.ChunkCounts.digests>` as the records
change. After a restore the digests are built partition by partition
(:meth:`InventoryDigests.digest_partition`); until a partition is, changes to it leave the
digests alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import numpy as np

from kvatlas.directory.chunk_counts import PARTS, DigestArray
from kvatlas.directory.chunk_state import ChunkState
from kvatlas.directory.records import (
    placements_of,
    record_keys,
    row_backend,
    row_instance,
    row_shared,
    row_tier,
)
from kvatlas.errors import InvalidInput
from kvatlas.events.inventory import (
    Digest,
    element,
    empty_digest,
    shape_tag,
    tag_multiplier,
    xor_elements,
)


class InventoryDigests:
    """The digest bookkeeping of a chunk table (its collaborator: it reads the table's
    records and shapes and changes the digests in its counts). Owns which partitions are
    digested and the tag cache."""

    def __init__(self, table: ChunkState) -> None:
        self._table = table
        # (shape id, tier, backend) -> the inventory element's multiplier
        self._tags: dict[tuple[int, str, str], int] = {}
        self.digested = bytearray(b"\x01" * PARTS)  # partitions counted in counts.digests
        self._all_digested = True

    def restart(self, built: bool) -> None:
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
        tag = self.tag
        for h, rec in self._table.parts[b].items():
            for sid, pls in record_keys(rec):
                for p in placements_of(pls):
                    if not row_shared(p):
                        where = (row_instance(p), row_tier(p))
                        e = element(h, tag(sid, row_tier(p), row_backend(p)))
                        acc[where] = acc.get(where, 0) ^ e
        counts = self._table.counts
        for (inst, tier), value in acc.items():
            counts.digest_for(inst, tier)[b] ^= np.uint64(value)
        self.digested[b] = 1
        self._all_digested = all(self.digested)

    def tag(self, sid: int, tier: str, backend: str) -> int:
        """The inventory element's multiplier of a key shape's copies on (tier, backend)."""
        t = self._tags.get((sid, tier, backend))
        if t is None:
            tag = shape_tag(*self._table.shapes[sid].parts, tier, backend)
            t = self._tags[(sid, tier, backend)] = tag_multiplier(tag)
        return t

    def xor(self, inst: str, tier: str, h: bytes, sid: int, backend: str) -> None:
        """Add or remove (the same thing) one own placement in its digest."""
        if self.digested[h[0]]:
            e = np.uint64(element(h, self.tag(sid, tier, backend)))
            self._table.counts.digest_for(inst, tier)[h[0]] ^= e

    def xor_many(self, dig: DigestArray, pending: Iterable[tuple[int, list[bytes]]]) -> None:
        """Add new own copies to the digest ``dig``: per tag multiplier, their chunk hashes
        (one vectorised step each; partitions not yet digested are left alone)."""
        kept = None if self._all_digested else np.frombuffer(self.digested, dtype=np.uint8)
        for multiplier, hs in pending:
            if hs:
                xor_elements(dig, hs, multiplier, kept)

    def xor_own(self, inst: str, tier: str, pending: Iterable[tuple[int, list[bytes]]]) -> None:
        """Remove (or add: the same thing) own copies of ``inst`` on ``tier`` in its digest,
        per tag multiplier their chunk hashes (:meth:`xor_many`; the digest is not made for
        copies only in partitions not yet digested, as :meth:`xor` leaves it)."""
        pending = list(pending)
        if not self._all_digested and not any(self.digested[h[0]] for _, hs in pending for h in hs):
            return
        self.xor_many(self._table.counts.digest_for(inst, tier), pending)

    def read(
        self, lock: AbstractContextManager[object], inst: str, tier: str, prefix: bytes
    ) -> Digest:
        """The inventory digest of ``inst``'s own placements on ``tier`` (``KeyDirectory.digest``):
        every partition digested first, one per hold of ``lock`` (after a restore they are
        built on first use), then the root (``prefix`` empty) or a one-byte prefix's."""
        for b in range(len(self.digested)):
            if not self.digested[b]:
                with lock:
                    self.digest_partition(b)
        with lock:
            if not prefix:
                root = self._table.counts.digests.get((inst, tier))
                return empty_digest() if root is None else [int(b) for b in root.tolist()]
            if len(prefix) != 1:
                raise InvalidInput("a digest prefix is empty or one byte")
            return self.digest_of_prefix(inst, tier, prefix)

    def digest_of_prefix(self, inst: str, tier: str, prefix: bytes) -> list[int]:
        """The digest of ``inst``'s own placements on ``tier`` under a one-byte ``prefix``
        (computed from that partition: 1/256 of the directory)."""
        out = [0] * PARTS
        for h, rec in self._table.parts[prefix[0]].items():
            if not h.startswith(prefix):
                continue
            for sid, pls in record_keys(rec):
                for p in placements_of(pls):
                    if row_instance(p) == inst and row_tier(p) == tier and not row_shared(p):
                        out[h[1]] ^= element(h, self.tag(sid, tier, row_backend(p)))
        return out
