"""Token storage: how the directory keeps a chunk's token ids — compactly, exactly.

A chunk's content is kept as a read-only array that owns its memory: ``uint16`` when every id
of the chunk is below 2^16 (vocabularies up to 65,536 tokens: half the bytes of the ``uint32``
the wire carries, and token bytes are most of a directory's memory), else ``uint32``. The
choice is made per chunk and is never a truncation: one id that does not fit keeps the whole
chunk at ``uint32``. Either way the array holds the same ids; :func:`widened` gives the
``uint32`` array that public values (lookups, listings) carry. The blend index reads both
widths through the array's data pointer (``blend/kernels/layout.py``).

Entries of one content (the ranks of a chunk) usually share one input array: they get one
stored array, so the directory's "same object, same content" shortcut keeps working. The
narrowing itself is one compiled pass per batch (a numpy call per chunk would cost more than
the rest of consuming it).

Restored contents are not allocated one by one: a snapshot's token section is read into one
:class:`TokenSlab` and each chunk's content is a read-only view of it (creating views in bulk
costs a quarter of allocating and filling an array per chunk). The blend index shares those views
(``blend.share_slab``). A slab is freed once its views are gone; so that dead chunks do not keep
it forever, the chunk table copies the live contents out to arrays of their own once more than
half of its views are gone (:meth:`TokenSlab.mostly_dead`; ``ChunkTable`` reclaim, and
``BlendIndex.copy_out`` for contents the index keeps), so a slab holds at most as many dead
contents as live ones.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise, repeat
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import share_slab
from kvatlas.directory.blend._cpython import ARRAY_DATA_OFFSET, array_handles
from kvatlas.directory.blend.kernels.pointers import i64_ptr, jit, u16_ptr, u32_ptr
from kvatlas.events.columns import EntryColumns
from kvatlas.keys.tokens import TokenArray

StoredTokens = npt.NDArray[np.unsignedinteger[Any]]
"""A chunk's content as the directory keeps it: read-only ``uint16`` or ``uint32``."""
COMPACT_LIMIT = 1 << 16
"""Ids below this fit the compact (``uint16``) form."""

_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)
_ANONYMOUS: int = getattr(mmap, "MAP_ANONYMOUS", 0)
_WIDTHS = (_U32, _U16)  # by "every id fits"
_SET_FLAGS: Callable[[StoredTokens, bool], None] = np.ndarray.setflags  # type: ignore[assignment]
"""``setflags(write)``: numpy takes the flag positionally (its stubs say keyword-only)."""
_DTYPE = attrgetter("dtype")
_STRIDES = attrgetter("strides")


def read_only(arrays: list[StoredTokens]) -> None:
    """Make every array read-only: ``setflags(False)`` by a C-level map (the unbound method
    with a positional flag, not ``methodcaller("setflags", write=False)``: no keyword call per
    array)."""
    deque(map(_SET_FLAGS, arrays, repeat(False)), maxlen=0)


def widened(stored: StoredTokens) -> TokenArray:
    """The ids of ``stored`` as a read-only ``uint32`` array (``stored`` itself if it is one)."""
    if stored.dtype is _U32:
        return stored  # type: ignore[return-value]
    out = stored.astype(np.uint32)
    out.flags.writeable = False
    return out


def stored_one(tokens: npt.NDArray[Any]) -> StoredTokens:
    """``tokens`` (validated ids) in stored form: a compact copy if every id fits, else the
    array itself when it is a read-only, C-contiguous ``uint32`` array (kept as the directory
    always kept contents), else a ``uint32`` copy of it."""
    if tokens.dtype is _U16 and not tokens.flags.writeable and tokens.flags.owndata:
        return tokens
    if len(tokens) == 0 or int(tokens.max()) < COMPACT_LIMIT:
        out = np.array(tokens, dtype=np.uint16, order="C", copy=True)
    elif tokens.dtype is _U32 and not tokens.flags.writeable and tokens.flags.c_contiguous:
        return tokens
    else:
        out = np.array(tokens, dtype=np.uint32, order="C", copy=True)
    out.flags.writeable = False
    return out


def owned_copy(stored: StoredTokens) -> StoredTokens:
    """``stored`` as a read-only array of its own (same ids, same width)."""
    out = np.array(stored, dtype=stored.dtype, order="C", copy=True)
    out.flags.writeable = False
    return out


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
        widths: npt.NDArray[np.int64],
        filled: Callable[[], object] | None = None,
    ) -> list[Any]:
        """Each chunk's content (``lens[i]`` ids of ``widths[i]`` bytes, one after another in
        the buffer; length 0: ``None``): a read-only view per run of chunks of one shape, in
        bulk; a content whose start is not aligned to its width gets a copy of its own. The
        buffer becomes read-only and shareable with the blend index. Views need no ids yet;
        copies do: ``filled``, if given (another thread is still filling the buffer), is
        called before the first copy and returns once every id is in."""
        sizes = lens.astype(np.int64) * widths
        ends = np.cumsum(sizes)
        if (int(ends[-1]) if len(ends) else 0) != len(self.buffer):
            raise ValueError("token rows do not fill the slab")
        if not len(lens):
            self._other_refs = sys.getrefcount(self.buffer)
            return []
        change = (lens[1:] != lens[:-1]) | (widths[1:] != widths[:-1])
        firsts = np.concatenate(([0], np.flatnonzero(change) + 1))
        runs = list(pairwise([*firsts.tolist(), len(lens)]))
        starts = (ends - sizes)[firsts].tolist()  # the byte offset of each run
        if sys.byteorder != "little":  # pragma: no cover - the section is little-endian
            for (lo, hi), at in zip(runs, starts, strict=True):
                if lens[lo] and widths[lo] > 1:
                    dtype = _U16 if widths[lo] == 2 else _U32
                    self.buffer[at : int(ends[hi - 1])].view(dtype).byteswap(inplace=True)
        self.buffer = _sealed(self.buffer)
        out: list[Any] = []
        views = 0
        rows: Any = None
        for (lo, hi), at in zip(runs, starts, strict=True):
            length, width = int(lens[lo]), int(widths[lo])
            if not length:
                out += repeat(None, hi - lo)
                continue
            rows = self.buffer[at : at + (hi - lo) * length * width]
            rows = rows.view(_U16 if width == 2 else _U32).reshape(hi - lo, length)
            if at % width:
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


def stored_batch(arrays: Sequence[TokenArray | None]) -> list[StoredTokens | None]:
    """:func:`stored_one` of each array (``None`` stays ``None``), one compiled pass for the
    batch; entries that share an input array share its stored array. (Per entry this is an
    allocation and a flag: the checks run as C-level maps, not as Python code per entry.)"""
    return _stored_batch(arrays)[0]


def _stored_batch(arrays: Sequence[TokenArray | None]) -> tuple[list[StoredTokens | None], bool]:
    """:func:`stored_batch`, and whether every stored array was allocated here (every
    content fit ``uint16``: no caller's array kept)."""
    srcs = [a for a in arrays if a is not None]
    ids = list(map(id, srcs))
    distinct = dict(zip(ids, srcs, strict=True))
    if len(distinct) != len(srcs):
        srcs = list(distinct.values())
    if not srcs:
        return list(arrays), True
    if set(map(_DTYPE, srcs)) != {_U32} or set(map(_STRIDES, srcs)) != {(4,)}:
        stored = {key: stored_one(a) for key, a in distinct.items()}  # uncommon inputs
        return [None if a is None else stored[id(a)] for a in arrays], False
    lens = list(map(len, srcs))
    outs: list[StoredTokens] = list(map(np.empty, lens, repeat(_U16)))
    fits = np.empty(len(srcs), np.bool_)
    _narrow_arrays(
        np.array(array_handles(srcs), np.int64),
        np.array(lens, np.int64),
        np.array(array_handles(outs), np.int64),
        ARRAY_DATA_OFFSET,
        fits,
    )
    read_only(outs)
    allocated = bool(fits.all())
    if not allocated:
        for i in np.flatnonzero(~fits).tolist():
            outs[i] = stored_one(srcs[i])
    if len(outs) == len(arrays):  # no None, no shared input: entry for entry
        return outs, allocated  # type: ignore[return-value]
    by_id = dict(zip(distinct, outs, strict=True))
    return [None if a is None else by_id[id(a)] for a in arrays], allocated


def stored_from_arena(
    arena: TokenArray, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> list[StoredTokens | None]:
    """Stored arrays of ``arena[starts[j]:starts[j] + lengths[j]]`` (length 0: ``None``), each
    owning its memory (never a view that would pin the arena): two compiled passes for all
    (which rows fit ``uint16``, then the copies into arrays of the width each needs)."""
    arena = np.ascontiguousarray(arena, dtype=np.uint32)
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    lens = lengths.tolist()
    if len(starts) != len(lens) or (
        len(lens)
        and (min(lens) < 0 or int(starts.min()) < 0 or int((starts + lengths).max()) > len(arena))
    ):
        raise ValueError("token rows outside the arena")
    fits = np.empty(len(lens), np.bool_)
    _rows_fit(arena, starts, lengths, fits)
    # each row's array at its stored width, allocated by C-level maps (no Python per row)
    every = not lens or min(lens) > 0  # no empty row (the usual batch): no mask, no None
    present: list[StoredTokens] = list(
        map(
            np.empty,
            lens if every else filter(None, lens),
            _widths(fits if every else fits[lengths > 0]),
        )
    )
    if every:
        handles = np.array(array_handles(present), np.int64)
    else:
        handles = np.zeros(len(lens), np.int64)  # 0: an empty row, nothing to write
        handles[lengths > 0] = array_handles(present)
    _copy_rows(arena, starts, lengths, handles, ARRAY_DATA_OFFSET, fits)
    read_only(present)
    if every:
        return present  # type: ignore[return-value]
    it = iter(present)
    return [next(it) if n else None for n in lens]


def _widths(fits: npt.NDArray[np.bool_]) -> Iterable[np.dtype[Any]]:
    """The stored dtype of each row by whether it fits ``uint16`` (one repeated dtype when
    all rows agree: no per-row lookup)."""
    if fits.all():
        return repeat(_U16)
    if not fits.any():
        return repeat(_U32)
    return map(_WIDTHS.__getitem__, fits.tolist())


def stored_columns(cols: EntryColumns) -> tuple[list[StoredTokens | None], bool]:
    """Each entry's tokens of a columnar batch, stored, and whether every array was allocated
    here (read-only, owning its memory, C-contiguous): straight from the batch's arena when no
    two entries share a row (the usual body; a token-less entry has no row, though its start
    is the next entry's), else through :meth:`EntryColumns.token_arrays`, which gives entries
    of one content one array (and so one stored array; a caller's array may be kept: then
    not every array was allocated here)."""
    if cols.token_objects is None and not cols.rows_shared():
        return stored_from_arena(cols.tokens, cols.token_starts, cols.token_lengths), True
    return _stored_batch(cols.token_arrays())


@jit
def _data(handle: Any, data_off: Any) -> Any:
    """The data address of an array handed over as ``array_handles`` gives it."""
    return i64_ptr(handle + data_off)[0] if data_off >= 0 else handle  # type: ignore[call-arg]


@jit
def _narrow_arrays(src: Any, lens: Any, dst: Any, data_off: Any, fits: Any) -> None:
    """Per row: ``fits[i]`` = every uint32 id of array ``src[i]`` is below 2^16, and if so
    the ids written to the uint16 array ``dst[i]`` (both C-contiguous, ``lens[i]`` long)."""
    for i in range(src.shape[0]):
        n = lens[i]
        a: Any = u32_ptr(_data(src[i], data_off))  # type: ignore[call-arg]
        high = np.uint32(0)
        for k in range(n):
            high |= a[k]
        fits[i] = high < COMPACT_LIMIT
        if high < COMPACT_LIMIT:
            b: Any = u16_ptr(_data(dst[i], data_off))  # type: ignore[call-arg]
            for k in range(n):
                b[k] = np.uint16(a[k])


@jit
def _rows_fit(arena: Any, starts: Any, lens: Any, fits: Any) -> None:
    """``fits[j]``: every id of row ``j`` of the arena is below 2^16 (read through a pointer:
    no index checks in the loop, which then runs SIMD)."""
    base = arena.ctypes.data
    for j in range(starts.shape[0]):
        a: Any = u32_ptr(base + 4 * starts[j])  # type: ignore[call-arg]
        high = np.uint32(0)
        for k in range(lens[j]):
            high |= a[k]
        fits[j] = high < COMPACT_LIMIT


@jit
def _copy_rows(arena: Any, starts: Any, lens: Any, dst: Any, data_off: Any, fits: Any) -> None:
    """Row ``j`` of the arena into the array ``dst[j]`` (``uint16`` where ``fits[j]``, else
    ``uint32``; 0: an empty row, nothing to write)."""
    base = arena.ctypes.data
    for j in range(starts.shape[0]):
        if dst[j] == 0:
            continue
        n = lens[j]
        a: Any = u32_ptr(base + 4 * starts[j])  # type: ignore[call-arg]
        if fits[j]:
            b: Any = u16_ptr(_data(dst[j], data_off))  # type: ignore[call-arg]
            for k in range(n):
                b[k] = np.uint16(a[k])
        else:
            w: Any = u32_ptr(_data(dst[j], data_off))  # type: ignore[call-arg]
            for k in range(n):
                w[k] = a[k]
