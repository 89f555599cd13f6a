"""Which instances own an L1 placement of each chunk: a column of the chunk table's rows
(:class:`~kvatlas.directory.chunk_parts.ChunkColumns`), what fencing an instance visits.

Per row one ``int32``: the interned id of the one instance whose own process memory holds a
copy of the chunk (:func:`~kvatlas.directory.records.l1_owner`), :data:`NO_OWNER` if none, or
:data:`SEVERAL`, then :attr:`L1Owners.several` holds the ids (a chunk two instances hold in
L1: rare). The columns keep it a function of the row's record: every write of a record sets
it, and a freed row has none. 4 bytes a chunk, where a per-instance ``set`` of chunk hashes
took a slot of ≈52 and was a container the cyclic collector walks. Listing one instance's
rows is a pass over the column (fencing is rare). Names are interned while rows have them: a
fence releases its instance's id (:meth:`L1Owners.release`), which the next new name takes, so
instances that come and go (ids assigned per registration) do not pile up.
"""

from __future__ import annotations

from array import array
from collections import deque
from itertools import repeat
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.directory.records import Placements, l1_owners

NO_OWNER: Final = -1
SEVERAL: Final = -2


class L1Owners:
    """The L1 owners of every row of one set of columns."""

    __slots__ = ("_free", "_seen", "_seen_id", "ids", "names", "owner", "several")

    def __init__(self) -> None:
        self.owner = array("i")  # per row: an owner id, NO_OWNER or SEVERAL
        self.several: dict[int, tuple[int, ...]] = {}  # row -> its owners' ids (SEVERAL)
        self.ids: dict[str, int] = {}  # instance name -> id
        self.names: list[str] = []  # id -> instance name ("" for a released id)
        self._free: list[int] = []  # released ids
        # the owner of the last one-key record written with a single placement row: rows are
        # shared by a batch's entries, so a batch's writes compute it once
        self._seen: Placements | None = None
        self._seen_id = NO_OWNER

    def intern(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            if self._free:
                i = self.ids[name] = self._free.pop()
                self.names[i] = name
            else:
                i = self.ids[name] = len(self.names)
                self.names.append(name)
        return i

    def release(self, name: str) -> None:
        """Forget ``name``'s id if no row has it any more (after its fence); the id is
        reused."""
        i = self.ids.get(name)
        if i is None or len(self.rows_of(name)):
            return
        del self.ids[name]
        self.names[i] = ""
        self._free.append(i)
        if self._seen_id == i:  # the one-record cache must not hand the id out again
            self._seen, self._seen_id = None, NO_OWNER

    def of(self, placements: Placements, rest: tuple[Any, ...]) -> int | tuple[int, ...]:
        """The owner id of a record split as ``split_record`` splits it (first key's
        ``placements``, the other keys ``rest``), or its owners' ids if several."""
        if placements is self._seen and not rest:
            return self._seen_id
        names = l1_owners(placements, rest)
        if len(names) > 1:
            return tuple(map(self.intern, names))
        i = self.intern(names[0]) if names else NO_OWNER
        if not rest:
            self._seen, self._seen_id = placements, i
        return i

    def put(self, r: int, placements: Placements, rest: tuple[Any, ...]) -> None:
        """Row ``r`` (existing) now holds a record split into ``placements`` and ``rest``."""
        self.set(r, self.of(placements, rest))

    def add(self, placements: Placements, rest: tuple[Any, ...]) -> None:
        """A new last row, holding a record split into ``placements`` and ``rest``."""
        self.owner.append(NO_OWNER)
        self.set(len(self.owner) - 1, self.of(placements, rest))

    def set(self, r: int, owner: int | tuple[int, ...]) -> None:
        if self.several:
            self.several.pop(r, None)
        if type(owner) is tuple:
            self.several[r] = owner
            self.owner[r] = SEVERAL
        else:
            self.owner[r] = owner  # type: ignore[assignment]

    def extend(self, owners: npt.NDArray[np.int32]) -> None:
        """New last rows with these owner ids (or :data:`NO_OWNER`; none :data:`SEVERAL`)."""
        self.owner.frombytes(np.ascontiguousarray(owners, np.int32).tobytes())

    def fill_rows(self, rows: list[int], owner: int | tuple[int, ...]) -> None:
        """Rows ``rows`` (existing) now have the owner ``owner`` (:meth:`set` of each)."""
        if type(owner) is tuple or (self.several and any(map(self.several.__contains__, rows))):
            deque(map(self.set, rows, repeat(owner)), maxlen=0)
        else:
            self.fill(rows, owner)  # type: ignore[arg-type]

    def fill(self, rows: list[int], owner: int) -> None:
        """Rows ``rows`` (emptied ones: no owners) now have the one owner id ``owner``."""
        if rows:
            np.frombuffer(self.owner, np.int32)[rows] = owner

    def rows_of(self, name: str) -> npt.NDArray[np.intp]:
        """The rows whose chunk has an L1 placement ``name`` owns, ascending."""
        i = self.ids.get(name)
        if i is None:
            return np.empty(0, np.intp)
        hit = np.frombuffer(self.owner, np.int32) == i  # (a copy: the array stays resizable)
        for r, ids in self.several.items():
            if i in ids:
                hit[r] = True
        return np.flatnonzero(hit)

    def owners_at(self, r: int) -> tuple[str, ...]:
        """The names of row ``r``'s L1 owners."""
        i = self.owner[r]
        if i == NO_OWNER:
            return ()
        ids = self.several[r] if i == SEVERAL else (i,)
        return tuple(map(self.names.__getitem__, ids))
