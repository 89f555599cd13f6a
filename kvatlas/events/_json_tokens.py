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
def _digit(c):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The digit ``c`` stands for, or -1."""
    d = np.int64(c) - 48
    return d if 0 <= d <= 9 else -1


@numba.njit(cache=True, nogil=True, boundscheck=False)
def skip_space(buf, i, n):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    while i < n and _is_space(buf[i]):
        i += 1
    return i


@numba.njit(cache=True, nogil=True, boundscheck=False)
def parse_array(buf, i, n, arena, k):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse the JSON int array at ``buf[i]`` (``i`` must point at its ``[``, ``n`` bounds
    the text) into ``arena[k:]``; returns ``(end, k)``: the index just after its ``]`` and
    the new fill of the arena, or ``end == -1`` when it is not a valid array of integers in
    [0, 2**32) (or the arena is full). The common separator (a comma right after a number)
    is checked first; a number is read to at most 10 digits (an 11th: too large)."""
    cap = len(arena)
    i = skip_space(buf, i + 1, n)
    if i < n and buf[i] == 93:  # ']': the empty list
        return i + 1, k
    while i < n:
        d = _digit(buf[i])
        if d < 0:  # white space before a number
            i = skip_space(buf, i, n)
            if i >= n:
                break
            d = _digit(buf[i])
            if d < 0:
                break
        i += 1
        v = d
        if d == 0:
            if i < n and _digit(buf[i]) >= 0:
                break  # leading zero
        else:  # at most 10 digits (no overflow in int64), then one range check
            stop = min(i + 9, n)
            while i < stop:
                e = _digit(buf[i])
                if e < 0:
                    break
                v = v * 10 + e
                i += 1
            if v > 4294967295 or (i < n and _digit(buf[i]) >= 0):
                break
        if k >= cap:
            break
        arena[k] = v
        k += 1
        if i < n and buf[i] == 44:  # ',' right after the number
            i += 1
            continue
        i = skip_space(buf, i, n)
        if i < n and buf[i] == 44:
            i += 1
            continue
        if i < n and buf[i] == 93:  # ']'
            return i + 1, k
        break
    return -1, k


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _parse_lists(buf, starts, ends, arena, lengths):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Parse ``buf[starts[j]:ends[j]]`` as a JSON int array (or ``null``: length 0) into
    ``arena``; returns the index of the first invalid list, or -1 when all are valid.
    ``lengths[j]`` gets each count."""
    k = 0
    for j in range(len(starts)):
        n = ends[j]
        i = skip_space(buf, starts[j], n)
        if i + 4 <= n and buf[i] == 110:  # "null": no tokens, as an empty list
            if buf[i + 1] != 117 or buf[i + 2] != 108 or buf[i + 3] != 108:
                return j
            if skip_space(buf, i + 4, n) != n:
                return j
            lengths[j] = 0
            continue
        if i >= n or buf[i] != 91:  # '['
            return j
        end, filled = parse_array(buf, i, n, arena, k)
        if end < 0 or skip_space(buf, end, n) != n:
            return j
        lengths[j] = filled - k
        k = filled
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
