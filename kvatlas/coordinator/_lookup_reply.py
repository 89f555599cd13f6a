"""The token ids of a prefix lookup's reply written as JSON in one compiled pass.

A 32k-token prompt's reply holds 32,768 ids (≈0.25 MB of JSON): building each key's
``token_ids`` as a Python list (``ndarray.tolist``, an ``int`` per id) and encoding those was
most of the reply's cost (docs/performance.md, "Directory: where the time and memory go"). Here
every key's ids are written as its JSON array by one kernel and handed to the encoder as
``msgspec.Raw``, which it copies as they are: the bytes are exactly those ``msgspec.json``
writes for the lists (the tests compare the two on random lookups). JSON only: a msgpack reply
encodes the lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numba
import numpy as np
import numpy.typing as npt

from kvatlas.checks import refuse_big_endian
from kvatlas.directory.blend.kernels.pointers import inline, u32_ptr
from kvatlas.keys.tokens import TokenArray

GROUPS = np.frombuffer("".join(f"{i:04d}" for i in range(10_000)).encode(), np.uint32).copy()
"""``"0000"`` to ``"9999"``: four digits as one word, the first digit its low byte (the byte
order of every target numba compiles for, checked at import)."""
SIGNIFICANT = np.array([len(str(i)) for i in range(10_000)], np.uint8)
"""How many of a group's four digits are not leading zeros (one for 0)."""
refuse_big_endian("kvatlas's JSON id writer")
_MAX_DIGITS = 10
"""Of an id below 2^32."""
_EMPTY = msgspec.Raw(b"[]")


@numba.njit(cache=True, boundscheck=False)
def _write_lists(ids, lens, groups, significant, out, ends):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``ids`` (``uint32``) cut into arrays of ``lens[i]`` ids, each written as a JSON array
    (``[1,2,3]``, no space) into ``out`` back to back (:func:`put_u32`); ``ends[i]``: where
    array ``i`` ends. Each id is followed by a comma, the last one's overwritten by the
    ``]``."""
    base = out.ctypes.data
    k = 0
    j = 0
    for i in range(lens.shape[0]):
        out[k] = 91  # "["
        k += 1
        for _ in range(lens[i]):
            k = put_u32(base, k, np.uint64(ids[j]), groups, significant)
            j += 1
            out[k] = 44  # ","
            k += 1
        if lens[i]:
            k -= 1
        out[k] = 93  # "]"
        k += 1
        ends[i] = k


@inline
def put_u32(base, k, v, groups, significant):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``v`` (``uint64`` below 2^32) in decimal at ``base + k``, as JSON writes it; returns
    where its digits end. It is one, two or three groups of four digits (divided by 10,000
    with a multiply), each a word of ``groups`` (:data:`GROUPS`) stored whole; the first
    without its leading zeros (shifted out). Up to 3 bytes past the digits are written too:
    the caller's buffer has room for them and writes what follows over them. (Digits counted
    by compares and written two at a time took 2.6× as long for a lookup's ids: the count
    varies from id to id, and branches on it mispredict.)"""
    ten_thousand = np.uint64(10_000)
    if v < ten_thousand:
        return _put_leading(base, k, v, groups, significant)
    head = v // ten_thousand
    low = v - head * ten_thousand
    if head >= ten_thousand:  # ten digits at most: three groups
        top = head // ten_thousand
        k = _put_leading(base, k, top, groups, significant)
        u32_ptr(base + k)[0] = groups[head - top * ten_thousand]  # type: ignore[call-arg]
        k += 4
    else:
        k = _put_leading(base, k, head, groups, significant)
    u32_ptr(base + k)[0] = groups[low]  # type: ignore[call-arg]
    return k + 4


@inline
def _put_leading(base, k, group, groups, significant):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The group's digits but its leading zeros at ``base + k``; returns where they end."""
    n = np.int64(significant[group])
    u32_ptr(base + k)[0] = groups[group] >> np.uint32(8 * (4 - n))  # type: ignore[call-arg]
    return k + n


def json_id_lists(contents: Sequence[TokenArray | None]) -> list[msgspec.Raw] | None:
    """Each content's ids as a JSON array (``None``: unknown, ``[]``), or ``None`` when a
    content is not an ``ndarray`` of unsigned ids of at most 32 bits (the caller then encodes
    the lists)."""
    arrays = [c for c in contents if c is not None]
    if not arrays:
        return [_EMPTY] * len(contents)
    if set(map(type, arrays)) != {np.ndarray} or any(
        a.dtype.kind != "u" or a.dtype.itemsize > 4 or a.ndim != 1 for a in arrays
    ):
        return None
    lens: npt.NDArray[np.int64] = np.fromiter(map(len, arrays), np.int64, len(arrays))
    ids = np.concatenate(arrays).astype(np.uint32, copy=False)
    out = np.empty(len(ids) * (_MAX_DIGITS + 1) + 2 * len(arrays), np.uint8)
    ends = np.empty(len(arrays), np.int64)
    _write_lists(ids, lens, GROUPS, SIGNIFICANT, out, ends)
    view = memoryview(out[: int(ends[-1])].tobytes())
    bounds = [0, *ends.tolist()]
    written = iter(map(msgspec.Raw, map(view.__getitem__, map(slice, bounds, bounds[1:]))))
    return [_EMPTY if c is None else next(written) for c in contents]
