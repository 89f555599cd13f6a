"""The token ids of a prefix lookup's reply written as JSON in one compiled pass.

A 32k-token prompt's reply holds 32,768 ids (≈0.25 MB of JSON): building each key's
``token_ids`` as a Python list (``ndarray.tolist``, an ``int`` per id) and encoding those was
most of the reply's cost (docs/performance.md, "Prefix lookups"). Here every key's ids are
written as its JSON array by one kernel and handed to the encoder as ``msgspec.Raw``, which it
copies as they are: the bytes are exactly those ``msgspec.json`` writes for the lists (the
tests compare the two on random lookups). JSON only: a msgpack reply encodes the lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numba
import numpy as np
import numpy.typing as npt

from kvatlas.keys.tokens import TokenArray

DECIMAL_PAIRS = np.frombuffer("".join(f"{i:02d}" for i in range(100)).encode(), np.uint8)
"""``"00"`` to ``"99"``: two digits a step."""
_MAX_DIGITS = 10
"""Of an id below 2^32."""
_EMPTY = msgspec.Raw(b"[]")


DIV100 = 1374389535
"""``(v * DIV100) >> 37 == v // 100`` for every ``v`` below 2^32 (no division)."""


@numba.njit(cache=True, boundscheck=False)
def _write_lists(ids, lens, pairs, out, ends):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``ids`` (``uint32``) cut into arrays of ``lens[i]`` ids, each written as a JSON array
    (``[1,2,3]``, no space) into ``out`` back to back; ``ends[i]``: where array ``i`` ends.
    Each id is followed by a comma, the last one's overwritten by the ``]``; its digits are
    counted by compares (their count varies from id to id) and written two at a time from the
    right, divided by 100 without a division."""
    k = 0
    j = 0
    for i in range(lens.shape[0]):
        out[k] = 91  # "["
        k += 1
        for _ in range(lens[i]):
            v = np.int64(ids[j])
            j += 1
            n = 1
            if v >= 10:
                n = 2
            if v >= 100:
                n = 3
            if v >= 1000:
                n = 4
            if v >= 10000:
                n = 5
            if v >= 100000:
                n = 6
            if v >= 1000000:
                n = 7
            if v >= 10000000:
                n = 8
            if v >= 100000000:
                n = 9
            if v >= 1000000000:
                n = 10
            e = k + n
            while v >= 100:
                q = (v * DIV100) >> 37
                r = 2 * (v - 100 * q)
                out[e - 1] = pairs[r + 1]
                out[e - 2] = pairs[r]
                e -= 2
                v = q
            if v >= 10:
                out[e - 1] = pairs[2 * v + 1]
                out[e - 2] = pairs[2 * v]
            else:
                out[e - 1] = 48 + v
            k += n
            out[k] = 44  # ","
            k += 1
        if lens[i]:
            k -= 1
        out[k] = 93  # "]"
        k += 1
        ends[i] = k


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
    _write_lists(ids, lens, DECIMAL_PAIRS, out, ends)
    view = memoryview(out[: int(ends[-1])].tobytes())
    bounds = [0, *ends.tolist()]
    written = iter(map(msgspec.Raw, map(view.__getitem__, map(slice, bounds, bounds[1:]))))
    return [_EMPTY if c is None else next(written) for c in contents]
