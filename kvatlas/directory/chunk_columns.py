"""The chunk table's rows: every chunk's record fields as columns shared by the partitions
(docs/directory.md, "Records as columns"); the partitions that map hashes to them are
:mod:`~kvatlas.directory.chunk_parts`'.

A record is split into four references per row (content; first key's shape id and indexed
flag as one small ``int``; that key's placements; the other keys) and an ``int64`` offset,
and built again when read. Rows of removed chunks are emptied (references dropped) and
reused, last freed first. Two more columns follow each row: which instances own an L1
placement (:mod:`~kvatlas.directory.l1_owners`, kept by every write) and the chunk's hash
(:class:`~kvatlas.directory.row_maps.RowMaps`, written by the partition's map).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from operator import is_not
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.directory.l1_owners import NO_OWNER, L1Owners
from kvatlas.directory.records import (
    Placements,
    Record,
    join_record,
    other_key,
    split_record,
)
from kvatlas.directory.row_copies import WIDTH, RowsCopy, copied_records, copy_rows
from kvatlas.directory.row_maps import RowMaps
from kvatlas.directory.token_store import StoredTokens

_EMPTY_ROW: Final = (None, 0, None, ())


class ChunkColumns:
    """Every chunk's record fields, by row, for the partitions that share them."""

    __slots__ = ("bound", "free", "l1", "maps", "objs", "offsets", "parts")

    def __init__(self) -> None:
        self.objs: list[Any] = []  # WIDTH per row: content, 2 * shape id + indexed,
        # the first key's placements, the other keys as flat (shape id, placements) pairs
        self.offsets = array("q")  # per row: the content's offset
        self.l1 = L1Owners()  # per row: the instances owning an L1 placement of the chunk
        self.free = array("q")  # rows of removed chunks, reused last freed first (no int each)
        self.parts: list[Any] = []  # the ChunkParts over these rows (chunk_parts.py's)
        self.bound = 0  # rows whose content is known (kept by every write: stats read it)
        self.maps = RowMaps()  # per row its chunk's hash; the partitions' hash → row maps

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
        self.maps.ensure_rows(len(self.offsets))
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
        self.free.extend(rows)

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
        top, n, block = len(self.offsets), len(tokens), block_of(tokens, flagged, placements, rests)
        if self.objs:
            self.objs += block
        else:  # the block is the column (a restore's, 4 refs per chunk: no second copy)
            self.objs = block
        self.bound += known(tokens) if bound is None else bound
        self.offsets.frombytes(np.ascontiguousarray(offsets, "<i8").tobytes())
        self.maps.ensure_rows(top + n)
        return range(top, top + n)


def known(tokens: Sequence[StoredTokens | None]) -> int:
    """How many of ``tokens`` are known contents (``is not None``: ``==`` compares arrays)."""
    return sum(map(is_not, tokens, repeat(None)))


def block_of(
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
