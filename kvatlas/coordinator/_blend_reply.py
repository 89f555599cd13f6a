"""The blend-lookup reply written from the index's match columns in one compiled pass.

The bytes are exactly those of ``kvatlas.api.BlendReply`` built by ``wire.blend_to_wire``
(the wire shape has one definition; the tests compare the two on random matches), without an
object and a hex string per match in Python (docs/performance.md).
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from kvatlas.directory import MatchColumns

_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_HASH = np.frombuffer(b'{"chunk_hash":"', np.uint8)
_OLD_ST = np.frombuffer(b'","old_st":', np.uint8)
_CUR_ST = np.frombuffer(b',"cur_st":', np.uint8)
_HEAD = b'{"matches":['
_TAIL = {True: b'],"enable_blend_lookup":true}', False: b'],"enable_blend_lookup":false}'}
_PER_MATCH = len(_HASH) + len(_OLD_ST) + len(_CUR_ST) + 2 * 20 + 2  # "}", ","; ints <= 20


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put(out, k, text):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for i in range(len(text)):
        out[k + i] = text[i]
    return k + len(text)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put_int(out, k, value):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``value`` (int64) in decimal, as JSON writes it (unsigned arithmetic throughout: numba
    would take a uint64 mixed with a literal to float64)."""
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
def _write(blob, lengths, old, cur, hexd, hash_, old_st, cur_st, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The matches' JSON objects, comma-separated, into ``out``; returns the bytes written."""
    k = 0
    j = 0
    for i in range(len(lengths)):
        if i:
            out[k] = 44  # ","
            k += 1
        k = _put(out, k, hash_)
        for _ in range(lengths[i]):
            b = blob[j]
            out[k] = hexd[b >> 4]
            out[k + 1] = hexd[b & 15]
            k += 2
            j += 1
        k = _put(out, k, old_st)
        k = _put_int(out, k, old[i])
        k = _put(out, k, cur_st)
        k = _put_int(out, k, cur[i])
        out[k] = 125  # "}"
        k += 1
    return k


def blend_reply(columns: MatchColumns, enabled: bool) -> bytes:
    """The ``POST /directory/blend-lookup`` reply (without placements) of ``columns``."""
    hashes = columns.chunk_hashes
    blob = b"".join(hashes)
    lengths = np.frombuffer(bytes(map(len, hashes)), np.uint8)  # each <= 32 bytes
    out: npt.NDArray[np.uint8] = np.empty(len(hashes) * _PER_MATCH + 2 * len(blob), np.uint8)
    n = _write(
        np.frombuffer(blob, np.uint8), lengths, columns.old_st, columns.cur_st,
        _HEX, _HASH, _OLD_ST, _CUR_ST, out,
    )  # fmt: skip
    return b"".join((_HEAD, out[:n].tobytes(), _TAIL[enabled]))
