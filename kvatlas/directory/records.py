"""Directory records: what lookups return (placements, prefix summaries, pages) and the
compact per-chunk state behind them.

Per-chunk state is deliberately lean (the directory holds millions of chunks) and invisible to
the cyclic garbage collector: a chunk is one flat immutable tuple, its *record*::

    (tokens, token_offset, indexed, shape_id, placements, shape_id, placements, ...)

``shape_id`` is the directory's interned id of the non-hash part of an ObjectKey (a
:class:`KeyShape`), and ``placements`` is one :class:`PlacementRow` (a plain tuple with the
fields of :class:`Placement`, in order) or a tuple of them. Every element is an int, str,
float, bool, ``None``, a numpy array or a tuple of those, so CPython untracks each record at its
first collection: a directory of millions of chunks adds nothing to full-collection pauses
(with one class instance per chunk, each full collection walked them all). Immutable values
also let snapshots copy-on-write at chunk granularity: a change replaces the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvatlas.keys import BlendNamespace, ObjectKey


@dataclass(frozen=True, slots=True)
class Placement:
    """One live copy of a key. For a shared backend ``instance_id`` is the last reporter."""

    instance_id: str
    incarnation: int
    tier: str
    backend: str
    size_bytes: int
    shared: bool
    last_access: float

    @property
    def ident(self) -> tuple[str, str, str | None]:
        """Shared pools hold one copy per (tier, backend) fleet-wide; others one per instance."""
        return (self.tier, self.backend, None if self.shared else self.instance_id)

    def sort_key(self) -> tuple[str, str, str]:
        return (self.instance_id, self.tier, self.backend)


# (instance_id, incarnation, tier, backend, size_bytes, shared, last_access): a Placement's
# fields as a plain tuple (GC-untrackable); ``Placement(*row)`` turns it into the public value.
PlacementRow = tuple[str, int, str, str, int, bool, float]
Placements = PlacementRow | tuple[PlacementRow, ...]
Record = tuple[Any, ...]  # see the module docstring
TOKENS, OFFSET, INDEXED, KEYS = 0, 1, 2, 3  # record fields; keys are record[KEYS:]


def placements_of(value: Placements) -> tuple[PlacementRow, ...]:
    """The rows of one key's ``placements`` slot (one row, or a tuple of rows)."""
    return value if type(value[0]) is tuple else (value,)  # type: ignore[return-value]


def pack_placements(items: list[PlacementRow]) -> Placements | None:
    """The ``placements`` slot for ``items`` (``None`` if empty: the key is gone)."""
    if not items:
        return None
    return items[0] if len(items) == 1 else tuple(items)


def row_ident(row: PlacementRow) -> tuple[str, str, str | None]:
    """:attr:`Placement.ident` of a row."""
    return (row[2], row[3], None if row[5] else row[0])


@dataclass(frozen=True, slots=True)
class KeyShape:
    """The part of an ObjectKey besides its chunk hash; interned, shared by many keys."""

    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str
    namespace: BlendNamespace = field(compare=False)

    @property
    def parts(self) -> tuple[str, int, int, str]:
        return (self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)

    def key(self, chunk_hash: bytes) -> ObjectKey:
        return ObjectKey(chunk_hash, *self.parts)


@dataclass(frozen=True, slots=True)
class KeyPlacements:
    key: ObjectKey
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class PrefixHolder:
    """How many leading chunks of a query one holder has, all ranks included.

    ``instance_id`` is ``None`` for a shared pool (then ``backend`` names the pool).
    """

    instance_id: str | None
    tier: str
    backend: str
    shared: bool
    chunks: int


@dataclass(frozen=True, slots=True)
class TokenLookup:
    chunks: int
    results: list[KeyPlacements]
    prefix: list[PrefixHolder]


@dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of :meth:`KeyDirectory.list_keys`; ``next_cursor`` is ``None`` at the end."""

    items: list[KeyPlacements]
    next_cursor: str | None
    next_offset: int | None = None
    """Set by :func:`page_keys` when the listing was asked by offset and goes on."""


@dataclass(frozen=True, slots=True)
class CapacityDeclaration:
    """The newest capacity declaration of an instance (``config`` events)."""

    incarnation: int
    revision: int
    capacities: dict[tuple[str, str], int]  # (tier, backend) -> bytes


Holder = tuple["str | None", str, str, bool]


def prefix_summary(results: list[KeyPlacements], world_size: int = 1) -> list[PrefixHolder]:
    """For each holder (instance, or shared pool), how many *leading* chunks it holds on every
    one of the ``world_size`` ranks; ``results`` are chunk-major, rank-minor. Longest first."""
    counts: dict[Holder, int] = {}
    alive: set[Holder] | None = None
    for c in range(len(results) // world_size):
        held: set[Holder] | None = None
        for r in results[c * world_size : (c + 1) * world_size]:
            here = {
                (None if p.shared else p.instance_id, p.tier, p.backend, p.shared)
                for p in r.placements
            }
            held = here if held is None else held & here
        alive = (held or set()) if alive is None else alive & (held or set())
        if not alive:
            break
        for holder in alive:
            counts[holder] = counts.get(holder, 0) + 1
    summary = [PrefixHolder(*holder, chunks=n) for holder, n in counts.items()]
    summary.sort(key=lambda h: (-h.chunks, h.instance_id or "", h.tier, h.backend))
    return summary
