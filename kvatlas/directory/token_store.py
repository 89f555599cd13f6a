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

Restored contents are read-only views of one token slab (:mod:`kvatlas.directory.token_slab`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import numpy as np
import numpy.typing as npt

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
FORM_DTYPES: dict[int, np.dtype[Any]] = {FORM_U16: _U16, FORM_U32: _U32}
FORM_DTYPES.update((FORM_PLANES + h, PLANES) for h in range(1, MAX_HIGH_BITS + 1))
"""The dtype of a stored array of each form code (``planes.FORM_*``)."""
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
        return repeat(FORM_DTYPES[first])
    return map(FORM_DTYPES.__getitem__, forms.tolist())


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
