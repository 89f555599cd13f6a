"""Chunk counts: what follows from the chunk table's records (counters, own L1 placements
per instance, bytes per tier and module, inventory digests), the partitioning of the records
(:data:`PARTS` dicts by the first byte of the chunk hash) and the change journal a capture
hooks into. See :mod:`kvatlas.directory.chunk_table`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvatlas.directory.chunk_parts import ChunkPart
from kvatlas.directory.records import (
    Module,
    Record,
    key_count,
    l1_owner,
    placements_of,
    record_keys,
    row_module,
    row_size,
    row_tier,
)

PARTS = 256
L2_TIER = "l2"  # the tier quotas count (ChunkCounts.l2_bytes_by_shape)
Partition = dict[bytes, Record]
"""Chunk hash -> record, a chunk in partition hash[0]: what captures and restores exchange
(the table keeps each partition as a :class:`~kvatlas.directory.chunk_parts.ChunkPart`)."""
DigestArray = np.ndarray[Any, Any]  # 256 uint64 buckets (kvatlas.events.inventory)


@dataclass(slots=True)
class ChunkCounts:
    """What follows from the records: key and placement counts, bytes per tier, per
    instance its own L1 placements (the chunks holding them, what fencing visits, are a
    column of the records: :mod:`~kvatlas.directory.l1_owners`), and placements and bytes per :data:`~kvatlas.directory.records.Module` (usage), and the
    inventory digest of every (instance, tier)'s own placements (see
    :mod:`kvatlas.events.inventory`; after a restore, built by
    :meth:`~kvatlas.directory.chunk_digests.InventoryDigests.digest_partition`)."""

    keys: int = 0
    placements: int = 0
    l1_placements: Counter[str] = field(default_factory=Counter)
    bytes_by_tier: Counter[str] = field(default_factory=Counter)
    module_placements: Counter[Module] = field(default_factory=Counter)
    module_bytes: Counter[Module] = field(default_factory=Counter)
    digests: dict[tuple[str, str], DigestArray] = field(default_factory=dict)
    content_conflicts: int = 0
    """Stores whose ids differed from a chunk's bound content while another namespace of the
    salt held keys of it, left unbound (:func:`~kvatlas.directory.chunk_binding._conflicts`):
    since the start (not in a snapshot)."""
    l2_bytes_by_shape: Counter[int] = field(default_factory=Counter)
    """Bytes of the L2 placements of each key shape (model, rank, group, salt): summed by
    salt, what quotas count (:func:`~kvatlas.directory.salt_usage.salt_bytes`)."""

    def placements_by_tier(self) -> dict[str, int]:
        """Placements per tier, naming only the tiers that have any."""
        out: Counter[str] = Counter()
        for (_, tier, _), n in self.module_placements.items():
            out[tier] += n
        return dict(+out)

    def digest_for(self, inst: str, tier: str) -> DigestArray:
        """The (mutable) root digest of ``inst``'s own placements on ``tier``."""
        d = self.digests.get((inst, tier))
        if d is None:
            d = self.digests[(inst, tier)] = np.zeros(PARTS, dtype=np.uint64)
        return d

    @classmethod
    def scan(cls, parts: Sequence[Partition | ChunkPart]) -> ChunkCounts:
        """The counts of ``parts``, by one pass over every record."""
        out = cls()
        for part in parts:
            for rec in part.values():
                out.keys += key_count(rec)
                for sid, pls in record_keys(rec):
                    for p in placements_of(pls):
                        out.placements += 1
                        out.bytes_by_tier[row_tier(p)] += row_size(p)
                        if row_tier(p) == L2_TIER:
                            out.l2_bytes_by_shape[sid] += row_size(p)
                        out.module_placements[row_module(p)] += 1
                        out.module_bytes[row_module(p)] += row_size(p)
                        owner = l1_owner(p)
                        if owner is not None:
                            out.l1_placements[owner] += 1
        return out


class ChangeJournal(Protocol):
    """Told about every chunk about to change, with its record (``None``: absent) before the
    change; see :class:`kvatlas.directory.capture.CowJournal`."""

    def save(self, h: bytes, rec: Record | None) -> None: ...
