"""The chunk table's records as columns (issue 31 item 2; docs/directory.md, "Records as columns").

Each of the table's partitions is a :class:`ChunkPart`: it reads and writes like the
``dict[bytes, Record]`` it replaces (the :data:`~kvatlas.directory.chunk_counts.Partition`
captures and restores exchange): same keys, same iteration order (insertion; a replaced record
keeps its place), same records. But no record tuple and no offset ``int`` is kept per chunk:
the partition maps a chunk hash to a row of :class:`ChunkColumns`, shared by all partitions,
where a record is split into four references (content; first key's shape id and indexed flag
as one small ``int``; that key's placements; the other keys) and an ``int64`` offset, and built
again when read. Per chunk that is the dict slot, the row ``int`` (32 B) and 40 bytes of
columns, where a record tuple (80 B) and its offset (32 B) were; and no object per chunk that
the cyclic collector tracks (a batch of new chunks made ≈1.4 young collections per 1,000).

Rows of removed chunks are emptied (references dropped) and reused by the next new chunks, so the
columns stay as long as the most chunks the table held at once (as a ``dict`` keeps its slots)
and are never compacted under the lock. A batch of new chunks fills free rows and appends the
rest as whole columns (:func:`add_fresh`). One more column follows from each row's record, kept
by every write: which instances own an L1 placement (:mod:`~kvatlas.directory.l1_owners`, what
fencing visits).

Records are split and joined by :mod:`~kvatlas.directory.records`' functions (its layout).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_, is_not
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.directory.l1_owners import NO_OWNER, L1Owners
from kvatlas.directory.records import (
    Placements,
    Record,
    join_record,
    l1_owner,
    other_key,
    split_columns,
    split_record,
)
from kvatlas.directory.row_copies import WIDTH, RowsCopy, copied_records, copy_rows
from kvatlas.directory.token_store import StoredTokens

_EMPTY_ROW: Final = (None, 0, None, ())


class ChunkColumns:
    """Every chunk's record fields, by row, for the partitions that share them."""

    __slots__ = ("bound", "free", "l1", "objs", "offsets", "parts")

    def __init__(self) -> None:
        self.objs: list[Any] = []  # WIDTH per row: content, 2 * shape id + indexed,
        # the first key's placements, the other keys as flat (shape id, placements) pairs
        self.offsets = array("q")  # per row: the content's offset
        self.l1 = L1Owners()  # per row: the instances owning an L1 placement of the chunk
        self.free: list[int] = []  # rows of removed chunks, reused last freed first
        self.parts: list[ChunkPart] = []
        self.bound = 0  # rows whose content is known (kept by every write: stats read it)

    def record(self, r: int) -> Record:
        """The record at row ``r`` (every read builds one)."""
        o = WIDTH * r
        objs = self.objs
        flagged = objs[o + 1]
        return join_record(
            objs[o], self.offsets[r], flagged & 1 == 1, flagged >> 1, objs[o + 2], objs[o + 3]
        )

    def records(self, rows: list[int]) -> list[Record]:
        """The records at ``rows``, built by C-level maps (a listing's partition, a walk)."""
        return copied_records(self.copy(rows))

    def copy(self, rows: list[int]) -> RowsCopy:
        """The fields at ``rows`` as they are now."""
        return copy_rows(self.objs, self.offsets, rows)

    def append(self, rec: Record) -> int:
        """A row for a new chunk: a free one, else a new one."""
        if self.free:
            r = self.free.pop()
            self.put(r, rec)
            return r
        tokens, offset, indexed, sid, pls, rest = split_record(rec)
        self.objs += (tokens, 2 * sid + indexed, pls, rest)
        self.bound += tokens is not None
        self.offsets.append(offset)
        self.l1.add(pls, rest)
        return len(self.offsets) - 1

    def put(self, r: int, rec: Record) -> None:
        tokens, offset, indexed, sid, pls, rest = split_record(rec)
        o = WIDTH * r
        self.bound += (tokens is not None) - (self.objs[o] is not None)
        self.objs[o : o + WIDTH] = (tokens, 2 * sid + indexed, pls, rest)
        self.offsets[r] = offset
        self.l1.put(r, pls, rest)

    def clear(self, r: int) -> None:
        self.bound -= self.objs[WIDTH * r] is not None
        self.objs[WIDTH * r : WIDTH * (r + 1)] = _EMPTY_ROW
        self.l1.set(r, NO_OWNER)
        self.free.append(r)

    def fields(self, rows: list[int]) -> tuple[Sequence[Any], ...]:
        """The rows' fields as four columns (:meth:`RowsCopy.fields`; C-level gathers)."""
        return self.copy(rows).fields()

    def key_placements(
        self, rows: list[int], shape_ids: Sequence[int | None]
    ) -> tuple[list[Placements | None], Sequence[StoredTokens | None]]:
        """For each row and shape id, that key's placements in the row's record (``None``: no
        such key), and each row's content: one gather, no record built (a lookup's read)."""
        contents, flagged, firsts, rests = self.fields(rows)
        n, sid = len(rows), shape_ids[0] if rows else None
        if (  # one shape (a prompt's keys), every row's first key the one asked
            sid is not None
            and shape_ids.count(sid) == n
            and flagged.count(2 * sid) + flagged.count(2 * sid + 1) == n
        ):
            return list(firsts), contents
        found = [
            pls if f >> 1 == sid else (other_key(rest, sid) if rest else None)
            for f, pls, rest, sid in zip(flagged, firsts, rests, shape_ids, strict=True)
        ]
        return found, contents

    def put_placements(self, rows: list[int], placements: Placements) -> None:
        """Rows ``rows`` (one-key records) now hold ``placements`` as their key's."""
        objs, at = self.objs, [WIDTH * r + 2 for r in rows]
        deque(map(objs.__setitem__, at, repeat(placements)), maxlen=0)
        self.l1.fill_rows(rows, self.l1.of(placements, ()))

    def clear_rows(self, rows: list[int]) -> None:
        """:meth:`clear` of each row of ``rows``, in that order."""
        objs, at = self.objs, [WIDTH * r for r in rows]
        self.bound -= known(list(map(objs.__getitem__, at)))
        into = map(slice, at, map(WIDTH.__add__, at))
        deque(map(objs.__setitem__, into, repeat(_EMPTY_ROW)), maxlen=0)
        self.l1.fill_rows(rows, NO_OWNER)
        self.free += rows

    def append_rows(
        self,
        tokens: Sequence[StoredTokens | None],
        offsets: npt.NDArray[np.int64],
        flagged: Sequence[int],
        placements: Sequence[Placements],
        rests: Sequence[tuple[Any, ...]] | None = None,
        bound: int | None = None,
    ) -> range:
        """New rows at the end, a record's fields per column (``flagged``: 2 * shape id +
        indexed; ``rests`` the other keys, ``None``: none; ``bound``: how many ``tokens`` are
        known, if the caller knows), by slice assignment (no tuple per row); returns them.
        Their L1 owners follow by :meth:`L1Owners.extend` or :meth:`L1Owners.put`."""
        top, n, block = len(self.offsets), len(tokens), _block(tokens, flagged, placements, rests)
        if self.objs:
            self.objs += block
        else:  # the block is the column (a restore's, 4 refs per chunk: no second copy)
            self.objs = block
        self.bound += known(tokens) if bound is None else bound
        self.offsets.frombytes(np.ascontiguousarray(offsets, "<i8").tobytes())
        return range(top, top + n)


def known(tokens: Sequence[StoredTokens | None]) -> int:
    """How many of ``tokens`` are known contents (``is not None``: ``==`` compares arrays)."""
    return sum(map(is_not, tokens, repeat(None)))


def _block(
    tokens: Sequence[StoredTokens | None],
    flagged: Sequence[int],
    placements: Sequence[Placements],
    rests: Sequence[tuple[Any, ...]] | None,
) -> list[Any]:
    """Rows' references, ``WIDTH`` per row, by slice assignment (no tuple per row)."""
    block: list[Any] = [()] * (WIDTH * len(tokens))
    block[0::WIDTH] = tokens
    block[1::WIDTH] = flagged
    block[2::WIDTH] = placements
    if rests is not None:
        block[3::WIDTH] = rests
    return block


class ChunkPart:
    """One partition: chunk hash → row of the shared :class:`ChunkColumns`, read and written
    as a ``dict[bytes, Record]``."""

    __slots__ = ("cols", "row")

    def __init__(self, cols: ChunkColumns, records: Iterable[tuple[bytes, Record]] = ()) -> None:
        self.cols = cols
        self.row: dict[bytes, int] = {}
        cols.parts.append(self)
        self.update(records)

    # ------------------------------------------------------------------ reads

    def get(self, h: bytes, default: Record | None = None) -> Record | None:
        r = self.row.get(h)
        return default if r is None else self.cols.record(r)

    def __getitem__(self, h: bytes) -> Record:
        return self.cols.record(self.row[h])

    def __contains__(self, h: object) -> bool:
        return h in self.row

    def __len__(self) -> int:
        return len(self.row)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.row)

    def keys(self) -> Iterable[bytes]:
        return self.row.keys()

    def values(self) -> list[Record]:
        return self.cols.records(list(self.row.values()))

    def records_at(self, hashes: list[bytes]) -> list[Record]:
        """The records of ``hashes`` (each held), in that order, built by C-level maps."""
        return self.cols.records([self.row[h] for h in hashes])

    def items(self) -> list[tuple[bytes, Record]]:
        return list(zip(self.row.keys(), self.values(), strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkPart | dict):
            return list(self.items()) == list(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkPart({dict(self.items())!r})"

    # ------------------------------------------------------------------ writes

    def __setitem__(self, h: bytes, rec: Record) -> None:
        r = self.row.get(h)
        if r is None:
            self.row[h] = self.cols.append(rec)
        else:
            self.cols.put(r, rec)

    def __delitem__(self, h: bytes) -> None:
        self.cols.clear(self.row.pop(h))

    def update(self, records: Iterable[tuple[bytes, Record]]) -> None:
        for h, rec in records:
            self[h] = rec


def new_parts(n: int, parts: Sequence[Mapping[bytes, Record] | ChunkPart] = ()) -> list[ChunkPart]:
    """``n`` empty partitions sharing new columns, or (``parts`` given) holding their records
    (split into the columns by C-level maps)."""
    if _whole(n, parts):  # the partitions of one set of columns (a reader's): adopted
        return list(parts)  # type: ignore[arg-type]
    cols = ChunkColumns()
    out = [ChunkPart(cols) for _ in range(n)]
    for part, records in zip(out, parts, strict=False):
        recs = list(records.values())
        tokens, offsets, indexed, sids, pls, rests = split_columns(recs)
        flagged = (np.asarray(sids, np.int64) << 1) + np.asarray(indexed, np.int64)
        rows = cols.append_rows(tokens, np.asarray(offsets, np.int64), flagged.tolist(), pls, rests)
        cols.l1.extend(np.full(len(rows), NO_OWNER, np.int32))
        deque(map(cols.l1.put, rows, pls, rests), maxlen=0)
        part.row = dict(zip(records.keys(), rows, strict=True))
    return out


def _whole(n: int, parts: Sequence[Mapping[bytes, Record] | ChunkPart]) -> bool:
    first = parts[0] if len(parts) == n else None
    return isinstance(first, ChunkPart) and all(map(is_, first.cols.parts, parts))


def parts_of_columns(
    n: int,
    hashes: list[bytes],
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
    partition ``p`` holds rows ``bounds[p]:bounds[p + 1]``. A restore's path: no record built.
    Change a row's keys afterwards with ``part[h] = rec``."""
    cols = ChunkColumns()
    cols.append_rows(tokens, offsets, flagged, placements, None, bound)
    ids = np.full(len(names) + 1, NO_OWNER, np.int32)  # (-1 takes the last: NO_OWNER)
    for i in np.unique(owners[owners >= 0]).tolist():
        ids[i] = cols.l1.intern(names[i])
    cols.l1.extend(ids[owners])
    out = [ChunkPart(cols) for _ in range(n)]
    for part, lo, hi in zip(out, bounds, bounds[1:], strict=False):
        part.row = dict(zip(hashes[lo:hi], range(lo, hi), strict=True))
    return out


_ROWS_OF = attrgetter("row")


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
    partition; all share one :class:`ChunkColumns`), the hashes distinct, the placements
    one batch's (one instance, tier and sharing: one L1 owner). Inserted where absent, in
    one pass: if a chunk is held, the rows this inserted are taken out again and ``False``
    is returned (nothing changed)."""
    n = len(hashes)
    cols = parts_of[0].cols
    free, top = cols.free, len(cols.offsets)
    k = min(len(free), n)  # free rows first (last freed first), then new ones
    reused = free[len(free) - k :][::-1]
    new: Sequence[int] = range(top, top + n) if not k else [*reused, *range(top, top + n - k)]
    dicts = list(map(_ROWS_OF, parts_of))
    if not all(map(int.__eq__, map(dict.setdefault, dicts, hashes, new), new)):
        deque(map(_take_back, dicts, hashes, new), maxlen=0)
        return False
    owner = l1_owner(placements[0])  # type: ignore[arg-type]
    owner_id = NO_OWNER if owner is None else cols.l1.intern(owner)
    flagged = list(map((2 * sid, 2 * sid + 1).__getitem__, indexed))
    if k:
        del free[len(free) - k :]
        block = _block(tokens[:k], flagged[:k], placements[:k], None)
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


def rows_of(parts: Sequence[ChunkPart], hashes: Iterable[bytes]) -> list[int | None]:
    """The row of each chunk of ``hashes`` (``None``: not held)."""
    return [parts[h[0]].row.get(h) for h in hashes]


def remove_chunks(parts: Sequence[ChunkPart], hashes: list[bytes], rows: list[int]) -> None:
    """``del parts[h[0]][h]`` of each of ``hashes`` (held at ``rows``), rows cleared in bulk."""
    for h in hashes:
        del parts[h[0]].row[h]
    parts[0].cols.clear_rows(rows)


def _take_back(rows: dict[bytes, int], h: bytes, r: int) -> None:
    if rows.get(h) == r:
        del rows[h]


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
        at = part.row
        if at:
            at_rows = np.fromiter(at.values(), np.intp, len(at))
            found = hit[at_rows]
            k = int(np.count_nonzero(found))
            if k:
                hashes += compress(at, found.tolist())
                held += at_rows[found].tolist()
                left -= k
                if not left:
                    break
    return hashes, held
