"""One partition of the chunk table: chunk hash → record, with the records kept as columns
(issue 31 item 2, first stage; docs/directory.md, "Records as columns").

A :class:`ChunkPart` reads and writes like the ``dict[bytes, Record]`` it replaces (the
:data:`~kvatlas.directory.chunk_counts.Partition` captures and restores exchange): same keys,
same iteration order (insertion; a replaced record keeps its place), same records. But it keeps
no record tuple and no offset ``int`` per chunk: a record is split into columns at its row
(content, offset, indexed flag, first key's shape id and placements, the other keys) and built
again when read. Per chunk that is the dict slot (hash → row, the row an ``int`` shared by every
partition) and ≈ 37 bytes of columns, where a record tuple (80 B) and its offset (32 B) were.

Rows of removed chunks are left empty (their references dropped) and the partition is
compacted (rows renumbered in place, order kept) once they outnumber the live ones, so a store
appends without looking for a free row, and a batch of new chunks is appended by C-level maps
(:func:`add_fresh`).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.directory.records import Placements, Record, join_record, split_record
from kvatlas.directory.token_store import StoredTokens

_INTS: list[int] = []
"""Row numbers, one ``int`` object each, shared by every partition (rows above 256 would
otherwise be an object per chunk)."""
_FLAGS: Final = (False, True)


def _rows_upto(n: int) -> list[int]:
    if len(_INTS) < n:
        _INTS.extend(range(len(_INTS), max(n, 2 * len(_INTS), 1024)))
    return _INTS


class ChunkPart:
    """One partition's records as columns, read and written as a ``dict[bytes, Record]``."""

    __slots__ = ("_holes", "_nums", "_objs", "_row")

    def __init__(self, records: Iterable[tuple[bytes, Record]] = ()) -> None:
        self._row: dict[bytes, int] = {}
        self._objs: list[Any] = []  # per row: stored tokens, first key's placements, the rest
        self._nums = array("q")  # per row: offset, first key's shape id * 2 + indexed
        self._holes = 0  # rows of removed chunks
        self.update(records)

    @classmethod
    def of(cls, part: Mapping[bytes, Record] | ChunkPart) -> ChunkPart:
        """``part`` itself, or a partition holding the records of a ``dict``."""
        return part if isinstance(part, ChunkPart) else cls(part.items())

    # ------------------------------------------------------------------ reads

    def _record(self, r: int) -> Record:
        o, n = 3 * r, 2 * r
        objs, nums = self._objs, self._nums
        x = nums[n + 1]
        return join_record(objs[o], nums[n], _FLAGS[x & 1], x >> 1, objs[o + 1], objs[o + 2])

    def get(self, h: bytes, default: Record | None = None) -> Record | None:
        r = self._row.get(h)
        return default if r is None else self._record(r)

    def __getitem__(self, h: bytes) -> Record:
        return self._record(self._row[h])

    def __contains__(self, h: object) -> bool:
        return h in self._row

    def __len__(self) -> int:
        return len(self._row)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._row)

    def keys(self) -> Iterable[bytes]:
        return self._row.keys()

    def values(self) -> list[Record]:
        return list(map(self._record, self._row.values()))

    def items(self) -> list[tuple[bytes, Record]]:
        return list(zip(self._row.keys(), self.values(), strict=True))

    def bound_count(self) -> int:
        """How many chunks have known content (no record built)."""
        unbound = sum(map(is_, self._objs[::3], repeat(None)))  # (== would compare arrays)
        return len(self._row) - (unbound - self._holes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkPart | dict):
            return list(self.items()) == list(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkPart({dict(self.items())!r})"

    # ------------------------------------------------------------------ writes

    def __setitem__(self, h: bytes, rec: Record) -> None:
        tokens, offset, indexed, sid, pls, rest = split_record(rec)
        r = self._row.get(h)
        if r is None:
            r = len(self._nums) >> 1
            self._row[h] = _rows_upto(r + 1)[r]
            self._objs += (tokens, pls, rest)
            self._nums += array("q", (offset, 2 * sid + indexed))
        else:
            o, n = 3 * r, 2 * r
            self._objs[o : o + 3] = (tokens, pls, rest)
            self._nums[n] = offset
            self._nums[n + 1] = 2 * sid + indexed

    def __delitem__(self, h: bytes) -> None:
        r = self._row.pop(h)
        self._objs[3 * r : 3 * r + 3] = _NONES
        self._holes += 1
        if self._holes > len(self._row) + 64:
            self._compact()

    def update(self, records: Iterable[tuple[bytes, Record]]) -> None:
        for h, rec in records:
            self[h] = rec

    def _compact(self) -> None:
        """Renumber the live rows 0.. in their order (the dict's order is kept: values only)."""
        rows = list(self._row.values())
        objs, nums = self._objs, self._nums
        self._objs = [objs[3 * r + k] for r in rows for k in range(3)]
        self._nums = array("q", [nums[2 * r + k] for r in rows for k in range(2)])
        self._row = dict(zip(self._row, _rows_upto(len(rows)), strict=False))
        self._holes = 0


_NONES: Final = (None, None, ())
_ROWS_OF = attrgetter("_row")
_OBJS_OF = attrgetter("_objs")
_NUMS_OF = attrgetter("_nums")


def add_fresh(
    parts_of: Sequence[ChunkPart],
    hashes: Sequence[bytes],
    tokens: Sequence[StoredTokens | None],
    offsets: Sequence[int],
    indexed: Sequence[bool],
    sid: int,
    placements: Sequence[Placements],
) -> bool:
    """Append one-key records of new chunks, entry ``i`` to ``parts_of[i]`` (its partition);
    the hashes distinct. Inserted where absent, in one pass: if a chunk is held, the rows
    this inserted are taken out again and ``False`` is returned (nothing changed)."""
    n = len(hashes)
    by = np.frombuffer(bytes(map(_FIRST, hashes)), np.uint8)
    order = np.argsort(by, kind="stable")
    ranked = by[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    runs = np.diff(np.r_[starts, n])
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n) - np.repeat(starts, runs)
    base = np.fromiter(map(len, map(_NUMS_OF, parts_of)), np.int64, n) >> 1
    rows = rank + base
    ints = _rows_upto(int(rows.max()) + 1)
    new = list(map(ints.__getitem__, rows.tolist()))
    dicts = list(map(_ROWS_OF, parts_of))
    if not all(map(is_, map(dict.setdefault, dicts, hashes, new), new)):
        deque(map(_take_back, dicts, hashes, new), maxlen=0)
        return False
    deque(map(list.extend, map(_OBJS_OF, parts_of), zip(tokens, placements, repeat(()))), 0)
    two = np.empty((n, 2), np.int64)
    two[:, 0] = offsets
    two[:, 1] = np.asarray(indexed, np.int64) + 2 * sid
    deque(map(array.frombytes, map(_NUMS_OF, parts_of), _rows_of_bytes(two)), maxlen=0)
    return True


def _rows_of_bytes(two: npt.NDArray[np.int64]) -> list[bytes]:
    raw = two.tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def _take_back(rows: dict[bytes, int], h: bytes, r: int) -> None:
    if rows.get(h) is r:
        del rows[h]


_FIRST = itemgetter(0)
