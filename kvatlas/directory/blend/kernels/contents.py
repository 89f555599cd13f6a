"""A chunk's content as the directory keeps it: one ``bytes`` object, its ids inline.

One allocation per content, no array object (an ``ndarray`` owning a buffer is two: ≈112
bytes of object beside the ids, docs/performance.md). The ids are in the form they need
(``planes.py``: ``uint16``, the planes form, ``uint32``), after a header that says which, so
the form is read from the content alone (a chunk's length does not say it: the last chunk of
a request may be shorter):

- planes form: the form's own 2-byte header (byte 0 ``h`` in 1..8, byte 1 zero), then its
  low halves and bit planes; the content *is* the planes-form bytes;
- ``uint16``: bytes ``0, 2``, then the ids (2-byte aligned);
- ``uint32``: bytes ``0, 4, 0, 0``, then the ids (4-byte aligned).

So byte 0 is ``h`` (planes) or 0, byte 1 the bytes per id of a plain form, and the ids (the
planes form with its header) start :func:`data_offset` bytes in. A ``bytes`` payload starts
16-byte aligned (CPython's allocators align objects to 16, the header before the payload is
32 bytes), so every form's ids are aligned for their width. The kernels read a content at
``id(content) + BYTES_DATA_OFFSET + data_offset(form)``; numpy readers take a read-only view
(``np.frombuffer``). Immutable: nothing can change a content the blend index keeps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.objects import bytes_size
from kvatlas.directory.blend.kernels.planes import (
    FORM_PLANES,
    FORM_U16,
    FORM_U32,
    HEADER,
    MAX_HIGH_BITS,
    planes_ids,
    planes_nbytes,
)
from kvatlas.directory.blend.kernels.pointers import i64_ptr, inline, jit, prefetch_addr, u8_ptr

HEADERS = {FORM_U16: b"\x00\x02", FORM_U32: b"\x00\x04\x00\x00"}
"""The header of a content in a plain form (the planes form carries its own)."""


def data_offset(form: int) -> int:
    """Bytes of a content of form ``form`` before the bytes its form stores (a snapshot's)."""
    return 0 if form >= FORM_PLANES else form


def content_form(content: bytes) -> int:
    """The form code of a well-formed content (``planes.FORM_*``)."""
    high = content[0]
    return FORM_PLANES + high if high else content[1]


def content_count(content: bytes) -> int:
    """How many ids ``content`` holds; ``ValueError`` unless it is a well-formed content (a
    caller's ``bytes`` handed to the blend index)."""
    size = len(content)
    if size >= HEADER:
        high, width = content[0], content[1]
        if not high and width in HEADERS and size >= width and not (size - width) % width:
            return (size - width) // width
        if 1 <= high <= MAX_HIGH_BITS and not width and not size % 2:
            n, sixteenths = planes_ids(size, high)
            if n >= 0 and (n + 15) >> 4 == sixteenths:
                return n
    raise ValueError("not a token content (bad header or length)")


def token_count(content: bytes) -> int:
    """How many ids a well-formed content holds (unchecked: the directory's own)."""
    high = content[0]
    if high:
        return planes_ids(len(content), high)[0]
    width = content[1]
    return (len(content) - width) // width


@inline
def _count(b0: Any, b1: Any, size: Any) -> Any:
    """The ids of a content of ``size`` bytes whose header bytes are ``b0, b1``; -1 if no
    content is laid out so."""
    if b0 == 0:
        if (b1 != 2 and b1 != 4) or size < b1 or (size - b1) % b1:
            return -1
        return (size - b1) // b1
    if b0 > MAX_HIGH_BITS or b1 != 0 or size % 2:
        return -1
    half = (size - HEADER) // 2  # n + h·⌈n/16⌉ (planes.planes_ids)
    sixteenths = -(-half // (16 + b0))
    n = half - b0 * sixteenths
    if n < 0 or planes_nbytes(n, b0) != size:
        return -1
    return n


@jit
def content_shapes(handles: Any, size_off: Any, data_off: Any, counts: Any, forms: Any) -> bool:
    """Per content (``handles``: ``id``s of exact ``bytes``, their length at ``size_off`` and
    payload at ``data_off``): ``counts[j]`` its ids and ``forms[j]`` its form code; whether
    every one is well formed."""
    for j in range(handles.shape[0]):
        at = handles[j]
        size = i64_ptr(at + size_off)[0]  # type: ignore[call-arg]
        head: Any = u8_ptr(at + data_off)  # type: ignore[call-arg]
        b0 = np.int64(head[0]) if size > 0 else np.int64(0)
        b1 = np.int64(head[1]) if size > 1 else np.int64(0)
        n = _count(b0, b1, size)
        if n < 0:
            return False
        counts[j] = n
        forms[j] = FORM_PLANES + b0 if b0 else b1
    return True


@jit
def kept_contents(
    handles: Any, chunk: Any, layout: Any, bytes_type: Any, data_off: Any, widths: Any
) -> Any:
    """Whether every object (``handles``: ``id``s) is an exact ``bytes`` holding a
    well-formed content of ``chunk`` ids (its payload at ``data_off`` from the ``id``), with
    ``widths[i]`` its bytes per id (1: the planes form). ``layout``:
    ``_cpython.ObjectLayout`` as a plain tuple."""
    for i in range(handles.shape[0]):
        at = handles[i]
        size = bytes_size(at, layout, bytes_type)
        if size < HEADER:  # not an exact bytes (-1), or too short
            return False
        head: Any = u8_ptr(at + data_off)  # type: ignore[call-arg]
        b0, b1 = np.int64(head[0]), np.int64(head[1])
        if _count(b0, b1, size) != chunk:
            return False
        widths[i] = 1 if b0 else b1
    return True


@inline
def _ids_at(at: Any, data_off: Any, width: Any) -> Any:
    """The address of the ids of the content at ``at`` (its payload at ``data_off``), ``width``
    its bytes per id (1: the planes form, whose header is part of it; a plain form's header
    is ``width`` bytes)."""
    return at + data_off + (0 if width == 1 else width)


@jit
def token_addresses(
    handles: Any, ob_type: Any, bytes_type: Any, bytes_off: Any, array_off: Any, widths: Any,
    out: Any,
) -> None:  # fmt: skip
    """``out[i]`` = the address of the ids of object ``handles[i]`` (an ``id``): a content's
    (an exact ``bytes``, ``widths[i]`` its bytes per id, 1: the planes form) or a C-contiguous
    array's data pointer (read at ``array_off``)."""
    for i in range(handles.shape[0]):
        at = handles[i]
        if i64_ptr(at + ob_type)[0] == bytes_type:  # type: ignore[call-arg]
            out[i] = _ids_at(at, bytes_off, widths[i])
        else:
            out[i] = i64_ptr(at + array_off)[0]  # type: ignore[call-arg]


_AHEAD = 8
"""How many contents ahead :func:`vouched_layout` requests a content's header."""


@jit
def vouched_layout(
    handles: Any, layout: Any, bytes_type: Any, data_off: Any, widths: Any, addrs: Any
) -> Any:
    """For contents vouched well formed (``handles``: ``id``s, each an exact ``bytes``
    holding a content, its payload at ``data_off``): ``widths[i]`` its bytes per id (1: the
    planes form) and ``addrs[i]`` the address of its ids (:func:`token_addresses`), reading
    each content's header once (the header of the one ``_AHEAD`` on requested meanwhile).
    Returns the bytes of all their ids (headers not counted: ``token_nbytes``), or -1 when
    an object is not a ``bytes`` (then the caller takes the general path). ``layout``:
    ``_cpython.ObjectLayout`` as a plain tuple."""
    n = handles.shape[0]
    total = 0
    for i in range(n):
        if i + _AHEAD < n:  # its type and size, then its header
            prefetch_addr(handles[i + _AHEAD])  # type: ignore[call-arg]
            prefetch_addr(handles[i + _AHEAD] + data_off)  # type: ignore[call-arg]
        at = handles[i]
        size = bytes_size(at, layout, bytes_type)
        if size < 0:
            return -1
        head: Any = u8_ptr(at + data_off)  # type: ignore[call-arg]
        width = 1 if head[0] else np.int64(head[1])
        widths[i] = width
        addrs[i] = _ids_at(at, data_off, width)
        total += size - (addrs[i] - at - data_off)  # less a plain form's header
    return total
