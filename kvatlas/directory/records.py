"""Directory records: what lookups return (placements, prefix summaries, pages) and the
compact per-chunk state behind them.

Per-chunk state is deliberately lean (the directory holds millions of chunks) and invisible to
the cyclic garbage collector: a chunk is read and written as one flat immutable tuple, its
*record* (kept split into the chunk table's columns, :mod:`~kvatlas.directory.chunk_parts`,
and built when read), and each copy of a key is one flat tuple, its *placement row*. Every
element of either is an int, str, float, bool, ``None``, a numpy array or a tuple of those, so
CPython untracks each at its first collection: a directory of millions of chunks adds nothing
to full-collection pauses. Immutable values also let snapshots copy-on-write at chunk
granularity: a change replaces the record. The layout of both tuples is private to this module
(and the columns' split of a record, :func:`split_record`): everything else builds and reads
them through the functions below (see docs/directory.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import add, itemgetter
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.directory.token_store import StoredTokens, widened
from kvatlas.events import VOLATILE_TIERS, EventBatch
from kvatlas.keys import ObjectKey
from kvatlas.keys.tokens import TokenArray


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


@dataclass(frozen=True, slots=True)
class KeyPlacements:
    """A key's placements; ``content`` is its chunk's bound token ids (``None``: unknown),
    set by lookups and listings (not part of equality)."""

    key: ObjectKey
    placements: tuple[Placement, ...]
    content: TokenArray | None = field(default=None, compare=False)


def key_placements_of(
    keys: Sequence[ObjectKey],
    placements: Sequence[tuple[Placement, ...]],
    contents: Sequence[TokenArray | None],
) -> list[KeyPlacements]:
    """``KeyPlacements(keys[i], placements[i], contents[i])`` of each ``i``, made by C-level
    maps setting each slot through its descriptor (a lookup's answers: the frozen class's
    ``__init__``, a Python call setting each through ``object.__setattr__``, takes twice as
    long)."""
    out = list(map(object.__new__, repeat(KeyPlacements, len(keys))))
    fields = zip(("key", "placements", "content"), (keys, placements, contents), strict=True)
    for name, values in fields:
        deque(map(getattr(KeyPlacements, name).__set__, out, values), maxlen=0)
    return out


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
    total: int | None = None
    """Set by :func:`page_keys`: how many keys match the listing's filters."""


@dataclass(frozen=True, slots=True)
class CapacityDeclaration:
    """The newest capacity declaration of an instance (``config`` events)."""

    incarnation: int
    revision: int
    capacities: dict[tuple[str, str], int]  # (tier, backend) -> bytes

    @staticmethod
    def after(cur: CapacityDeclaration | None, batch: EventBatch) -> CapacityDeclaration | None:
        """The declaration once the ``config`` batch is applied (``None``: older than
        ``cur``, which stands); the same revision adds to it, a newer one replaces it."""
        assert batch.capacity_bytes is not None and batch.capacity_revision is not None
        version = (batch.incarnation, batch.capacity_revision)
        where = (batch.tier, batch.backend)
        if cur is None or version > (cur.incarnation, cur.revision):
            return CapacityDeclaration(*version, {where: batch.capacity_bytes})
        if version == (cur.incarnation, cur.revision):
            return CapacityDeclaration(*version, {**cur.capacities, where: batch.capacity_bytes})
        return None


# ------------------------------------------------------------------ placement rows

# A Placement's fields, in order, as a plain tuple: ``Placement(*row)`` is the public value.
PlacementRow = tuple[str, int, str, str, int, bool, float]
Placements = PlacementRow | tuple[PlacementRow, ...]
"""One key's copies: a single row, or a tuple of rows (never empty)."""

_INSTANCE: Final = 0  # row fields, in Placement's field order
_INCARNATION: Final = 1
_TIER: Final = 2
_BACKEND: Final = 3
_SIZE: Final = 4
_SHARED: Final = 5
_ACCESS: Final = 6


def placement_row(
    instance_id: str,
    incarnation: int,
    tier: str,
    backend: str,
    size_bytes: int,
    shared: bool,
    last_access: float,
) -> PlacementRow:
    return (instance_id, incarnation, tier, backend, size_bytes, shared, last_access)


def rows_from_columns(*columns: list[Any]) -> list[PlacementRow]:
    """Rows zipped from one list per :class:`Placement` field, in field order."""
    return list(zip(*columns, strict=True))


# Field getters (C-level: they sit in per-placement loops).
row_instance: Callable[[PlacementRow], str] = itemgetter(_INSTANCE)
row_incarnation: Callable[[PlacementRow], int] = itemgetter(_INCARNATION)
row_tier: Callable[[PlacementRow], str] = itemgetter(_TIER)
row_backend: Callable[[PlacementRow], str] = itemgetter(_BACKEND)
row_size: Callable[[PlacementRow], int] = itemgetter(_SIZE)
row_shared: Callable[[PlacementRow], bool] = itemgetter(_SHARED)
row_last_access: Callable[[PlacementRow], float] = itemgetter(_ACCESS)


def row_ident(row: PlacementRow) -> tuple[str, str, str | None]:
    """:attr:`Placement.ident` of a row."""
    return (row[_TIER], row[_BACKEND], None if row[_SHARED] else row[_INSTANCE])


Module = tuple["str | None", str, str]
"""Where copies live: (owning instance, or ``None`` for a shared pool; tier; backend)."""


def row_module(row: PlacementRow) -> Module:
    return (None if row[_SHARED] else row[_INSTANCE], row[_TIER], row[_BACKEND])


def l1_owner(row: PlacementRow) -> str | None:
    """The instance whose own process memory (L1, or an engine's GPU / CPU offload) holds
    this copy (``None``: L2 or shared); fencing that instance drops the copy."""
    return row[_INSTANCE] if row[_TIER] in VOLATILE_TIERS and not row[_SHARED] else None


def accessed_at(row: PlacementRow, ts: float) -> PlacementRow:
    """The row with ``last_access`` set to ``ts``."""
    return (*row[:_ACCESS], ts)  # type: ignore[return-value]


def placements_of(value: Placements) -> tuple[PlacementRow, ...]:
    """The rows of one key's ``placements`` slot (one row, or a tuple of rows)."""
    return value if type(value[0]) is tuple else (value,)  # type: ignore[return-value]


def group_placements(rows: Sequence[PlacementRow]) -> Placements:
    """The ``placements`` slot for one or more ``rows``."""
    return rows[0] if len(rows) == 1 else tuple(rows)


def pack_placements(rows: Sequence[PlacementRow]) -> Placements | None:
    """The ``placements`` slot for ``rows`` (``None`` if empty: the key is gone)."""
    return group_placements(rows) if rows else None


def public_placements(pls: Placements) -> tuple[Placement, ...]:
    """One key's rows as :class:`Placement` values, sorted by (instance, tier, backend)."""
    if type(pls[0]) is not tuple:
        return (Placement(*pls),)  # type: ignore[arg-type]
    rows = sorted(pls, key=_row_order)  # type: ignore[arg-type]
    return tuple(Placement(*row) for row in rows)


_row_order = itemgetter(_INSTANCE, _TIER, _BACKEND)


def public_groups(groups: Sequence[Placements | None]) -> list[tuple[Placement, ...]]:
    """:func:`public_placements` of each group (``None``: ``()``), built once per distinct
    group object: the keys of one batch share their placements, and ``groups`` holds every
    one alive for the call, so an ``id`` names one group throughout."""
    if groups and groups.count(groups[0]) == len(groups):  # one group (a batch's keys)
        first = groups[0]
        return [() if first is None else public_placements(first)] * len(groups)
    built: dict[int, tuple[Placement, ...]] = {}
    out: list[tuple[Placement, ...]] = []
    for pls in groups:
        if pls is None:
            out.append(())
            continue
        public = built.get(id(pls))
        if public is None:
            public = built[id(pls)] = public_placements(pls)
        out.append(public)
    return out


# ------------------------------------------------------------------ chunk records

Record = tuple[Any, ...]
"""``(tokens, token_offset, indexed, shape_id, placements, shape_id, placements, ...)``:
the chunk's bound content (``None``: unknown; stored compactly, see
:mod:`kvatlas.directory.token_store`) and its stored offset, whether the blend index holds
it, then one (interned :class:`KeyShape` id, :data:`Placements`) pair per key."""
KeyPair = tuple[int, Placements]
_TOKENS: Final = 0  # record fields; the keys follow from _KEYS on, in (shape id, placements) pairs
_OFFSET: Final = 1
_INDEXED: Final = 2
_KEYS: Final = 3


def new_record(
    tokens: StoredTokens | None, offset: int, indexed: bool, shape_id: int, placements: Placements
) -> Record:
    """The record of a chunk with one key."""
    return (tokens, offset, indexed, shape_id, placements)


def make_record(
    tokens: StoredTokens | None, offset: int, indexed: bool, keys: Iterable[KeyPair]
) -> Record:
    """A record with the given (shape id, placements) pairs."""
    return (tokens, offset, indexed, *chain.from_iterable(keys))


def records_from_columns(
    tokens: Sequence[StoredTokens | None],
    offsets: Sequence[int],
    shape_ids: Iterable[int],
    placements: Iterable[Placements],
    indexed: Iterable[bool] | None = None,
    rests: Sequence[tuple[Any, ...]] | None = None,
) -> list[Record]:
    """Records zipped from the columns :func:`split_record` splits a record into (C-level:
    no Python per record); unindexed unless ``indexed`` says otherwise, one key each unless
    ``rests`` gives the others."""
    flags = repeat(False, len(tokens)) if indexed is None else indexed
    heads = zip(tokens, offsets, flags, shape_ids, placements, strict=True)
    if rests is None or rests.count(()) == len(rests):
        return list(heads)
    return list(map(add, heads, rests))


def split_record(rec: Record) -> tuple[Any, ...]:
    """A record as (content, offset, indexed, first key's shape id, its placements, the
    other keys as flat (shape id, placements) pairs, ``()`` if none): the columns of
    :class:`~kvatlas.directory.chunk_parts.ChunkPart`."""
    return (*rec[:_REST], rec[_REST:])


def join_record(
    tokens: StoredTokens | None,
    offset: int,
    indexed: bool,
    shape_id: int,
    placements: Placements,
    rest: tuple[Any, ...],
) -> Record:
    """The record :func:`split_record` split into these fields."""
    rec = (tokens, offset, indexed, shape_id, placements)
    return rec + rest if rest else rec


def split_columns(records: Sequence[Record]) -> tuple[list[Any], ...]:
    """:func:`split_record` of every record, as six columns (C-level maps)."""
    return (
        list(map(record_stored_tokens, records)),
        list(map(record_offset, records)),
        list(map(record_indexed, records)),
        first_shape_ids(records),
        list(map(_FIRST_PLACEMENTS, records)),
        list(map(_OTHER_KEYS, records)),
    )


def l1_owners(placements: Placements, rest: tuple[Any, ...] = ()) -> list[str]:
    """The distinct :func:`l1_owner` of a record's placements, given split as
    :func:`split_record` splits it (first key's ``placements``, the other keys ``rest``)."""
    rows = placements_of(placements)
    if rest:
        rows = (*rows, *chain.from_iterable(map(placements_of, rest[1::2])))
    return list(dict.fromkeys(o for o in map(l1_owner, rows) if o is not None))


_REST: Final = _KEYS + 2
_FIRST_PLACEMENTS = itemgetter(_KEYS + 1)
_OTHER_KEYS = itemgetter(slice(_REST, None))


# The record's binding: its content (``None``: unknown) as stored, stored offset, and whether
# the blend index holds it (C-level getters: the snapshot writer maps them over every chunk).
record_stored_tokens: Callable[[Record], StoredTokens | None] = itemgetter(_TOKENS)
record_offset: Callable[[Record], int] = itemgetter(_OFFSET)
record_indexed: Callable[[Record], bool] = itemgetter(_INDEXED)


def first_shape_ids(records: Sequence[Record]) -> list[int]:
    """The shape id of each record's first key (C-level: no Python per record)."""
    return list(map(_FIRST_SHAPE, records))


def key_counts(records: Sequence[Record]) -> npt.NDArray[np.int64]:
    """How many keys each record has (C-level)."""
    lengths = np.fromiter(map(len, records), np.int64, len(records))
    return (lengths - _KEYS) >> 1


def indexed_records(records: Iterable[Record]) -> list[Record]:
    """``rebound(rec, its tokens, its offset, True)`` of each record, built C-level (tuple
    concatenation of the binding and the keys): what a bulk reindex marks as indexed."""
    records = list(records)
    heads = zip(map(record_stored_tokens, records), map(record_offset, records), repeat(True))
    return list(map(add, heads, map(_AFTER_BINDING, records)))


_FIRST_SHAPE = itemgetter(_KEYS)
_AFTER_BINDING = itemgetter(slice(_KEYS, None))


def record_tokens(rec: Record) -> TokenArray | None:
    """The chunk's bound token ids as ``uint32`` (``None``: unknown): what public values carry."""
    tokens: StoredTokens | None = rec[_TOKENS]
    return None if tokens is None else widened(tokens)


def key_count(rec: Record) -> int:
    return (len(rec) - _KEYS) >> 1


def shape_ids(rec: Record) -> tuple[int, ...]:
    """The shape id of each key, in record order."""
    return rec[_KEYS::2]


def placement_groups(rec: Record) -> tuple[Placements, ...]:
    """The placements of each key, in record order."""
    return rec[_KEYS + 1 :: 2]


def record_keys(rec: Record) -> Sequence[KeyPair]:
    """(shape id, placements) of each key, in record order."""
    if len(rec) == _KEYS + 2:  # one key: most chunks
        return ((rec[_KEYS], rec[_KEYS + 1]),)
    return [(rec[i], rec[i + 1]) for i in range(_KEYS, len(rec), 2)]


def find_key(rec: Record, shape_id: int) -> int:
    """The position of the key with ``shape_id`` among the record's keys (``-1``: absent)."""
    if rec[_KEYS] == shape_id:
        return 0
    for i in range(_KEYS + 2, len(rec), 2):
        if rec[i] == shape_id:
            return (i - _KEYS) >> 1
    return -1


def other_key(rest: tuple[Any, ...], shape_id: int | None) -> Placements | None:
    """The placements of the key with ``shape_id`` among a record's other keys (``rest``, as
    :func:`split_record` splits them: flat (shape id, placements) pairs); ``None``: absent."""
    for i in range(0, len(rest), 2):
        if rest[i] == shape_id:
            return rest[i + 1]  # type: ignore[no-any-return]
    return None


def placements_at(rec: Record, k: int) -> Placements:
    """The placements of key ``k`` (a position from :func:`find_key`)."""
    return rec[_KEYS + 2 * k + 1]  # type: ignore[no-any-return]


def with_placements_at(rec: Record, k: int, placements: Placements) -> Record:
    j = _KEYS + 2 * k + 1
    return (*rec[:j], placements, *rec[j + 1 :])


def with_key(rec: Record, shape_id: int, placements: Placements) -> Record:
    """The record with one more key."""
    return (*rec, shape_id, placements)


def rebound(rec: Record, tokens: StoredTokens | None, offset: int, indexed: bool) -> Record:
    """The record with its binding (content, offset, indexed) replaced, keys unchanged."""
    return (tokens, offset, indexed, *rec[_KEYS:])
