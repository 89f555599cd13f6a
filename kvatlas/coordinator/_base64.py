"""Strict base64 decoding of query tokens.

A long query's ``tokens_b64`` is the largest text a blend lookup decodes (175 KB for 32k
tokens). pybase64 decodes it with libbase64's SIMD codec for the machine it runs on (chosen at
run time: AVX2, AVX-512 VBMI, NEON, …), and refuses what is not the strict language while
decoding (``validate=True``): ≈3× faster than a compiled kernel of vector blocks, which this
module held before (docs/performance.md). The standard alphabet with mandatory padding, ``=``
only as the last one or two characters of a length that is a multiple of 4 (``xxx=``,
``xx==``), is what it takes; the URL-safe alphabet (``-``, ``_``, mixed with ``+``, ``/`` or
not) is accepted as a second try, and ASCII whitespace (line-wrapped encoders) by
:func:`b64decode_strict` only: both unambiguous. Anything else is refused.
"""

from __future__ import annotations

import binascii
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import pybase64

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc's from Python 3.12

_WHITESPACE = b" \t\r\n"
_URL_SAFE = bytes.maketrans(b"-_", b"+/")


def decode_base64(src: Buffer) -> npt.NDArray[np.uint8] | None:
    """``src`` (a contiguous buffer of ASCII bytes) decoded, as a writable array of its own,
    or ``None`` unless it is padded base64 of either alphabet with nothing else in it (no
    whitespace: see :func:`b64decode_strict`)."""
    decoded = _decoded(src)
    if decoded is None:
        text = bytes(src)
        standard = text.translate(_URL_SAFE)
        if standard == text:
            return None
        decoded = _decoded(standard)
    return None if decoded is None else np.frombuffer(decoded, np.uint8)


def _decoded(src: Buffer) -> bytearray | None:
    try:
        return pybase64.b64decode_as_bytearray(src, validate=True)
    except (binascii.Error, ValueError):
        return None


def b64decode_strict(text: str | bytes) -> npt.NDArray[np.uint8] | None:
    """Decoded bytes as a uint8 array, or ``None`` if ``text`` is not valid padded base64.

    Liberal where it is unambiguous — ASCII whitespace is ignored and the URL-safe alphabet is
    accepted — and strict otherwise: any other character, missing or misplaced padding."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    decoded = decode_base64(raw)
    if decoded is None and any(space in raw for space in _WHITESPACE):
        decoded = decode_base64(raw.translate(None, _WHITESPACE))
    return decoded
