"""Token slabs: restored chunk contents as read-only views of one buffer.

A restore reads a snapshot's token section into one :class:`TokenSlab` (an anonymous mapping,
filled by the snapshot reader) and cuts each chunk's content as a view of it, in the stored
forms of :mod:`kvatlas.directory.token_store`; the buffer is shared with the blend index
(``blend.share_slab``). A slab is freed once its views are gone; once more than half are
(:meth:`TokenSlab.mostly_dead`), the chunk table (:mod:`~kvatlas.directory.chunk_slabs`) and
``BlendIndex.copy_out`` copy the live contents out, so a slab holds at most as many dead
contents as live ones.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from collections.abc import Callable
from itertools import pairwise, repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import share_slab
from kvatlas.directory.blend.kernels.planes import FORM_U16, FORM_U32, stored_nbytes
from kvatlas.directory.token_store import FORM_DTYPES, form_sizes, owned_copy

_ANONYMOUS: int = getattr(mmap, "MAP_ANONYMOUS", 0)


class TokenSlab:
    """Restored token ids in one buffer, each chunk's content a read-only view of it.

    Each view holds one reference to :attr:`buffer`, so its reference count says how many are
    alive (:meth:`live`) without any bookkeeping where chunks are removed or rebound."""

    __slots__ = ("_other_refs", "buffer", "views")

    def __init__(self, nbytes: int) -> None:
        self.buffer: npt.NDArray[np.uint8] = _zeroed(nbytes)
        """Filled by the caller (little-endian ids), then cut once (:meth:`cut`)."""
        self.views = 0
        self._other_refs = 0

    def mapped_memory(self) -> memoryview | None:
        """The slab's bytes, writable, through its mapping: a view that holds no reference to
        :attr:`buffer` (whose reference count :meth:`cut` reads), so another thread may fill
        the slab through it while the views are cut (``None``: no mapping; fill
        :attr:`buffer` before cutting)."""
        base = self.buffer.base  # numpy keeps a memoryview of the mapping
        mapping = base.obj if isinstance(base, memoryview) else base
        return memoryview(mapping) if isinstance(mapping, mmap.mmap) else None

    def cut(
        self,
        lens: npt.NDArray[Any],
        forms: npt.NDArray[np.int64],
        filled: Callable[[], object] | None = None,
    ) -> list[Any]:
        """Each chunk's content (``lens[i]`` ids in form ``forms[i]``, ``planes.FORM_*``, one
        after another in the buffer; length 0: ``None``): a read-only view per run of chunks
        of one shape, in bulk; a content whose start is not aligned for its form gets a copy
        of its own. The buffer becomes read-only and shareable with the blend index. Views
        need no ids yet; copies do: ``filled``, if given (another thread is still filling the
        buffer), is called before the first copy and returns once every id is in."""
        sizes = form_sizes(lens, forms)
        ends = np.cumsum(sizes)
        if (int(ends[-1]) if len(ends) else 0) != len(self.buffer):
            raise ValueError("token rows do not fill the slab")
        if not len(lens):
            self._other_refs = sys.getrefcount(self.buffer)
            return []
        change = (lens[1:] != lens[:-1]) | (forms[1:] != forms[:-1])
        firsts = np.concatenate(([0], np.flatnonzero(change) + 1))
        runs = list(pairwise([*firsts.tolist(), len(lens)]))
        starts = (ends - sizes)[firsts].tolist()  # the byte offset of each run
        if sys.byteorder != "little":  # pragma: no cover - the section is little-endian
            for (lo, hi), at in zip(runs, starts, strict=True):
                if lens[lo] and forms[lo] in (FORM_U16, FORM_U32):
                    dtype = FORM_DTYPES[int(forms[lo])]
                    self.buffer[at : int(ends[hi - 1])].view(dtype).byteswap(inplace=True)
                elif lens[lo]:
                    raise ValueError("planes-form tokens are read on little-endian hosts only")
        self.buffer = _sealed(self.buffer)
        out: list[Any] = []
        views = 0
        rows: Any = None
        for (lo, hi), at in zip(runs, starts, strict=True):
            length, form = int(lens[lo]), int(forms[lo])
            if not length:
                out += repeat(None, hi - lo)
                continue
            size = stored_nbytes(length, form)
            dtype = FORM_DTYPES[form]
            rows = self.buffer[at : at + (hi - lo) * size].view(dtype)
            rows = rows.reshape(hi - lo, size // dtype.itemsize)
            if at % (4 if form == FORM_U32 else 2):
                if filled is not None:
                    filled()
                    filled = None
                out.extend(map(owned_copy, rows))
            else:
                out.extend(rows)
                views += hi - lo
        del rows
        self.views = views
        self._other_refs = sys.getrefcount(self.buffer) - views
        if views:
            share_slab(self.buffer)
        return out

    def live(self) -> int:
        """How many of its views are alive (in records, the index, or anywhere else)."""
        return sys.getrefcount(self.buffer) - self._other_refs

    def mostly_dead(self) -> bool:
        """Whether more than half of its views are gone: time to copy the rest out."""
        return 2 * self.live() < self.views


def _zeroed(nbytes: int) -> npt.NDArray[np.uint8]:
    """A fresh buffer of ``nbytes``: an anonymous mapping of small pages, faulted in by
    whatever writes them first (the snapshot reader's read, on a thread of its own: no page
    is touched here, so cutting views can start at once). Not numpy's own large arrays: they
    ask for huge pages, whose first allocation in a process can stall for a second while the
    kernel compacts memory (and on these VMs a fresh huge page often costs more than its 512
    small ones: docs/performance.md). Traced by ``tracemalloc`` as numpy's own memory is, so
    memory measurements see it."""
    if not (nbytes and _ANONYMOUS):
        return np.empty(nbytes, np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANONYMOUS)
    buffer = np.frombuffer(mapping, np.uint8)
    address = buffer.ctypes.data
    if _track(_TRACE_DOMAIN, address, nbytes) == 0:  # tracing: forget it when it is freed
        weakref.finalize(mapping, _untrack, _TRACE_DOMAIN, address)
    return buffer


_TRACE_DOMAIN = 0x6B76  # the tracemalloc domain of token slabs ("kv")
_track = ctypes.pythonapi.PyTraceMalloc_Track
_track.argtypes, _track.restype = [ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t], ctypes.c_int
_untrack = ctypes.pythonapi.PyTraceMalloc_Untrack
_untrack.argtypes, _untrack.restype = [ctypes.c_uint, ctypes.c_size_t], ctypes.c_int


def _sealed(buffer: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """``buffer``'s bytes as an array that nobody can make writable, nor any view of it.
    numpy lets a view be flipped back to writable when its final base (here the mapping)
    hands out a writable buffer, whatever the flags of the arrays in between, so a mapped
    buffer is re-read through a read-only ``memoryview`` of its mapping (a reader who
    flipped a content's view could change what the index and every lookup see)."""
    base = buffer.base
    mapping = base.obj if isinstance(base, memoryview) else base
    if isinstance(mapping, mmap.mmap):
        return np.frombuffer(memoryview(mapping).toreadonly(), np.uint8)
    buffer.flags.writeable = False  # owns its memory: its views cannot be made writable
    return buffer
