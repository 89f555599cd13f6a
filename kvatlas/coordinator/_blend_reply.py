"""The blend-lookup reply written from the index's match columns in one compiled pass.

The bytes are exactly those of ``kvatlas.api.BlendReply`` built by ``wire.blend_to_wire``
(the wire shape has one definition; the tests compare the two on random matches), without an
object and a hex string per match in Python (docs/performance.md).

The reply is on the serving path of every blend lookup: its constant texts are the kernel's
own (numba freezes global arrays; each array argument costs its call ≈0.25 µs to unbox), a
hash's byte is written as two hex digits by one table read, and an offset below 2^32 (every
offset a query can have) by counted digits written two at a time, divided by 100 without a
division; larger and negative ones by the general loop.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from kvatlas.directory import MatchColumns
from kvatlas.directory.blend.op_checks import HASH_WIDTH

_HEX_PAIRS = np.frombuffer(b"".join(b"%02x" % b for b in range(256)), np.uint8)
"""``"00"`` to ``"ff"``: a byte's two hex digits at ``2 * byte``."""
_HEAD = np.frombuffer(b'{"matches":[', np.uint8)
_HASH = np.frombuffer(b'{"chunk_hash":"', np.uint8)
_OLD_ST = np.frombuffer(b'","old_st":', np.uint8)
_CUR_ST = np.frombuffer(b',"cur_st":', np.uint8)
_TAIL_ON = np.frombuffer(b'],"enable_blend_lookup":true}', np.uint8)
_TAIL_OFF = np.frombuffer(b'],"enable_blend_lookup":false}', np.uint8)
_PER_MATCH = len(_HASH) + len(_OLD_ST) + len(_CUR_ST) + 2 * 20 + 2  # "}", ","; ints <= 20
_FIXED = len(_HEAD) + len(_TAIL_OFF)
_DECIMAL_PAIRS = np.frombuffer("".join(f"{i:02d}" for i in range(100)).encode(), np.uint8)
"""``"00"`` to ``"99"``: two digits a step."""
_DIV100 = 1374389535
"""``(v * _DIV100) >> 37 == v // 100`` for every ``v`` below 2^32 (no division)."""
_POWERS = 10 ** np.arange(10, dtype=np.int64)
"""``10^n``: an offset below 2^32 has ``n`` digits for the first ``10^n`` above it."""


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put(out, k, text):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for i in range(len(text)):
        out[k + i] = text[i]
    return k + len(text)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put_int(out, k, value):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``value`` (int64) in decimal, as JSON writes it: below 2^32 by counted digits written
    two at a time from the right, divided by 100 without a division (a reply's few offsets:
    the prefix lookup's 32,768 ids are written by groups of four, ``_lookup_reply``)."""
    if 0 <= value < 4294967296:
        v = np.int64(value)
        n = 1
        while n < 10 and v >= _POWERS[n]:
            n += 1
        e = k + n
        while v >= 100:
            q = (v * _DIV100) >> 37
            r = 2 * (v - 100 * q)
            out[e - 1] = _DECIMAL_PAIRS[r + 1]
            out[e - 2] = _DECIMAL_PAIRS[r]
            e -= 2
            v = q
        if v >= 10:
            out[e - 1] = _DECIMAL_PAIRS[2 * v + 1]
            out[e - 2] = _DECIMAL_PAIRS[2 * v]
        else:
            out[e - 1] = 48 + v
        return k + n
    return _put_wide(out, k, value)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put_wide(out, k, value):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Any int64 (unsigned arithmetic throughout: numba would take a uint64 mixed with a
    literal to float64)."""
    ten = np.uint64(10)
    v = np.uint64(value)
    if value < 0:
        out[k] = 45  # "-"
        k += 1
        v = np.uint64(0) - v
    digits = 1
    t = v
    while t >= ten:
        t //= ten
        digits += 1
    for i in range(digits - 1, -1, -1):
        out[k + i] = np.uint8(48) + np.uint8(v % ten)
        v //= ten
    return k + digits


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _write(blob, lengths, old, cur, enabled, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The whole reply into ``out``: the head, the matches' JSON objects comma-separated,
    the tail; returns the bytes written. ``lengths``: each hash's bytes in ``blob``, or empty
    when every hash has :data:`HASH_WIDTH`."""
    k = _put(out, 0, _HEAD)
    j = 0
    fixed = len(lengths) == 0
    for i in range(len(old)):
        if i:
            out[k] = 44  # ","
            k += 1
        k = _put(out, k, _HASH)
        for _ in range(HASH_WIDTH if fixed else lengths[i]):
            b = 2 * np.int64(blob[j])
            out[k] = _HEX_PAIRS[b]
            out[k + 1] = _HEX_PAIRS[b + 1]
            k += 2
            j += 1
        k = _put(out, k, _OLD_ST)
        k = _put_int(out, k, old[i])
        k = _put(out, k, _CUR_ST)
        k = _put_int(out, k, cur[i])
        out[k] = 125  # "}"
        k += 1
    return _put(out, k, _TAIL_ON if enabled else _TAIL_OFF)


_ALL_FIXED: npt.NDArray[np.uint8] = np.empty(0, np.uint8)


def blend_reply(columns: MatchColumns, enabled: bool) -> bytes:
    """The ``POST /directory/blend-lookup`` reply (without placements) of ``columns``."""
    blob = columns.hash_bytes
    lengths = _ALL_FIXED if columns.full_width else columns.hash_lengths
    out: npt.NDArray[np.uint8] = np.empty(
        _FIXED + columns.n_matches * _PER_MATCH + 2 * blob.shape[0], np.uint8
    )
    n = _write(blob, lengths, columns.old_st, columns.cur_st, enabled, out)
    return out[:n].tobytes()
