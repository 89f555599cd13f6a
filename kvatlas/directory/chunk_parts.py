"""The chunk table's partitions (issue 31 item 2; docs/directory.md, "Records as columns").

Each of the table's partitions is a :class:`ChunkPart`: it reads and writes like the
``dict[bytes, Record]`` it replaces (the :data:`~kvatlas.directory.chunk_counts.Partition`
captures and restores exchange): same keys, same iteration order (insertion; a replaced record
keeps its place), same records. But no Python object is kept per chunk: the record is a row of
:class:`~kvatlas.directory.chunk_columns.ChunkColumns`, shared by all partitions, and the
partition maps the chunk's hash to that row by open addressing over the rows' hash column
(:class:`~kvatlas.directory.row_maps.RowMaps`): no ``bytes``, dict slot or row ``int``. Its
hashes are ``bytes`` made when read. A write whose hash is not an exact 32-byte ``bytes`` is
refused (:class:`~kvatlas.errors.InvalidInput`), nothing changed.

Batches are compiled passes over the maps: a batch of new chunks fills free rows and appends
the rest as whole columns, inserted where absent or not at all (:func:`add_fresh`); a batch's
rows (:func:`rows_of`), removals (:func:`remove_chunks`), a restore's maps in one pass
(:func:`parts_of_columns`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, is_

import numpy as np
import numpy.typing as npt

from kvatlas.directory.chunk_columns import ChunkColumns, block_of, known
from kvatlas.directory.l1_owners import NO_OWNER
from kvatlas.directory.records import Placements, Record, l1_owner, new_record, split_columns
from kvatlas.directory.row_copies import WIDTH
from kvatlas.directory.row_map_kernels import ABSENT, BAD_KEY, NO_ROOM, P_LIVE, PART_WORDS
from kvatlas.directory.row_maps import BY_FIRST_BYTE, HASH_BYTES, bad_hash, exact
from kvatlas.directory.token_store import StoredTokens
from kvatlas.events.json_codec import split_hashes

__all__ = [
    "ChunkColumns",
    "ChunkPart",
    "RowView",
    "add_fresh",
    "known",
    "l1_chunks",
    "l1_rows",
    "new_parts",
    "parts_of_columns",
    "remove_chunks",
    "rows_of",
]


class ChunkPart:
    """One partition: chunk hash → row of the shared :class:`ChunkColumns`, read and written
    as a ``dict[bytes, Record]`` (its map: :class:`~kvatlas.directory.row_maps.RowMaps`)."""

    __slots__ = ("_add", "_ctx", "_find", "_live", "_remove", "cols", "index")

    def __init__(self, cols: ChunkColumns, records: Iterable[tuple[bytes, Record]] = ()) -> None:
        maps = cols.maps
        self.cols = cols
        self.index = maps.add_part()  # its number among its columns' partitions
        self._ctx, self._find, self._add, self._remove = (
            maps.ctx_addr,
            maps.find,
            maps.add,
            maps.take,
        )
        self._live = PART_WORDS * self.index + P_LIVE
        cols.parts.append(self)
        self.update(records)

    @property
    def row(self) -> RowView:
        """Hash → row, as a read-only mapping (tests and walkers that want the rows)."""
        return RowView(self)

    def row_of(self, h: object) -> int | None:
        r: int = self._find(self._ctx, self.index, id(h), 0)
        if r == BAD_KEY:
            return self._row_of_exact(h)
        return None if r < 0 else r

    def _row_of_exact(self, h: object) -> int | None:
        """:meth:`row_of` of a key that is not an exact 32-byte ``bytes``."""
        e = exact(h)
        return None if e is h else self.row_of(e)

    def hashes_and_rows(self) -> tuple[list[bytes], list[int]]:
        """The partition's hashes and rows, in order, as two columns."""
        raw, rows = self.raw_hashes_and_rows()
        return split_hashes(raw), rows

    def raw_hashes_and_rows(self) -> tuple[bytes, list[int]]:
        """:meth:`hashes_and_rows` with the hashes end to end, one copy (what a capture
        takes under the lock: ``json_codec.split_hashes`` makes them after it)."""
        maps = self.cols.maps
        rows = maps.rows(self.index)
        return maps.raw_hashes(rows), rows.tolist()

    # ------------------------------------------------------------------ reads

    def get(self, h: bytes, default: Record | None = None) -> Record | None:
        r = self._find(self._ctx, self.index, id(h), 0)
        if r >= 0:
            return self.cols.record(r)
        if r == BAD_KEY and (e := self._row_of_exact(h)) is not None:
            return self.cols.record(e)
        return default

    def __getitem__(self, h: bytes) -> Record:
        r = self._find(self._ctx, self.index, id(h), 0)
        if r < 0 and (r == ABSENT or (r := self._row_of_exact(h)) is None):
            raise KeyError(h)
        return self.cols.record(r)

    def __contains__(self, h: object) -> bool:
        r = self._find(self._ctx, self.index, id(h), 0)
        return r >= 0 or (r == BAD_KEY and self._row_of_exact(h) is not None)

    def __len__(self) -> int:
        return self.cols.maps.meta[self._live]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def keys(self) -> list[bytes]:
        return self.hashes_and_rows()[0]

    def values(self) -> list[Record]:
        return self.cols.records(self.cols.maps.rows(self.index).tolist())

    def records_at(self, hashes: list[bytes]) -> list[Record]:
        """The records of ``hashes`` (each held), in that order, built by C-level maps."""
        parts = np.full(len(hashes), self.index, np.int64)
        rows = self.cols.maps.rows_of(hashes, parts)
        if None in rows:
            raise KeyError(hashes[rows.index(None)])
        return self.cols.records(rows)  # type: ignore[arg-type]

    def items(self) -> list[tuple[bytes, Record]]:
        hashes, rows = self.hashes_and_rows()
        return list(zip(hashes, self.cols.records(rows), strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkPart | dict):
            return list(self.items()) == list(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkPart({dict(self.items())!r})"

    # ------------------------------------------------------------------ writes

    def __setitem__(self, h: bytes, rec: Record) -> None:
        r = self._find(self._ctx, self.index, id(h), 0)
        if r >= 0:
            self.cols.put(r, rec)
            return
        if r == BAD_KEY:
            e = exact(h)
            if e is h:
                raise bad_hash(h)
            self[e] = rec  # type: ignore[index]
            return
        row = self.cols.append(rec)
        while self._add(self._ctx, self.index, id(h), row) == NO_ROOM:
            self.cols.maps.relocate(self.index, 1)

    def __delitem__(self, h: bytes) -> None:
        r = self._remove(self._ctx, self.index, id(h), 0)
        if r < 0:
            e = exact(h)
            if r == ABSENT or e is h:
                raise KeyError(h)
            del self[e]  # type: ignore[arg-type]
            return
        self.cols.clear(r)

    def update(self, records: Iterable[tuple[bytes, Record]]) -> None:
        for h, rec in records:
            self[h] = rec


class RowView(Mapping[bytes, int]):
    """A partition's hash → row map, read-only, in the partition's order."""

    __slots__ = ("_part",)

    def __init__(self, part: ChunkPart) -> None:
        self._part = part

    def __getitem__(self, h: bytes) -> int:
        r = self._part.row_of(h)
        if r is None:
            raise KeyError(h)
        return r

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._part.keys())

    def __len__(self) -> int:
        return len(self._part)

    def values(self) -> list[int]:  # type: ignore[override]
        return self._part.hashes_and_rows()[1]

    def items(self) -> list[tuple[bytes, int]]:  # type: ignore[override]
        return list(zip(*self._part.hashes_and_rows(), strict=True))


def new_parts(n: int, parts: Sequence[Mapping[bytes, Record] | ChunkPart] = ()) -> list[ChunkPart]:
    """``n`` empty partitions sharing new columns, or (``parts`` given) holding their records
    (split into the columns by C-level maps); the list is the columns' own
    (:attr:`ChunkColumns.parts`: batches address partitions by their hashes' first byte)."""
    if _whole(n, parts):  # the partitions of one set of columns (a reader's): adopted
        return parts[0].cols.parts  # type: ignore[union-attr]
    cols = ChunkColumns()
    out = [ChunkPart(cols) for _ in range(n)]
    for part, records in zip(out, parts, strict=False):
        recs = list(records.values())
        tokens, offsets, indexed, sids, pls, rests = split_columns(recs)
        flagged = (np.asarray(sids, np.int64) << 1) + np.asarray(indexed, np.int64)
        rows = cols.append_rows(tokens, np.asarray(offsets, np.int64), flagged.tolist(), pls, rests)
        cols.l1.extend(np.full(len(rows), NO_OWNER, np.int32))
        deque(map(cols.l1.put, rows, pls, rests), maxlen=0)
        hashes = list(records.keys())
        at = np.full(len(hashes), part.index, np.int64)
        cols.maps.fill(hashes, at, rows.start)
    return cols.parts


def _whole(n: int, parts: Sequence[Mapping[bytes, Record] | ChunkPart]) -> bool:
    first = parts[0] if len(parts) == n else None
    return (
        isinstance(first, ChunkPart)
        and len(first.cols.parts) == n
        and all(map(is_, first.cols.parts, parts))
    )


def parts_of_columns(
    n: int,
    hashes: Sequence[bytes] | npt.NDArray[np.uint64],
    bounds: list[int],
    tokens: list[StoredTokens | None],
    offsets: npt.NDArray[np.int64],
    flagged: list[int],
    placements: list[Placements],
    owners: npt.NDArray[np.int64],
    names: Sequence[str],
    bound: int,
) -> list[ChunkPart]:
    """``n`` partitions of one-key records given as columns (``flagged``: 2 * shape id +
    indexed; ``owners``: each one's :func:`~kvatlas.directory.records.l1_owner` as an index of
    ``names``, -1 if none; ``bound``: how many ``tokens`` are known), in partition order:
    partition ``p`` holds rows ``bounds[p]:bounds[p + 1]``. A restore's path: no record built,
    the maps filled by one compiled pass (a hash twice: its later row, as a dict's), from
    ``hashes`` as ``bytes`` or as a snapshot's words (four ``uint64`` a hash: no object read).
    Change a row's keys afterwards with ``part[h] = rec``."""
    cols = ChunkColumns()
    cols.append_rows(tokens, offsets, flagged, placements, None, bound)
    ids = np.full(len(names) + 1, NO_OWNER, np.int32)  # (-1 takes the last: NO_OWNER)
    for i in np.unique(owners[owners >= 0]).tolist():
        ids[i] = cols.l1.intern(names[i])
    cols.l1.extend(ids[owners])
    for _ in range(n):
        ChunkPart(cols)
    edges = np.asarray(bounds[: n + 1], np.int64)
    at = np.repeat(np.arange(len(edges) - 1, dtype=np.int64), np.diff(edges))
    if isinstance(hashes, np.ndarray):
        cols.maps.fill_words(hashes, at)
    else:
        cols.maps.fill(hashes, at, 0)
    return cols.parts


_INDEX = attrgetter("index")


def add_fresh(
    parts_of: Sequence[ChunkPart],
    hashes: Sequence[bytes],
    tokens: Sequence[StoredTokens | None],
    offsets: npt.NDArray[np.int64],
    indexed: Sequence[bool],
    sid: int,
    placements: Sequence[Placements],
) -> bool:
    """Append one-key records of new chunks, entry ``i`` into ``parts_of[i]`` (its
    partition; all share one :class:`ChunkColumns`; or ``parts_of`` is the columns' own list
    of partitions, :attr:`ChunkColumns.parts`, each entry's ``parts_of[h[0]]``), the
    placements one batch's (one instance, tier and sharing: one L1 owner). Inserted where
    absent, in one compiled pass: if a chunk is held (or named twice: its second insert finds
    the first), the inserts are taken back and ``False`` is returned (nothing changed). A
    hash not an exact 32-byte ``bytes`` raises :class:`~kvatlas.errors.InvalidInput`, nothing
    changed."""
    n = len(hashes)
    cols = parts_of[0].cols
    if n <= FEW_FRESH:
        fields = (tokens, offsets.tolist(), indexed, repeat(sid), placements)
        return _add_few(parts_of, hashes, list(map(new_record, *fields)))
    free, top = cols.free, len(cols.offsets)
    k = min(len(free), n)  # free rows first (last freed first), then new ones
    reused = free[len(free) - k :][::-1].tolist()
    part_nos = BY_FIRST_BYTE
    if parts_of is not cols.parts:
        if len(parts_of) != n:
            raise ValueError(f"{len(parts_of)} partitions for {n} chunks")
        part_nos = np.fromiter(map(_INDEX, parts_of), np.int64, n)
    if not cols.maps.add_fresh(hashes, part_nos, np.array(reused, np.int64), top):
        return False
    owner = l1_owner(placements[0])  # type: ignore[arg-type]
    owner_id = NO_OWNER if owner is None else cols.l1.intern(owner)
    flagged = list(map((2 * sid, 2 * sid + 1).__getitem__, indexed))
    if k:
        del free[len(free) - k :]
        block = block_of(tokens[:k], flagged[:k], placements[:k], None)
        at = [WIDTH * r for r in reused]
        heads = [WIDTH * i for i in range(k)]
        into = map(slice, at, map(WIDTH.__add__, at))
        rows = map(block.__getitem__, map(slice, heads, map(WIDTH.__add__, heads)))
        deque(map(cols.objs.__setitem__, into, rows), maxlen=0)
        cols.bound += known(tokens[:k])  # (the rows were free: no content)
        deque(map(cols.offsets.__setitem__, reused, offsets[:k].tolist()), maxlen=0)
        cols.l1.fill(reused, owner_id)
    cols.append_rows(tokens[k:], offsets[k:], flagged[k:], placements[k:])
    cols.l1.extend(np.full(n - k, owner_id, np.int32))
    return True


FEW_FRESH = 2
"""Batches of new chunks up to this size are added chunk by chunk through the maps' single
entry points (≈0.3 µs a read or insert): the batch kernels' fixed cost is ≈8 µs (a
one-chunk KV event, a node's small store)."""


def _add_few(parts_of: Sequence[ChunkPart], hashes: Sequence[bytes], records: list[Record]) -> bool:
    """:func:`add_fresh` of a few chunks: every hash checked, distinct and found absent before
    any is added (rows reused in the same order: last freed first)."""
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise bad_hash(h)
    at = parts_of if parts_of is not parts_of[0].cols.parts else [parts_of[h[0]] for h in hashes]
    if not len(at) == len(records) == len(hashes):
        raise ValueError(f"{len(at)} partitions, {len(records)} records, {len(hashes)} chunks")
    if len(set(hashes)) != len(hashes) or any(map(ChunkPart.__contains__, at, hashes)):
        return False  # (a hash twice: as the batch kernel finds its first insert held)
    deque(map(ChunkPart.__setitem__, at, hashes, records), maxlen=0)
    return True


def rows_of(parts: Sequence[ChunkPart], hashes: Iterable[bytes]) -> list[int | None]:
    """The row of each chunk of ``hashes`` (``None``: not held) in its partition
    ``parts[h[0]]``."""
    listed = hashes if isinstance(hashes, list | tuple) else list(hashes)
    if not listed:
        return []
    return parts[0].cols.maps.rows_of(listed, _part_numbers(parts, listed))


def _part_numbers(parts: Sequence[ChunkPart], hashes: Sequence[bytes]) -> npt.NDArray[np.int64]:
    """Each hash's partition ``parts[h[0]]`` as the maps number it (:data:`BY_FIRST_BYTE`
    when ``parts`` is the columns' own list: its first byte)."""
    if parts is parts[0].cols.parts:
        return BY_FIRST_BYTE
    return np.fromiter((parts[h[0]].index for h in hashes), np.int64, len(hashes))


def remove_chunks(parts: Sequence[ChunkPart], hashes: list[bytes]) -> None:
    """``del parts[h[0]][h]`` of each of ``hashes``, their rows cleared in bulk."""
    if not hashes:
        return
    cols = parts[0].cols
    taken = cols.maps.remove_many(hashes, _part_numbers(parts, hashes))
    if -1 in taken:
        raise KeyError(hashes[taken.index(-1)])
    cols.clear_rows(taken)


def l1_chunks(parts: Sequence[ChunkPart], name: str) -> list[bytes]:
    """The chunks of ``parts`` (the partitions of one set of columns) that have an L1
    placement ``name`` owns, partition by partition (:func:`l1_rows`' hashes)."""
    return l1_rows(parts, name)[0]


def l1_rows(parts: Sequence[ChunkPart], name: str) -> tuple[list[bytes], list[int]]:
    """:func:`l1_chunks` and their rows: the column's rows, found in the partitions' hash →
    row maps (a pass over them: what fencing, which is rare, visits)."""
    cols = parts[0].cols
    rows = cols.l1.rows_of(name)
    left = len(rows)
    if not left:
        return [], []
    hit = np.zeros(len(cols.offsets), np.bool_)
    hit[rows] = True
    hashes: list[bytes] = []
    held: list[int] = []
    for part in parts:
        if len(part):
            at_rows = cols.maps.rows(part.index)
            found = at_rows[hit[at_rows]]
            if len(found):
                hashes += cols.maps.hashes_of(found)
                held += found.tolist()
                left -= len(found)
                if not left:
                    break
    return hashes, held
