"""Strict base64 decoding of query tokens in one compiled pass.

A long query's ``tokens_b64`` is the largest text a blend lookup decodes, and the standard
library's decoder is a visible share of the request's server time (docs/performance.md). This
kernel decodes the standard alphabet with mandatory padding (also the URL-safe alphabet, and
line-wrapped input) and rejects anything else: it accepts exactly what is unambiguous.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

_WHITESPACE = (b"\n", b"\r", b" ", b"\t")
_INVALID = 255
_PAD = 254


def _table() -> npt.NDArray[np.uint8]:
    table = np.full(256, _INVALID, dtype=np.uint8)
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    for value, char in enumerate(alphabet):
        table[char] = value
    table[ord("-")], table[ord("_")] = 62, 63  # URL-safe alphabet: same values, no ambiguity
    table[ord("=")] = _PAD
    return table


_TABLE = _table()


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _decode(src, table, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Returns the number of bytes written, or -1 for invalid input."""
    n = len(src)
    if n % 4:
        return -1
    k = 0
    for i in range(0, n, 4):
        a = table[src[i]]
        b = table[src[i + 1]]
        c = table[src[i + 2]]
        d = table[src[i + 3]]
        if a >= 64 or b >= 64:
            return -1
        if c == 254 or d == 254:  # padding: only in the last quartet, "x=" or "=="
            if i + 4 != n or (c == 254 and d != 254) or (c != 254 and c >= 64):
                return -1
            out[k] = (a << 2) | (b >> 4)
            k += 1
            if c != 254:
                out[k] = ((b & 15) << 4) | (c >> 2)
                k += 1
            return k
        if c >= 64 or d >= 64:
            return -1
        out[k] = (a << 2) | (b >> 4)
        out[k + 1] = ((b & 15) << 4) | (c >> 2)
        out[k + 2] = ((c & 3) << 6) | d
        k += 3
    return k


def b64decode_strict(text: str | bytes) -> npt.NDArray[np.uint8] | None:
    """Decoded bytes as a uint8 array, or ``None`` if ``text`` is not valid padded base64.

    Liberal where it is unambiguous — ASCII whitespace is ignored and the URL-safe alphabet is
    accepted — and strict otherwise: any other character, missing or misplaced padding."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    if any(space in raw for space in _WHITESPACE):  # line-wrapped encoders (MIME, encodebytes)
        raw = raw.translate(None, b"".join(_WHITESPACE))
    src = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(len(raw) // 4 * 3, dtype=np.uint8)
    n = int(_decode(src, _TABLE, out)) if len(raw) else 0
    return None if n < 0 else out[:n]
