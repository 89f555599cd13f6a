"""Which contents and hashes the blend index can keep as they are, and what it reads of them
(bytes per id, bytes of ids, lengths): the checks :mod:`~kvatlas.directory.blend.op_columns`
makes of a batch's objects before it takes them by address.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import _cpython
from kvatlas.directory.blend.kernels.contents import content_count, kept_contents
from kvatlas.directory.blend.kernels.layout import HASH_WIDTH as HASH_WIDTH  # (re-exported)
from kvatlas.directory.blend.kernels.objects import (
    C_CONTIGUOUS,
    KEPT,
    OWNDATA,
    WRITEABLE,
    hash_lengths,
    kept_arrays,
    object_handles,
)
from kvatlas.directory.blend.kernels.planes import PLANES, planes_count

U32 = np.dtype(np.uint32)
U16 = np.dtype(np.uint16)
_DTYPE = attrgetter("dtype")
_NDIM = attrgetter("ndim")
_FLAGS = attrgetter("flags.num")

Tokens = npt.NDArray[Any] | bytes
"""A content's ids: a C-contiguous ``uint32`` or ``uint16`` array, one in the planes form
(``kernels/planes.py``), or a content as the directory keeps it (``kernels/contents.py``)."""


def token_width(tokens: Tokens) -> int:
    """Bytes per id of a content or array (1: the planes form)."""
    if isinstance(tokens, bytes):
        return 1 if tokens[0] else tokens[1]
    return int(tokens.itemsize)


def token_nbytes(tokens: Tokens) -> int:
    """Bytes of the ids a content or array keeps (a content's header not counted)."""
    if isinstance(tokens, bytes):
        return len(tokens) - (0 if tokens[0] else tokens[1])
    return int(tokens.nbytes)


Checked = tuple[list[Tokens], npt.NDArray[np.int64], list[bytes], npt.NDArray[np.int64]]
"""Columns an add batch's objects passed the checks with: ``(tokens, bytes per id of each,
hashes, length of each)``."""


def checked_objects(tokens: list[Any], hashes: list[Any], chunk: int) -> Checked | None:
    """The contents and hashes with their widths and lengths if every content is one the
    index keeps as it is (an exact ``bytes`` content of ``chunk`` ids, ``kernels/contents.py``,
    or a read-only, C-contiguous, exact ``ndarray`` of ``chunk`` ``uint16`` or ``uint32``
    ids or in the planes form, owning its memory) and every hash an exact ``bytes`` of at
    most 32; else ``None``. Compiled (``kernels/objects.py``, ``kernels/contents.py``) where
    the CPython layout was located, else :func:`checked_in_python` (the reference: tests
    hold the two to each other)."""
    layout = _cpython.OBJECT_LAYOUT
    if layout is None:  # pragma: no cover - not CPython + numpy
        return checked_in_python(tokens, hashes, chunk)
    n = len(tokens)
    widths = np.empty(n, np.int64)
    handles = object_handles(tokens)
    at = tuple(layout)
    if n and type(tokens[0]) is bytes:
        kept = kept_contents(handles, chunk, at, id(bytes), _cpython.BYTES_DATA_OFFSET, widths)
    else:
        kept = kept_arrays(  # (views are copied: they may pin a larger buffer)
            handles, chunk, at, id(np.ndarray), id(U16), id(U32), id(PLANES),
            _cpython.ARRAY_DATA_OFFSET, widths,
        ) == KEPT  # fmt: skip
    if not kept:
        return None
    lengths = np.empty(n, np.int64)
    handles = object_handles(hashes)
    if not hash_lengths(handles, at, id(bytes), HASH_WIDTH, lengths):
        return None
    return tokens, widths, hashes, lengths


def checked_in_python(tokens: list[Any], hashes: list[Any], chunk: int) -> Checked | None:
    """:func:`checked_objects` by attribute reads (when no layout was located)."""
    if set(map(type, hashes)) != {bytes}:
        return None
    hash_lens = byte_lengths(hashes)
    if int(hash_lens.max()) > HASH_WIDTH:
        return None
    if set(map(type, tokens)) == {bytes}:
        try:
            if set(map(content_count, tokens)) != {chunk}:
                return None
        except ValueError:  # a malformed content
            return None
        return tokens, token_widths(tokens), hashes, hash_lens
    if set(map(type, tokens)) != {np.ndarray}:
        return None
    dtypes = set(map(_DTYPE, tokens))
    if not dtypes <= {U16, U32, PLANES} or set(map(_NDIM, tokens)) != {1}:
        return None
    try:
        if {planes_count(t) if t.dtype is PLANES else len(t) for t in tokens} != {chunk}:
            return None
    except ValueError:  # a malformed planes-form array
        return None
    flags = set(map(_FLAGS, tokens))
    if any(f & (C_CONTIGUOUS | WRITEABLE | OWNDATA) != C_CONTIGUOUS | OWNDATA for f in flags):
        return None
    return tokens, token_widths(tokens), hashes, hash_lens


def token_widths(tokens: list[Tokens]) -> npt.NDArray[np.int64]:
    """Bytes per id of each content or array (``uint16`` or ``uint32``; 1: the planes
    form)."""
    if tokens and type(tokens[0]) is bytes and set(map(type, tokens)) == {bytes}:
        return np.fromiter(map(token_width, tokens), np.int64, len(tokens))
    dtypes = set(map(_DTYPE, tokens))
    if len(dtypes) == 1:
        return filled(len(tokens), dtypes.pop().itemsize)
    return np.fromiter(map(token_width, tokens), np.int64, len(tokens))


def filled(n: int, value: int) -> npt.NDArray[np.int64]:
    """``n`` int64s of ``value`` (``np.full`` without its Python-level overhead)."""
    out = np.empty(n, np.int64)
    out.fill(value)
    return out


def byte_lengths(items: Sequence[bytes]) -> npt.NDArray[np.int64]:
    return np.fromiter(map(len, items), np.int64, len(items))
