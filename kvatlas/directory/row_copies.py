"""Copies of the chunk columns' rows (:mod:`~kvatlas.directory.chunk_parts`): their fields
gathered by C-level calls, for reads that build no record (a lookup, a capture, a batch's
keys) or build their records all at once."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Final, NamedTuple

import numpy as np

from kvatlas.directory.records import Record, records_from_columns

WIDTH: Final = 4
"""References a row keeps: content, ``2 * shape id + indexed``, the first key's placements,
the other keys."""
_LISTED_ROWS: Final = 16  # rows up to this many are addressed by a list (copy_rows)
_FLAGS: Final = (False, True)


class RowsCopy(NamedTuple):
    """Some rows' fields, copied: their references (``WIDTH`` a row, in order), offsets."""

    refs: Sequence[Any]
    offsets: Sequence[int]

    def fields(self) -> tuple[Sequence[Any], ...]:
        """The rows' references as four columns: contents, ``2 * shape id + indexed`` of the
        first key, its placements, the other keys."""
        return tuple(self.refs[i::WIDTH] for i in range(WIDTH))


def _gather(seq: Sequence[Any], at: list[int]) -> tuple[Any, ...]:
    """``tuple(seq[i] for i in at)`` in one C-level call."""
    return (seq[at[0]],) if len(at) == 1 else itemgetter(*at)(seq)  # type: ignore[no-any-return]


def copy_rows(objs: list[Any], offsets: array[int], rows: list[int]) -> RowsCopy:
    """The fields at ``rows`` of columns ``objs`` and ``offsets`` (two C-level gathers; two
    slices for consecutive rows, what a batch of new chunks is given)."""
    if not rows:
        return RowsCopy((), ())
    first, n = rows[0], len(rows)
    if rows[-1] == first + n - 1 and n > 1 and rows == list(range(first, first + n)):
        refs = objs[WIDTH * first : WIDTH * (first + n)]
        return RowsCopy(refs, offsets[first : first + n].tolist())
    if n <= _LISTED_ROWS:  # a short lookup's (numpy's fixed cost: most of it)
        at = [r + k for r in map(WIDTH.__mul__, rows) for k in range(WIDTH)]
    else:  # one item a row: numpy releases the GIL from 500 items on, which a 2-D
        heads, ats = np.array(rows, np.int64) * WIDTH, np.empty(WIDTH * n, np.int64)
        for k in range(WIDTH):  # broadcast of the fields reached at 125 rows (a long prompt)
            ats[k::WIDTH] = heads + k
        at = ats.tolist()
    return RowsCopy(_gather(objs, at), _gather(offsets, rows))


def copied_records(copy: RowsCopy) -> list[Record]:
    """The records of copied rows (C-level maps; no Python code per record)."""
    refs = copy.refs
    if not refs:
        return []
    flagged = np.array(refs[1::WIDTH], np.int64)
    return records_from_columns(
        refs[0::WIDTH],
        copy.offsets,
        (flagged >> 1).tolist(),
        refs[2::WIDTH],
        map(_FLAGS.__getitem__, (flagged & 1).tolist()),
        refs[3::WIDTH],
    )
