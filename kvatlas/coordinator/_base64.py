"""Strict base64 decoding of query tokens in one compiled pass.

A long query's ``tokens_b64`` is the largest text a blend lookup decodes, and the standard
library's decoder is a visible share of the request's server time (docs/performance.md). This
kernel decodes the standard alphabet with mandatory padding (also the URL-safe alphabet, and
line-wrapped input) and rejects anything else: it accepts exactly what is unambiguous.

A quartet is read as one 32-bit word and decoded with two loads from a table indexed by a
pair of characters (65,536 entries of 12 bits; the ≈4,096 valid pairs fill ≈12 KB of it, so
it stays in L1): two loads a quartet, cheaper than four per-position tables (one per character,
the 6 bits pre-shifted) or one shared table and a check per quartet (docs/performance.md).
Any pair holding a character outside the alphabet maps to ``0xF000``, checked once for
the whole text. The last quartet (padding) is decoded with the per-position tables.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
import numpy.typing as npt

_WHITESPACE = (b"\n", b"\r", b" ", b"\t")
_INVALID = 1 << 24
_PAD = ord("=")


def _tables() -> npt.NDArray[np.uint32]:
    tables = np.full((4, 256), _INVALID, dtype=np.uint32)
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    chars = [*enumerate(alphabet), (62, ord("-")), (63, ord("_"))]  # URL-safe: same values
    for position, shift in enumerate((18, 12, 6, 0)):
        for value, char in chars:
            tables[position, char] = value << shift
    return tables


_TABLES = _tables()
_BAD_PAIR = 0xF000


def _pair_table() -> npt.NDArray[np.uint16]:
    """Two characters, as the native ``uint16`` of their two bytes, to their 12 bits."""
    pairs = np.full(1 << 16, _BAD_PAIR, dtype=np.uint16)
    first, second = _TABLES[0] >> 18, _TABLES[1] >> 12  # the 6 bits of each character
    valid = np.flatnonzero(_TABLES[0] < _INVALID)
    c0, c1 = np.meshgrid(valid, valid, indexing="ij")
    native = np.stack([c0, c1], axis=-1).astype(np.uint8).reshape(-1).view(np.uint16)
    pairs[native] = ((first[c0] << 6) | second[c1]).reshape(-1)
    return pairs


_PAIRS = _pair_table()
_FIRST, _SECOND = (0, 16) if sys.byteorder == "little" else (16, 0)
"""Shifts of a quartet's first and second character pair within its native 32-bit word."""


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _decode(src, words, pairs, tables, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Returns the number of bytes written, or -1 for invalid input. ``words``: ``src``'s
    quartets but the last, as native uint32."""
    n = len(src)
    if n % 4:
        return -1
    if n == 0:
        return 0
    seen = np.uint32(0)
    first, second, low = np.uint32(_FIRST), np.uint32(_SECOND), np.uint32(0xFFFF)
    last = n // 4 - 1
    for q in range(last):  # every quartet but the last: no padding allowed
        x = words[q]
        a = np.uint32(pairs[(x >> first) & low])
        b = np.uint32(pairs[(x >> second) & low])
        seen |= a | b
        w = (a << np.uint32(12)) | b
        k = 3 * q
        out[k] = np.uint8(w >> np.uint32(16))
        out[k + 1] = np.uint8(w >> np.uint32(8))
        out[k + 2] = np.uint8(w)
    t0, t1, t2, t3 = tables[0], tables[1], tables[2], tables[3]
    k = 3 * last
    c, d = src[n - 2], src[n - 1]  # the last quartet: "xxxx", "xxx=" or "xx=="
    w = t0[src[n - 4]] | t1[src[n - 3]]
    if d != _PAD:
        w |= t2[c] | t3[d]
    elif c != _PAD:
        w |= t2[c]
    if seen >= _BAD_PAIR or w >= _INVALID:
        return -1
    tail = 3 if d != _PAD else (2 if c != _PAD else 1)
    for j in range(tail):
        out[k + j] = np.uint8(w >> (16 - 8 * j))
    return k + tail


def decode_base64(src: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8] | None:
    """``src`` (ASCII bytes) decoded, or ``None`` unless it is padded base64 with nothing else
    in it (no whitespace: see :func:`b64decode_strict`)."""
    out = np.empty(len(src) // 4 * 3, dtype=np.uint8)
    words = src[: max(0, len(src) // 4 - 1) * 4].view(np.uint32)  # a view: no copy
    n = int(_decode(src, words, _PAIRS, _TABLES, out))
    return None if n < 0 else out[:n]


def b64decode_strict(text: str | bytes) -> npt.NDArray[np.uint8] | None:
    """Decoded bytes as a uint8 array, or ``None`` if ``text`` is not valid padded base64.

    Liberal where it is unambiguous — ASCII whitespace is ignored and the URL-safe alphabet is
    accepted — and strict otherwise: any other character, missing or misplaced padding."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    decoded = decode_base64(np.frombuffer(raw, dtype=np.uint8))
    if decoded is None and any(space in raw for space in _WHITESPACE):
        # line-wrapped encoders (MIME, encodebytes): whitespace is invalid to the kernel
        raw = raw.translate(None, b"".join(_WHITESPACE))
        decoded = decode_base64(np.frombuffer(raw, dtype=np.uint8))
    return decoded
