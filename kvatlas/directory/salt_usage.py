"""Bytes per cache salt on one tier: what a salt's quota is measured against
(``docs/cache-control.md``), and the facts about each key of chosen salts that fleet eviction
plans with. L2 bytes per salt come from a counter per key shape the chunk table keeps as
placements come and go (:func:`salt_bytes`); any other tier, and the keys of chosen salts, by
one pass over the records, one partition per hold of the directory lock, so ingestion waits at
most one partition's pass. A copy in a shared pool is one placement and counts once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from kvatlas.directory.chunk_counts import PARTS
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.records import (
    PlacementRow,
    placements_of,
    record_keys,
    record_offset,
    row_backend,
    row_instance,
    row_last_access,
    row_shared,
    row_size,
    row_tier,
)
from kvatlas.events import UNKNOWN_OFFSET
from kvatlas.keys import ObjectKey


def salt_bytes(chunks: ChunkTable, lock: threading.Lock) -> dict[str, int]:
    """Bytes of the L2 placements of each salt's keys (salts with none are absent), from the
    counter the chunk table keeps per key shape as placements come and go: a pass over the
    shapes (a handful per model and salt), not over the records."""
    out: Counter[str] = Counter()
    with lock:
        table = chunks.shapes.shapes
        by_shape = list(chunks.counts.l2_bytes_by_shape.items())
    for sid, n_bytes in by_shape:
        out[table[sid].cache_salt] += n_bytes
    return {salt: n for salt, n in out.items() if n}  # (never negative: a bug would show)


def bytes_by_salt(chunks: ChunkTable, lock: threading.Lock, tier: str) -> dict[str, int]:
    """Bytes of the ``tier`` placements of each salt's keys (salts with none are absent), by
    one pass over the records (the oracle of :func:`salt_bytes`; any tier)."""
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


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds one ``tier`` copy: its instance (a shared pool's last reporter), whether a
    pool shares it, and the backend."""

    instance_id: str
    shared: bool
    backend: str


@dataclass(frozen=True, slots=True)
class SaltKey:
    """One key holding ``tier`` copies: their bytes (what evicting it frees from the salt's
    usage), its last access on any tier (the newest ``last_access`` of its placements), its
    chunk's index in its sequence (0 when the offset is unknown) and the holders of the copies.
    The directory keeps no access count per key (only the newest access of each copy)."""

    key: ObjectKey
    size_bytes: int
    last_access: float
    position: int
    holders: tuple[Holder, ...]


def keys_of_salts(
    chunks: ChunkTable, lock: threading.Lock, salts: Collection[str], tier: str
) -> dict[str, list[SaltKey]]:
    """Each of ``salts``' keys that has ``tier`` copies (salts with none are absent), in the
    directory's order (chunk hash), one partition per lock hold as :func:`bytes_by_salt`."""
    wanted = frozenset(salts)
    out: dict[str, list[SaltKey]] = {}
    memo: dict[object, tuple[Holder, ...]] = {}
    if not wanted:
        return out
    for b in range(PARTS):
        with lock:
            table = chunks.shapes.shapes
            chunk_size = chunks.chunk_size
            tenants = chunks.tenants.rows
            for h, rec in chunks.parts[b].items():
                offset = record_offset(rec)
                bindings = tenants.get(h)  # a chunk of several salts: each salt's offset
                for sid, pls in record_keys(rec):
                    shape = table[sid]
                    if shape.cache_salt not in wanted:
                        continue
                    if bindings is not None:
                        offset = bindings.get(shape.cache_salt, (None, UNKNOWN_OFFSET))[1]
                    rows = placements_of(pls)
                    on_tier = [p for p in rows if row_tier(p) == tier]
                    if not on_tier:
                        continue
                    out.setdefault(shape.cache_salt, []).append(SaltKey(
                        shape.key(h),
                        sum(map(row_size, on_tier)),
                        max(map(row_last_access, rows)),
                        offset // chunk_size if offset >= 0 else 0,
                        _holders(on_tier, memo),
                    ))  # fmt: skip
    return out


def _holders(
    rows: list[PlacementRow], memo: dict[object, tuple[Holder, ...]]
) -> tuple[Holder, ...]:
    """The holders of ``rows``, one tuple shared by every key with the same holders."""
    ident = tuple([(row_instance(p), row_shared(p), row_backend(p)) for p in rows])
    found = memo.get(ident)
    if found is None:
        found = memo[ident] = tuple(Holder(*i) for i in ident)
    return found
