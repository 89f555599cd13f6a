"""The blend-lookup reply written from the index's match columns in one compiled pass.

The bytes are exactly those of ``kvatlas.api.BlendReply`` built by ``wire.blend_to_wire``
(the wire shape has one definition; the tests compare the two on random matches), without an
object and a hex string per match in Python (docs/performance.md).

The reply is on the serving path of every blend lookup: its constant texts are the kernel's
own (numba freezes global arrays; each array argument costs its call ≈0.25 µs to unbox), a
hash's bytes are written four at a time as eight hex digits by word arithmetic
(:func:`_hex8`; a hash whose length is not a multiple of four ends a byte at a time, by one
table read each), and an offset below 2^32 (every
offset a query can have) as the prefix lookup's reply writes its ids, by groups of four
digits (``_lookup_reply.put_u32``); larger and negative ones by the general loop.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from kvatlas.checks import refuse_big_endian
from kvatlas.coordinator._lookup_reply import GROUPS, SIGNIFICANT, put_u32
from kvatlas.directory import MatchColumns
from kvatlas.directory.blend.kernels.pointers import inline, u32_ptr, u64_ptr
from kvatlas.directory.blend.op_checks import HASH_WIDTH

refuse_big_endian("kvatlas's blend reply writer")

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


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put(out, k, text):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for i in range(len(text)):
        out[k + i] = text[i]
    return k + len(text)


_NIBBLES = np.uint64(0x000F000F000F000F)
_SIX = np.uint64(0x0606060606060606)
_ONES = np.uint64(0x0101010101010101)
_ZEROS = np.uint64(0x3030303030303030)  # "0" in every byte
_LETTERS = np.uint64(ord("a") - ord("0") - 10)


@inline
def _hex8(v):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The four bytes of ``v`` (``uint64`` below 2^32, the first byte its low one) as eight
    lower-case hex digits in one word, the first digit its low byte: each byte spread to 16
    bits, its high nibble to the even byte and its low nibble to the odd one, then each
    nibble ``n`` turned to ``"0" + n``, plus 39 where ``n >= 10`` (``n + 6`` carries into bit
    4 exactly then)."""
    s = (v | (v << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    s = (s | (s << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    n = ((s >> np.uint64(4)) & _NIBBLES) | ((s & _NIBBLES) << np.uint64(8))
    letters = ((n + _SIX) >> np.uint64(4)) & _ONES
    return n + _ZEROS + letters * _LETTERS


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put_int(out, k, value):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``value`` (int64) in decimal, as JSON writes it: below 2^32 as the prefix lookup's
    reply writes its ids (:func:`~kvatlas.coordinator._lookup_reply.put_u32`)."""
    if 0 <= value < 4294967296:
        return put_u32(out.ctypes.data, k, np.uint64(value), GROUPS, SIGNIFICANT)
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
    src = blob.ctypes.data
    dst = out.ctypes.data
    for i in range(len(old)):
        if i:
            out[k] = 44  # ","
            k += 1
        k = _put(out, k, _HASH)
        length = HASH_WIDTH if fixed else np.int64(lengths[i])
        end = j + length
        while j + 4 <= end:
            word = np.uint64(u32_ptr(src + j)[0])  # type: ignore[call-arg]
            u64_ptr(dst + k)[0] = _hex8(word)  # type: ignore[call-arg]
            k += 8
            j += 4
        while j < end:
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
