"""Lists indexed by a content's id (the index's per-id Python objects: the contents): stores
that grow the list to the ids given, appending when they are the next fresh ones in order (a
bulk build), the selection of a batch's items by mask, and the count of each id a batch names
(:func:`tally`)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from itertools import compress, repeat
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

_T = TypeVar("_T")

TALLY_IN_PYTHON = 512
"""Columns shorter than this are tallied in Python: ``np.bincount`` releases the GIL on every
call, and a small batch's settling must not (``tests/directory/test_gil_holding.py``)."""


def put(items: list[Any], where: npt.NDArray[np.int64], values: Iterable[Any]) -> None:
    """``items[where[k]] = values[k]`` for each ``k``, growing ``items`` (with ``None``) to
    the largest index first: new ids are either free ones or the next fresh ones."""
    top = int(where.max()) + 1
    if int(where[0]) == len(items) and top - len(items) == len(where) and _rising(where):
        items += values  # fresh ids in order (a bulk build): append, no per-item store
        return
    if top > len(items):
        items.extend(repeat(None, top - len(items)))
    deque(map(items.__setitem__, where.tolist(), values), 0)


def chosen(items: list[_T], mask: npt.NDArray[np.bool_]) -> list[_T]:
    """``items`` where ``mask`` is set: ``items`` itself when it is set everywhere (an ingest
    batch of new chunks), without a pass over them."""
    return items if mask.all() else list(compress(items, mask.tolist()))


def put_one(items: list[Any], at: int, value: Any) -> None:
    """``items[at] = value``, appending when ``at`` is the next fresh id (see :func:`put`)."""
    if at == len(items):
        items.append(value)
    else:
        items[at] = value


def _rising(where: npt.NDArray[np.int64]) -> bool:
    """Each id above the one before it (with :func:`put`'s other two checks: the next fresh
    ids, in order)."""
    return bool((where[1:] > where[:-1]).all())


def tally(ids: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """Each distinct id of ``ids`` (small and non-negative: namespace ids) and how often it
    occurs, ascending. One id (a batch's usual namespace) is one comparison; a short column
    is counted in Python, a long one by ``np.bincount``."""
    if not len(ids):
        return []
    first = int(ids[0])
    if not bool((ids != first).any()):
        return [(first, len(ids))]
    if len(ids) < TALLY_IN_PYTHON:
        return sorted(Counter(ids.tolist()).items())
    counts = np.bincount(ids)
    present = np.flatnonzero(counts)
    return list(zip(present.tolist(), counts[present].tolist(), strict=True))
