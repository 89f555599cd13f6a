"""The column check of an add batch, compiled: Python objects read through their CPython
layout (``_cpython.ObjectLayout``, located and read back at import).

What it decides is what ``op_checks.checked_in_python`` asks in Python when no layout was
located: whether every token array is one the index keeps as it is and every chunk hash an
exact ``bytes`` of at most 32. In Python each of the six questions is an attribute read per
array; here they are a few loads each. The caller keeps every
object alive for the call (they are in its lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import _cpython
from kvatlas.directory.blend.kernels.planes import HEADER, MAX_HIGH_BITS, planes_nbytes
from kvatlas.directory.blend.kernels.pointers import i32_ptr, i64_ptr, inline, jit, u8_ptr

NOT_KEPT, KEPT, KEPT_VIEWS = -1, 0, 1
""":func:`kept_arrays` verdicts: some array is not kept as it is; every one is and owns its
memory; every one is, but some are views (the caller checks their bases)."""

C_CONTIGUOUS, OWNDATA, WRITEABLE = 0x1, 0x4, 0x400
"""numpy's array flag bits (``ndarray.flags.num``)."""


@jit
def kept_arrays(
    handles: Any,
    chunk: Any,
    layout: Any,
    ndarray_type: Any,
    u16: Any,
    u32: Any,
    planes: Any,
    data_off: Any,
    widths: Any,
) -> Any:
    """Whether every object (``handles``: ``id``s) is an exact ``ndarray`` of ``chunk``
    ids, 1-D, read-only, C-contiguous, of the dtype object ``u16`` or ``u32`` (``id``s of the
    builtin descriptors: an equal dtype of another object is refused, the caller's slow path
    then applies it) or ``planes`` (``planes.PLANES``: its header valid, its length that of
    ``chunk`` ids; its data pointer at ``data_off``), with ``widths[i]`` = its bytes per id
    (1: the planes form); a verdict of ``NOT_KEPT``, ``KEPT`` or ``KEPT_VIEWS``. ``layout``:
    ``_cpython.ObjectLayout`` as a plain tuple."""
    ob_type, _, nd, dimensions, descr, flags = layout
    verdict = KEPT
    for i in range(handles.shape[0]):
        at = handles[i]
        if i64_ptr(at + ob_type)[0] != ndarray_type or i32_ptr(at + nd)[0] != 1:  # type: ignore[call-arg]
            return NOT_KEPT
        size = i64_ptr(i64_ptr(at + dimensions)[0])[0]  # type: ignore[call-arg]
        dtype = i64_ptr(at + descr)[0]  # type: ignore[call-arg]
        if dtype == u16 and size == chunk:
            widths[i] = 2
        elif dtype == u32 and size == chunk:
            widths[i] = 4
        elif dtype == planes and size >= HEADER:
            h = np.int64(u8_ptr(i64_ptr(at + data_off)[0])[0])  # type: ignore[call-arg]
            if not 1 <= h <= MAX_HIGH_BITS or size != planes_nbytes(chunk, h):
                return NOT_KEPT
            widths[i] = 1
        else:
            return NOT_KEPT
        f = i32_ptr(at + flags)[0]  # type: ignore[call-arg]
        if f & (C_CONTIGUOUS | WRITEABLE) != C_CONTIGUOUS:
            return NOT_KEPT
        if not f & OWNDATA:
            verdict = KEPT_VIEWS
    return verdict


@inline
def bytes_size(at: Any, layout: Any, bytes_type: Any) -> Any:
    """The size of the object at ``at`` (an ``id``) if it is an exact ``bytes`` (its type the
    object ``bytes_type``, ``id(bytes)``: a subclass is refused), else -1. ``layout``:
    ``_cpython.ObjectLayout`` as a plain tuple (``ob_type``'s offset, then ``ob_size``'s)."""
    if i64_ptr(at + layout[0])[0] != bytes_type:  # type: ignore[call-arg]
        return -1
    return i64_ptr(at + layout[1])[0]  # type: ignore[call-arg]


@jit
def hash_lengths(handles: Any, layout: Any, bytes_type: Any, width: Any, lengths: Any) -> Any:
    """Whether every object (``handles``: ``id``s) is an exact ``bytes`` of at most
    ``width``, with ``lengths[i]`` = its length."""
    for i in range(handles.shape[0]):
        n = bytes_size(handles[i], layout, bytes_type)
        if n < 0 or n > width:
            return False
        lengths[i] = n
    return True


@jit
def u32_rows(handles: Any, layout: Any, ndarray_type: Any, u32: Any, lengths: Any) -> Any:
    """Whether every object (``handles``: ``id``s) is an exact ``ndarray``, 1-D,
    C-contiguous, of the dtype object ``u32`` (the id of the builtin descriptor: an equal
    dtype of another object is refused, the caller's slow path then takes it), and no object
    comes twice, with ``lengths[i]`` = its length. ``layout``: ``_cpython.ObjectLayout`` as
    a plain tuple. (The sort is numba's: numpy's releases the GIL, see
    tests/directory/test_gil_holding.py.)"""
    ob_type, _, nd, dimensions, descr, flags = layout
    for i in range(handles.shape[0]):
        at = handles[i]
        if i64_ptr(at + ob_type)[0] != ndarray_type or i32_ptr(at + nd)[0] != 1:  # type: ignore[call-arg]
            return False
        if i64_ptr(at + descr)[0] != u32:  # type: ignore[call-arg]
            return False
        if not i32_ptr(at + flags)[0] & C_CONTIGUOUS:  # type: ignore[call-arg]
            return False
        lengths[i] = i64_ptr(i64_ptr(at + dimensions)[0])[0]  # type: ignore[call-arg]
    order = np.sort(handles)
    return not (order[1:] == order[:-1]).any()


@jit
def _copied_items(at: Any, size: Any, items: Any, indirect: Any, plus: Any, out: Any) -> Any:
    """``out[k]`` = the ``k``-th item pointer of the ``list`` (``indirect``: its items are
    where the pointer at ``at + items`` points) or ``tuple`` (at ``at + items``) whose ``id``
    is ``at``, plus ``plus``, if its length (at ``at + size``) is that of ``out``; else
    ``False``. One compiled call with the GIL held: no other thread changes the list
    meanwhile."""
    n = out.shape[0]
    if i64_ptr(at + size)[0] != n:  # type: ignore[call-arg]
        return False
    first = i64_ptr(at + items)[0] if indirect else at + items  # type: ignore[call-arg]
    words = i64_ptr(first)  # type: ignore[call-arg]
    for k in range(n):
        out[k] = words[k] + plus
    return True


def object_handles(items: Sequence[object], plus: int = 0) -> npt.NDArray[np.int64]:
    """``np.fromiter(map(id, items), np.int64)`` (each plus ``plus``): for an exact ``list``
    or ``tuple``, its item pointers copied as they are (``map(id, ...)`` makes an ``int`` per
    item: ≈40 ns each, 10 µs a batch of 256), anything else by ``map``. Valid while the
    objects live."""
    n = len(items)
    layout, kind = _cpython.ITEM_ARRAYS, type(items)
    if layout is not None and (kind is list or kind is tuple):
        out = np.empty(n, np.int64)
        listed = kind is list
        offset = layout.list_items if listed else layout.tuple_items
        if _copied_items(id(items), layout.size, offset, listed, plus, out):
            return out
    return np.fromiter(map(plus.__add__, map(id, items)), np.int64, n)


def payload_addresses(items: Sequence[bytes]) -> npt.NDArray[np.int64]:
    """Where each exact ``bytes`` of ``items`` keeps its payload (:func:`object_handles` +
    the header's size); valid while they live."""
    return object_handles(items, _cpython.BYTES_DATA_OFFSET)
