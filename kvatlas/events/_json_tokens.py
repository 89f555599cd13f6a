"""Parse the ``token_ids`` JSON arrays of a whole body in one compiled pass.

msgspec hands each entry's ``token_ids`` over as raw JSON text (``msgspec.Raw``, no Python int
per token); this kernel parses them all into one uint32 arena, validating strictly: only
non-negative integers below 2**32, no fractions, exponents or leading zeros. Token lists are
most of a JSON body, so this pass is most of the JSON ingest cost (docs/performance.md).

This module imports numba: ``json_codec`` imports it on first use only, so that importing
``kvatlas.events`` (and every client) stays free of numba. Keep it that way.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numba
import numpy as np
import numpy.typing as npt


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _is_space(c: int) -> bool:  # pragma: no cover - compiled
    return c == 32 or c == 9 or c == 10 or c == 13


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _parse_lists(buf, starts, ends, arena, lengths):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse ``buf[starts[j]:ends[j]]`` as a JSON int array (or ``null``: length 0) into
    ``arena``; returns the index of the first invalid list, or -1 when all are valid.
    ``lengths[j]`` gets each count."""
    k = 0
    for j in range(len(starts)):
        i = starts[j]
        n = ends[j]
        first = k
        while i < n and _is_space(buf[i]):
            i += 1
        if i + 4 <= n and buf[i] == 110 and buf[i + 1] == 117 and buf[i + 2] == 108:
            if buf[i + 3] != 108:  # "null": no tokens, as an empty list
                return j
            i += 4
            while i < n and _is_space(buf[i]):
                i += 1
            if i != n:
                return j
            lengths[j] = 0
            continue
        if i >= n or buf[i] != 91:  # '['
            return j
        i += 1
        while i < n and _is_space(buf[i]):
            i += 1
        if i < n and buf[i] == 93:  # ']': the empty list, then nothing but white space
            i += 1
            while i < n and _is_space(buf[i]):
                i += 1
            if i != n:
                return j
            lengths[j] = 0
            continue
        ok = False
        while i < n:
            while i < n and _is_space(buf[i]):
                i += 1
            if i >= n or buf[i] < 48 or buf[i] > 57:
                break
            if buf[i] == 48 and i + 1 < n and 48 <= buf[i + 1] <= 57:
                break  # leading zero
            v = 0
            digits = 0
            while i < n and 48 <= buf[i] <= 57:
                v = v * 10 + (buf[i] - 48)
                digits += 1
                i += 1
            if digits > 10 or v > 4294967295 or k >= len(arena):
                break
            arena[k] = v
            k += 1
            while i < n and _is_space(buf[i]):
                i += 1
            if i < n and buf[i] == 44:  # ','
                i += 1
                continue
            if i < n and buf[i] == 93:
                i += 1
                ok = True
            break
        if not ok:
            return j
        while i < n and _is_space(buf[i]):
            i += 1
        if i != n:
            return j
        lengths[j] = k - first
    return -1


def parse_token_lists(
    raws: Sequence[bytes | msgspec.Raw],
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64], int]:
    """Parse JSON int arrays (``null`` reads as empty); returns ``(arena, lengths, bad)`` where
    ``bad`` is the index of the first invalid list (-1 if none). List ``j`` occupies
    ``arena[offsets[j]:...]``. ``raws`` may be msgspec's ``Raw`` slices of a body: joined in
    one copy, never converted one by one."""
    joined = b"".join(raws)  # type: ignore[arg-type]  # Raw has the buffer protocol
    buf = np.frombuffer(joined, dtype=np.uint8)
    sizes = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
    ends = np.cumsum(sizes)
    starts = ends - sizes
    arena = np.empty(len(joined) // 2 + 1, dtype=np.uint32)  # a token needs >= 2 bytes ("1,")
    lengths = np.zeros(len(raws), dtype=np.int64)
    bad = int(_parse_lists(buf, starts, ends, arena, lengths)) if raws else -1
    return arena, lengths, bad
