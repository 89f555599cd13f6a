"""Lists indexed by a content's or occupant's id (the index's per-id Python objects): stores
that grow the list to the ids given, appending when they are the next fresh ones in order (a
bulk build), and the selection of a batch's items by mask."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import compress, repeat
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

_T = TypeVar("_T")


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
