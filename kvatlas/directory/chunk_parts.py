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
from operator import attrgetter, iadd, is_
from typing import Any, Final

import numpy as np

from kvatlas.directory.records import Placements, Record, join_record, split_record
from kvatlas.directory.token_store import StoredTokens

_INTS: list[int] = []
"""Row numbers, one ``int`` object each, shared by every partition (rows above 256 would
otherwise be an object per chunk)."""


def _rows_upto(n: int) -> list[int]:
    if len(_INTS) < n:
        _INTS.extend(range(len(_INTS), max(n, 2 * len(_INTS), 1024)))
    return _INTS


class ChunkPart:
    """One partition's records as columns, read and written as a ``dict[bytes, Record]``."""

    __slots__ = ("_holes", "_objs", "_offsets", "_row")

    def __init__(self, records: Iterable[tuple[bytes, Record]] = ()) -> None:
        self._row: dict[bytes, int] = {}
        self._objs: list[Any] = []  # _WIDTH per row: content, 2 * shape id + indexed,
        # the first key's placements, the other keys
        self._offsets = array("q")  # per row: the content's offset
        self._holes = 0  # rows of removed chunks
        self.update(records)

    @classmethod
    def of(cls, part: Mapping[bytes, Record] | ChunkPart) -> ChunkPart:
        """``part`` itself, or a partition holding the records of a ``dict``."""
        return part if isinstance(part, ChunkPart) else cls(part.items())

    # ------------------------------------------------------------------ reads

    def _record(self, r: int) -> Record:
        o = _WIDTH * r
        objs = self._objs
        sid = objs[o + 1]
        return join_record(objs[o], self._offsets[r], sid & 1 == 1, sid >> 1, *objs[o + 2 : o + 4])

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
        unbound = sum(map(is_, self._objs[::_WIDTH], repeat(None)))  # (== would compare arrays)
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
        flagged = _rows_upto(2 * sid + 2)[2 * sid + indexed]
        if r is None:
            r = len(self._offsets)
            self._row[h] = _rows_upto(r + 1)[r]
            self._objs += (tokens, flagged, pls, rest)
            self._offsets.append(offset)
        else:
            o = _WIDTH * r
            self._objs[o : o + _WIDTH] = (tokens, flagged, pls, rest)
            self._offsets[r] = offset

    def __delitem__(self, h: bytes) -> None:
        r = self._row.pop(h)
        self._objs[_WIDTH * r : _WIDTH * (r + 1)] = _EMPTY_ROW
        self._holes += 1
        if self._holes > len(self._row) + 64:
            self._compact()

    def update(self, records: Iterable[tuple[bytes, Record]]) -> None:
        for h, rec in records:
            self[h] = rec

    def _compact(self) -> None:
        """Renumber the live rows 0.. in their order (the dict's order is kept: values only)."""
        rows = list(self._row.values())
        objs = self._objs
        self._objs = [objs[_WIDTH * r + k] for r in rows for k in range(_WIDTH)]
        self._offsets = array("q", map(self._offsets.__getitem__, rows))
        self._row = dict(zip(self._row, _rows_upto(len(rows)), strict=False))
        self._holes = 0

    def _drop_last(self, n: int) -> None:
        """Take back the last ``n`` rows (added by :func:`add_fresh`, not in the dict)."""
        del self._objs[len(self._objs) - _WIDTH * n :]
        del self._offsets[len(self._offsets) - n :]


_WIDTH: Final = 4
_EMPTY_ROW: Final = (None, 0, None, ())
_ROWS_OF = attrgetter("_row")
_OBJS_OF = attrgetter("_objs")
_OFFSETS_OF = attrgetter("_offsets")


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
    ints = _rows_upto(max(2 * sid + 2, 1024))
    flagged = map((ints[2 * sid], ints[2 * sid + 1]).__getitem__, indexed)
    # appended first: each partition's row count right after the append gives the row
    grown = map(iadd, map(_OBJS_OF, parts_of), zip(tokens, flagged, placements, repeat(())))
    ends = np.fromiter(map(len, grown), np.int64, n)
    deque(map(array.append, map(_OFFSETS_OF, parts_of), offsets), maxlen=0)
    rows = (ends // _WIDTH - 1).tolist()
    new = list(map(_rows_upto(max(rows) + 1).__getitem__, rows))  # (shared ints)
    dicts = list(map(_ROWS_OF, parts_of))
    if all(map(is_, map(dict.setdefault, dicts, hashes, new), new)):
        return True
    deque(map(_take_back, dicts, hashes, new), maxlen=0)
    for part in parts_of:
        part._drop_last(1)
    return False


def _take_back(rows: dict[bytes, int], h: bytes, r: int) -> None:
    if rows.get(h) is r:
        del rows[h]
