"""Bytes per cache salt on one tier: what a salt's quota is measured against
(``docs/cache-control.md``). One pass over the records, one partition per hold of the
directory lock, so ingestion waits at most one partition's pass; a copy in a shared pool is one
placement and counts once. Read on demand (the quota routes), never on the event path.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvatlas.directory.chunk_counts import PARTS
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.records import placements_of, record_keys, row_size, row_tier


def bytes_by_salt(chunks: ChunkTable, lock: threading.Lock, tier: str) -> dict[str, int]:
    """Bytes of the ``tier`` placements of each salt's keys (salts with none are absent)."""
    out: Counter[str] = Counter()
    for b in range(PARTS):
        with lock:  # the table's parts and shapes are read under the lock (a restore swaps them)
            table = chunks.shapes.shapes
            for rec in chunks.parts[b].values():
                for sid, pls in record_keys(rec):
                    for p in placements_of(pls):
                        if row_tier(p) == tier:
                            out[table[sid].cache_salt] += row_size(p)
    return dict(+out)
