"""Token pool: the contents of new chunks, copied into shared slabs instead of an array each.

Why: the directory grows by what it ingests, so a content of its own per chunk (≈0.5–1 KB) is
fresh memory, and each first touch of a fresh page a fault (≈0.4–0.8 faults an ingested entry,
≈2 µs of kernel time each on these VMs). The pool copies a store batch's contents into the
current :class:`~kvatlas.directory.token_store.TokenSlab` (:data:`SLAB_BYTES`, its pages
populated by the kernel in one call: measured ≈30% less kernel time a page than faulting them
one by one; huge pages were measured and left out, see ``token_store._zeroed``) and hands each
out as a read-only view of it: one compiled pass (which rows fit ``uint16``, then the copies)
and one view per chunk, cut in bulk, no allocation per chunk.

Views of a slab are the concept a restore already uses: the chunk table frees a slab once
more than half of its views are gone (``chunk_slabs.SlabReclaim``), except the slab the pool
is filling. Only chunks the table does not hold yet take pool space: a re-reported content is
usually equal to the bound one and dropped at once, which would leave dead views behind; those
get an array of their own (``token_store.stored_from_arena`` / ``stored_batch``), as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from itertools import pairwise, repeat
from operator import is_not
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend._cpython import ARRAY_DATA_OFFSET, array_handles
from kvatlas.directory.token_store import (
    DTYPE_OF,
    STRIDES_OF,
    StoredTokens,
    TokenSlab,
    arena_rows,
    check_rows,
    copy_rows,
    rows_fit,
    stored_batch,
    stored_from_arena,
)
from kvatlas.events.columns import EntryColumns
from kvatlas.keys.tokens import TokenArray

SLAB_BYTES = 4 << 20
"""The largest pool slab (a batch larger than that gets a slab of its own size)."""
MIN_SLAB_BYTES = 256 << 10
"""The smallest: a new slab is an eighth of the slabs held (between the two), so the one being
filled wastes at most ≈1/8 of the pooled bytes in a small directory, and big directories
have few slabs to look after."""
_PAGE = 4096

_PRESENT = partial(is_not, None)  # an entry's tokens, not None (C-level in a filter)
_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)


class TokenPool:
    """Where a chunk table's new contents go: the slab being filled and how much of it is used.
    Every slab it makes is appended to ``slabs`` (the chunk table's, which frees them)."""

    __slots__ = ("slab", "slab_bytes", "slabs", "used")

    def __init__(self, slabs: list[TokenSlab], slab_bytes: int | None = None) -> None:
        self.slabs = slabs
        self.slab_bytes = slab_bytes
        """Every new slab's size (at least); ``None``: sized by what is held (see
        :data:`MIN_SLAB_BYTES`)."""
        self.slab: TokenSlab | None = None
        self.used = 0

    def _new_slab(self, needed: int) -> TokenSlab:
        """A new slab to fill, of at least ``needed`` bytes, appended to :attr:`slabs`."""
        size = self.slab_bytes
        if size is None:
            held = sum(len(s.buffer) for s in self.slabs)  # (once per new slab)
            size = min(SLAB_BYTES, max(MIN_SLAB_BYTES, held // 8, needed))
            size = -(-size // _PAGE) * _PAGE  # whole pages: what is mapped is counted
        slab = TokenSlab.pooled(max(size, needed))
        self.slabs.append(slab)
        self.slab = slab
        return slab

    def stored_columns(
        self, cols: EntryColumns, held: Sequence[bool] | None = None
    ) -> tuple[list[StoredTokens | None], bool]:
        """Each entry's tokens of a store batch, stored (``None``: no tokens), and whether every
        array was made here (read-only, C-contiguous, chunk contents the index may keep as
        they are: its adds are vouched for). Entries whose chunk the table holds (``held``)
        get arrays of their own; the others views of the pool. Entries of one content share
        one stored array (one input array, or one row of the arena)."""
        if cols.token_objects is None and not cols.rows_shared():
            arena = np.ascontiguousarray(cols.tokens, dtype=np.uint32)
            starts, lengths = cols.token_starts, cols.token_lengths
            check_rows(arena, starts, lengths)
            if held is None:
                return self.rows(arena_rows(arena, starts), -1, lengths), True
            at = np.flatnonzero(held)
            out = self.rows(arena_rows(arena, starts), -1, _without(lengths, at))
            own = stored_from_arena(arena, starts[at], lengths[at])
            for i, stored in zip(at.tolist(), own, strict=True):
                out[i] = stored
            return out, True
        arrays = cols.token_arrays()
        srcs: list[TokenArray] = list(filter(_PRESENT, arrays))  # type: ignore[arg-type]
        distinct = dict(zip(map(id, srcs), srcs, strict=True))
        if len(distinct) != len(srcs):
            srcs = list(distinct.values())
        if (
            held is not None
            or set(map(DTYPE_OF, srcs)) - {_U32}
            or set(map(STRIDES_OF, srcs)) - {(4,)}
        ):
            return stored_batch(arrays), False  # uncommon inputs, or chunks held already
        lens = np.fromiter(map(len, srcs), np.int64, len(srcs))
        handles = np.array(array_handles(srcs), np.int64)
        outs = self.rows(handles, ARRAY_DATA_OFFSET, lens)
        if len(srcs) == len(arrays):  # no None, no shared input: entry for entry
            return outs, True
        by_id = dict(zip(distinct, outs, strict=True))
        return [None if a is None else by_id[id(a)] for a in arrays], True

    def rows(
        self, src: npt.NDArray[np.int64], src_off: int, lens: npt.NDArray[np.int64]
    ) -> list[StoredTokens | None]:
        """Row ``j`` (``lens[j]`` ``uint32`` ids at ``src[j]``, read as the row kernels read
        it with ``src_off``; length 0: ``None``) as a read-only view of a pool slab, at the
        width it needs. Rows are laid out one after another, each 4-byte aligned; what does
        not fit the current slab starts a new one."""
        n = len(lens)
        fits = np.empty(n, np.bool_)
        rows_fit(src, src_off, lens, fits)
        widths = np.where(fits, 2, 4)
        sizes = (lens * widths + 3) & ~3
        ends = np.cumsum(sizes)
        total = int(ends[-1]) if n else 0
        if not total:
            return [None] * n
        slab, used = self.slab, self.used
        if slab is None:
            k = 0
        else:  # the rows [0, k) fit the current slab
            room = len(slab.buffer) - used
            k = n if total <= room else int(np.searchsorted(ends, room, "right"))
        dst = ends - sizes  # each row's offset from the batch's start
        pieces = []
        if k:
            assert slab is not None  # (mypy)
            dst[:k] += slab.buffer.ctypes.data + used
            pieces.append((slab, used, 0, k))
            used += int(ends[k - 1])
        if k < n:
            first = int(dst[k])
            slab = self._new_slab(total - first)
            dst[k:] += slab.buffer.ctypes.data - first
            pieces.append((slab, 0, k, n))
            used = total - first
        self.used = used
        dst[lens == 0] = 0
        copy_rows(src, src_off, lens, dst, -1, fits)
        out: list[StoredTokens | None] = []
        for piece_slab, at, lo, hi in pieces:
            out += _views(piece_slab, at, lens[lo:hi], widths[lo:hi], sizes[lo:hi])
        return out


def _views(
    slab: TokenSlab,
    at: int,
    lens: npt.NDArray[np.int64],
    widths: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
) -> list[Any]:
    """Read-only views of rows laid out from byte ``at`` of ``slab`` (``sizes[i]`` bytes each,
    ``lens[i]`` ids of ``widths[i]`` bytes; length 0: ``None``): one 2-D view per run of rows
    of one shape, cut into rows in bulk; counted in the slab's views."""
    n = len(lens)
    change = (lens[1:] != lens[:-1]) | (widths[1:] != widths[:-1])
    firsts = [0, *(np.flatnonzero(change) + 1).tolist(), n]
    starts = (np.cumsum(sizes) - sizes + at).tolist()
    out: list[Any] = []
    block: Any = None
    for lo, hi in pairwise(firsts):
        length, width, step = int(lens[lo]), int(widths[lo]), int(sizes[lo])
        if not length:
            out += repeat(None, hi - lo)
            continue
        start = starts[lo]
        block = slab.buffer[start : start + (hi - lo) * step]
        block = block.view(_U16 if width == 2 else _U32).reshape(hi - lo, step // width)
        out.extend(block if step == length * width else block[:, :length])
        slab.views += hi - lo
    del block
    return out


def _without(lengths: npt.NDArray[np.int64], at: npt.NDArray[np.intp]) -> npt.NDArray[np.int64]:
    """``lengths`` with the rows ``at`` emptied (no pool space for them)."""
    out = lengths.copy()
    out[at] = 0
    return out
