"""Token storage: how the directory keeps a chunk's token ids — compactly, exactly.

A chunk's content is kept as a read-only array that owns its memory, in one of three forms
chosen per chunk by its largest id (token bytes are most of a directory's memory):

- ``uint16`` when every id is below 2^16 (vocabularies up to 65,536 ids: half the bytes of
  the ``uint32`` the wire carries);
- the planes form when every id is below 2^24 (``blend/kernels/planes.py``: the low 16 bits
  of each id, then one bit plane per high bit the chunk needs: 17 bits per id for Llama 3's
  128,256 ids, 18 for Qwen 2.5's or Gemma's; 546 bytes per 256-token chunk instead of 1,024);
- ``uint32`` otherwise.

No form is a truncation: every id in [0, 2^32) round-trips exactly (:func:`widened` gives the
``uint32`` array public values carry). The blend index reads every form in place
(``blend/kernels/layout.py``).

Entries of one content (a chunk's ranks) sharing one input array get one stored array, so the
directory's "same object, same content" shortcut holds; narrowing is one compiled pass per batch.

Restored contents are read-only views of one :class:`TokenSlab` holding a snapshot's token
section (shared with the blend index, ``blend.share_slab``). A slab is freed once its views are
gone; once more than half are (:meth:`TokenSlab.mostly_dead`), the chunk table and
``BlendIndex.copy_out`` copy the live contents out, so a slab holds at most as many dead
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
from operator import attrgetter, is_not
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import share_slab
from kvatlas.directory.blend._cpython import ARRAY_DATA_OFFSET, OBJECT_LAYOUT, array_handles
from kvatlas.directory.blend.kernels.objects import u32_rows
from kvatlas.directory.blend.kernels.planes import (
    FORM_PLANES,
    FORM_U16,
    FORM_U32,
    HEADER,
    MAX_HIGH_BITS,
    PLANES,
    form_of,
    planes_count,
    planes_load,
    planes_nbytes,
    planes_store,
    stored_nbytes,
)
from kvatlas.directory.blend.kernels.pointers import i64_ptr, jit, u8_ptr, u16_ptr, u32_ptr
from kvatlas.events.columns import EntryColumns
from kvatlas.keys.tokens import TokenArray

StoredTokens = npt.NDArray[Any]
"""A chunk's content as the directory keeps it: read-only ``uint16``, planes form (dtype
:data:`PLANES`) or ``uint32``."""
COMPACT_LIMIT = 1 << 16
"""Ids below this fit the compact (``uint16``) form."""

_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)
_ANONYMOUS: int = getattr(mmap, "MAP_ANONYMOUS", 0)
_FORM_DTYPES: dict[int, np.dtype[Any]] = {FORM_U16: _U16, FORM_U32: _U32}
_FORM_DTYPES.update((FORM_PLANES + h, PLANES) for h in range(1, MAX_HIGH_BITS + 1))
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
        return stored
    if stored.dtype is PLANES:
        n = planes_count(stored)
        out = np.empty(n, np.uint32)
        planes_load(out, stored.ctypes.data, n)
    else:
        out = stored.astype(np.uint32)
    out.flags.writeable = False
    return out


def token_count(stored: StoredTokens) -> int:
    """How many ids ``stored`` holds, whatever its form."""
    return planes_count(stored) if stored.dtype is PLANES else len(stored)


def stored_form(stored: StoredTokens) -> int:
    """The form code of ``stored`` (``planes.FORM_*``: 2, 4, or 16 + its high bits)."""
    if stored.dtype is PLANES:
        high: int = stored.item(0)[0]  # the header's h
        return FORM_PLANES + high
    return FORM_U16 if stored.dtype is _U16 else FORM_U32


def stored_equal(a: StoredTokens, b: StoredTokens) -> bool:
    """Whether two stored contents hold the same ids (forms are canonical, so contents of one
    form are equal exactly when their bytes are; of two forms, compared widened: a content
    restored from an older snapshot may be ``uint32`` where a new one is not)."""
    if a is b:
        return True
    if a.dtype is b.dtype:  # (bytes compared: a twentieth of ``np.array_equal``'s cost)
        return a.shape == b.shape and a.tobytes() == b.tobytes()
    wa, wb = widened(a), widened(b)
    return wa.shape == wb.shape and bool(np.array_equal(wa, wb))


def stored_one(tokens: npt.NDArray[Any]) -> StoredTokens:
    """``tokens`` (validated ids) in stored form: the array itself when it is a read-only
    ``uint16`` array owning its memory, else a copy in the form its ids need."""
    if tokens.dtype is _U16 and not tokens.flags.writeable and tokens.flags.owndata:
        return tokens
    if len(tokens) == 0:
        empty = np.empty(0, np.uint16)
        empty.flags.writeable = False
        return empty
    arena = np.ascontiguousarray(tokens, dtype=np.uint32)
    (out,) = stored_from_arena(arena, np.zeros(1, np.int64), np.full(1, len(arena), np.int64))
    assert out is not None
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
                    dtype = _FORM_DTYPES[int(forms[lo])]
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
            dtype = _FORM_DTYPES[form]
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


def form_sizes(lens: npt.NDArray[Any], forms: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Bytes of each content stored (``lens[i]`` ids in form ``forms[i]``)."""
    n = lens.astype(np.int64)
    planes = HEADER + 2 * n + (forms - FORM_PLANES) * (((n + 15) >> 4) << 1)
    return np.where(forms < FORM_PLANES, n * forms, planes)


def stored_shapes(
    arrays: Sequence[StoredTokens],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """How many ids each stored array holds and its form code (``planes.FORM_*``), in one
    compiled pass (a snapshot reads them for every chunk)."""
    n = len(arrays)
    counts = np.fromiter(map(len, arrays), np.int64, n)
    itemsizes = np.fromiter(map(_ITEMSIZE, arrays), np.int64, n)
    forms = np.empty(n, np.int64)
    handles = np.array(array_handles(list(arrays)), np.int64)
    _shapes(handles, ARRAY_DATA_OFFSET, itemsizes, counts, forms)
    return counts, forms


_ITEMSIZE = attrgetter("itemsize")


def stored_batch(arrays: Sequence[TokenArray | None]) -> list[StoredTokens | None]:
    """:func:`stored_one` of each array (``None`` stays ``None``), two compiled passes for
    the batch; entries that share an input array share its stored array. (Per entry this is
    an allocation and a flag: the checks run as C-level maps, not as Python code per entry.)"""
    return _stored_batch(arrays)[0]


def _stored_batch(arrays: Sequence[TokenArray | None]) -> tuple[list[StoredTokens | None], bool]:
    """:func:`stored_batch`, and whether every stored array was allocated here (no caller's
    array kept)."""
    srcs = [a for a in arrays if a is not None]
    fast = _u32_rows(srcs)
    if fast is not None:  # the usual batch: one compiled check instead of three maps
        outs = _stored_rows(*fast)
        if len(outs) == len(arrays):
            return outs, True  # type: ignore[return-value]
        rows = iter(outs)
        return [None if a is None else next(rows) for a in arrays], True
    ids = list(map(id, srcs))
    distinct = dict(zip(ids, srcs, strict=True))
    if len(distinct) != len(srcs):
        srcs = list(distinct.values())
    if not srcs:
        return list(arrays), True
    if set(map(_DTYPE, srcs)) != {_U32} or set(map(_STRIDES, srcs)) != {(4,)}:
        stored = {key: stored_one(a) for key, a in distinct.items()}  # uncommon inputs
        allocated = all(map(is_not, stored.values(), distinct.values()))
        return [None if a is None else stored[id(a)] for a in arrays], allocated
    lens = np.fromiter(map(len, srcs), np.int64, len(srcs))
    outs = _stored_rows(np.array(array_handles(srcs), np.int64), ARRAY_DATA_OFFSET, lens)
    if len(outs) == len(arrays):  # no None, no shared input: entry for entry
        return outs, True  # type: ignore[return-value]
    by_id = dict(zip(distinct, outs, strict=True))
    return [None if a is None else by_id[id(a)] for a in arrays], True


def _u32_rows(
    srcs: list[TokenArray],
) -> tuple[npt.NDArray[np.int64], int, npt.NDArray[np.int64]] | None:
    """The arguments of :func:`_stored_rows` for ``srcs`` when every one is an exact,
    1-D, C-contiguous ``uint32`` ndarray and no two are one object (checked compiled, through
    the CPython layout); ``None`` otherwise (or when no layout was located): the general
    path then takes them."""
    layout = OBJECT_LAYOUT
    n = len(srcs)
    if layout is None or not n:
        return None
    handles = np.fromiter(map(id, srcs), np.int64, n)
    lens = np.empty(n, np.int64)
    if not u32_rows(handles, tuple(layout), id(np.ndarray), id(_U32), lens):
        return None  # (also when entries share an array: it is stored once, as theirs)
    return handles, ARRAY_DATA_OFFSET, lens


def _stored_rows(
    srcs: npt.NDArray[np.int64], src_off: int, lens: npt.NDArray[np.int64]
) -> list[StoredTokens]:
    """Stored arrays of the ``uint32`` rows ``srcs`` (``lens[j]`` ids each, > 0 or an array
    handle; read through ``src_off`` as ``_data`` reads them): which form each row needs,
    then each array allocated (by C-level maps, no Python per row) and written."""
    n = len(lens)
    forms = np.empty(n, np.int64)
    sizes = np.empty(n, np.int64)
    _forms(srcs, src_off, lens, forms, sizes)
    outs: list[StoredTokens] = list(map(np.empty, sizes.tolist(), _dtypes(forms)))
    dsts = np.array(array_handles(outs), np.int64)
    _write_rows(srcs, src_off, lens, dsts, ARRAY_DATA_OFFSET, forms)
    read_only(outs)
    return outs


def _dtypes(forms: npt.NDArray[np.int64]) -> Iterable[np.dtype[Any]]:
    """The dtype of each row's array (one repeated dtype when all rows agree: no per-row
    lookup)."""
    if not len(forms):
        return ()
    first = int(forms[0])
    if bool((forms == first).all()):
        return repeat(_FORM_DTYPES[first])
    return map(_FORM_DTYPES.__getitem__, forms.tolist())


def stored_from_arena(
    arena: TokenArray, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> list[StoredTokens | None]:
    """Stored arrays of ``arena[starts[j]:starts[j] + lengths[j]]`` (length 0: ``None``), each
    owning its memory (never a view that would pin the arena): two compiled passes for all
    (which form each row needs, then the copies into arrays of that form)."""
    arena = np.ascontiguousarray(arena, dtype=np.uint32)
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    lens = lengths.tolist()
    if len(starts) != len(lens) or (
        len(lens)
        and (min(lens) < 0 or int(starts.min()) < 0 or int((starts + lengths).max()) > len(arena))
    ):
        raise ValueError("token rows outside the arena")
    every = not lens or min(lens) > 0  # no empty row (the usual batch): no mask, no None
    present = lengths > 0
    addresses = arena.ctypes.data + 4 * (starts if every else starts[present])
    rows = _stored_rows(addresses, -1, lengths if every else lengths[present])
    if every:
        return rows  # type: ignore[return-value]
    it = iter(rows)
    return [next(it) if n else None for n in lens]


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
    """The data address of an array handed over as ``array_handles`` gives it (``data_off``
    < 0: the handle is the address)."""
    return i64_ptr(handle + data_off)[0] if data_off >= 0 else handle  # type: ignore[call-arg]


@jit
def _forms(srcs: Any, src_off: Any, lens: Any, forms: Any, sizes: Any) -> None:
    """Per row: ``forms[j]`` = the form its ids need (by the OR of its ``uint32`` ids, read
    through a pointer: no index checks, the loop runs SIMD) and ``sizes[j]`` = the elements
    of its stored array."""
    for j in range(srcs.shape[0]):
        n = lens[j]
        a: Any = u32_ptr(_data(srcs[j], src_off))  # type: ignore[call-arg]
        high = np.uint32(0)
        for k in range(n):
            high |= a[k]
        form = form_of(high, n)
        forms[j] = form
        sizes[j] = n if form < FORM_PLANES else planes_nbytes(n, form - FORM_PLANES)


@jit
def _write_rows(srcs: Any, src_off: Any, lens: Any, dsts: Any, dst_off: Any, forms: Any) -> None:
    """Row ``j`` (``uint32`` ids) into the array ``dsts[j]`` in form ``forms[j]``."""
    for j in range(srcs.shape[0]):
        n = lens[j]
        src = _data(srcs[j], src_off)
        dst = _data(dsts[j], dst_off)
        a: Any = u32_ptr(src)  # type: ignore[call-arg]
        form = forms[j]
        if form == FORM_U16:
            b: Any = u16_ptr(dst)  # type: ignore[call-arg]
            for k in range(n):
                b[k] = np.uint16(a[k])
        elif form == FORM_U32:
            w: Any = u32_ptr(dst)  # type: ignore[call-arg]
            for k in range(n):
                w[k] = a[k]
        else:
            planes_store(src, n, dst, form - FORM_PLANES)


@jit
def _shapes(handles: Any, data_off: Any, itemsizes: Any, counts: Any, forms: Any) -> None:
    """Per array (``counts[j]`` its length on entry): its form code and how many ids it
    holds (a planes-form array's from its header and length, as ``planes_count`` reads
    them)."""
    for j in range(handles.shape[0]):
        if itemsizes[j] != 1:
            forms[j] = itemsizes[j]
            continue
        size = counts[j]
        h = np.int64(u8_ptr(_data(handles[j], data_off))[0])  # type: ignore[call-arg]
        forms[j] = FORM_PLANES + h
        half = (size - HEADER) // 2  # as planes._planes_ids
        counts[j] = half - h * ((half + 15 + h) // (16 + h))
