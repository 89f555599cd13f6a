"""The planes form of a chunk's token ids: what the directory stores when an id is at least
2^16 and every id below 2^24 (vocabularies of 65,537 to 16,777,216 ids: Llama 3, Qwen, Gemma).

Exact, never a truncation: an id is its low 16 bits plus ``h`` high bits, where ``h`` is the
bit length of the chunk's largest id minus 16 (1 to 8), so ``n`` ids take
``2 + 2n + h·⌈n/8⌉`` bytes (256 ids of Llama 3's 128,256: 546 bytes, not uint32's 1,024).
One array of the dtype :data:`PLANES` (``V1``: no caller passes token ids as raw bytes, so
the form cannot be mistaken for ids), laid out as

- byte 0: ``h``; byte 1: 0;
- from byte 2: the ``n`` low halves, ``uint16`` in the machine's byte order (little-endian
  on every host kvatlas runs on: snapshots store the bytes as they are);
- then ``h`` bit planes of ``⌈n/8⌉`` bytes each: bit ``k & 7`` of byte ``k >> 3`` of plane
  ``p`` is bit ``16 + p`` of id ``k`` (unused bits 0).

The form is canonical (``h`` is the smallest that fits), so two stored contents of one form
are equal exactly when their bytes are. The kernels here are the only code that reads or
writes the bit planes; the blend index compares a query against a stored content without
widening it (:func:`planes_equal`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.pointers import inline, jit, u8_ptr, u16_ptr, u32_ptr

PLANES = np.dtype("V1")
"""The dtype of a stored content in the planes form (this object: other ``V1`` dtypes are
not it)."""
HEADER = 2
"""Bytes before the low halves: ``h`` and a zero (keeps the halves 2-byte aligned)."""
MAX_HIGH_BITS = 8
"""Ids below 2^(16 + 8) fit the form; a chunk with a larger id is stored as ``uint32``."""
FORM_U16, FORM_U32, FORM_PLANES = 2, 4, 16
"""Form codes (a snapshot's ``chunk_token_widths``): bytes per id of the ``uint16`` and
``uint32`` forms; the planes form is ``FORM_PLANES + h``."""


@inline
def planes_nbytes(n: Any, h: Any) -> Any:
    """Bytes of ``n`` ids in the planes form with ``h`` high bits."""
    return HEADER + 2 * n + h * ((n + 7) >> 3)


@inline
def form_of(high: Any) -> Any:
    """The form code of a chunk whose ids OR to ``high`` (the bit length of the OR is the
    bit length of the largest id)."""
    if high < 1 << 16:
        return FORM_U16
    if high >= 1 << (16 + MAX_HIGH_BITS):
        return FORM_U32
    h = 1
    while high >> (16 + h):
        h += 1
    return FORM_PLANES + h


def stored_nbytes(n: int, form: int) -> int:
    """Bytes of ``n`` ids stored in form ``form`` (a form code)."""
    if form in (FORM_U16, FORM_U32):
        return n * form
    return HEADER + 2 * n + (form - FORM_PLANES) * ((n + 7) >> 3)


def planes_count(stored: npt.NDArray[Any]) -> int:
    """How many ids a planes-form array holds (``ValueError`` if it is not a valid one)."""
    size = len(stored)
    h = stored.item(0)[0] if size >= HEADER else 0  # (item: a 1-byte bytes, no view made)
    if not 1 <= h <= MAX_HIGH_BITS:
        raise ValueError("not a planes-form token array (bad header)")
    # size - 2 = 2n + h·⌈n/8⌉ lies in [(16 + h)·⌈n/8⌉ - 14, (16 + h)·⌈n/8⌉]: one ⌈n/8⌉ fits
    eighths = -(-(size - HEADER) // (16 + h))
    twice = size - HEADER - h * eighths
    n = twice // 2
    if twice < 0 or twice % 2 or (n + 7) >> 3 != eighths:
        raise ValueError("not a planes-form token array (bad length)")
    return n


@jit
def planes_store(src: Any, n: Any, dst: Any, h: Any) -> None:
    """Write the ``n`` ids at address ``src`` (``uint32``, each below 2^(16 + h)) in the
    planes form to address ``dst`` (``planes_nbytes(n, h)`` bytes)."""
    s: Any = u32_ptr(src)  # type: ignore[call-arg]
    head: Any = u8_ptr(dst)  # type: ignore[call-arg]
    head[0] = np.uint8(h)
    head[1] = np.uint8(0)
    low: Any = u16_ptr(dst + HEADER)  # type: ignore[call-arg]
    for k in range(n):
        low[k] = np.uint16(s[k] & np.uint32(0xFFFF))
    stride = (n + 7) >> 3
    planes: Any = u8_ptr(dst + HEADER + 2 * n)  # type: ignore[call-arg]
    for p in range(h):
        shift = np.uint32(16 + p)
        for j in range(stride):
            byte = np.uint32(0)
            for b in range(min(8, n - 8 * j)):
                byte |= ((s[8 * j + b] >> shift) & np.uint32(1)) << np.uint32(b)
            planes[p * stride + j] = np.uint8(byte)


@jit
def planes_load(out: Any, addr: Any, n: Any) -> None:
    """``out[:n]`` (``uint32``) = the ``n`` ids of the planes-form content at ``addr``."""
    h = np.int64(u8_ptr(addr)[0])  # type: ignore[call-arg]
    low: Any = u16_ptr(addr + HEADER)  # type: ignore[call-arg]
    for k in range(n):
        out[k] = np.uint32(low[k])
    stride = (n + 7) >> 3
    planes: Any = u8_ptr(addr + HEADER + 2 * n)  # type: ignore[call-arg]
    for p in range(h):
        shift = np.uint32(16 + p)
        row = p * stride
        for k in range(n):
            bit = (np.uint32(planes[row + (k >> 3)]) >> np.uint32(k & 7)) & np.uint32(1)
            out[k] |= bit << shift


@jit
def planes_equal(q: Any, pos: Any, addr: Any, chunk: Any) -> Any:
    """``q[pos:pos+chunk]`` equals the planes-form content of ``chunk`` ids at ``addr``: the
    low halves compared 64 at a time (an OR of XORs, SIMD), then the high bits of the block,
    stopping at the first differing block."""
    h = np.int64(u8_ptr(addr)[0])  # type: ignore[call-arg]
    low: Any = u16_ptr(addr + HEADER)  # type: ignore[call-arg]
    stride = (chunk + 7) >> 3
    planes: Any = u8_ptr(addr + HEADER + 2 * chunk)  # type: ignore[call-arg]
    k = 0
    while k < chunk:
        end = min(k + 64, chunk)
        diff = np.uint32(0)
        for i in range(k, end):
            diff |= (q[pos + i] & np.uint32(0xFFFF)) ^ np.uint32(low[i])
        if diff != 0:
            return False
        for i in range(k, end):
            high = np.uint32(0)
            for p in range(h):
                bit = (np.uint32(planes[p * stride + (i >> 3)]) >> np.uint32(i & 7)) & 1
                high |= np.uint32(bit) << np.uint32(p)
            diff |= (q[pos + i] >> np.uint32(16)) ^ high
        if diff != 0:
            return False
        k = end
    return True
