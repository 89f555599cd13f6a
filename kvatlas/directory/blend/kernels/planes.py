"""The planes form of a chunk's token ids: what the directory stores when an id is at least
2^16, every id is below 2^24 (vocabularies of 65,537 to 16,777,216 ids: Llama 3, Qwen, Gemma)
and the form takes fewer bytes than ``uint32`` (always, for chunks of 64 ids and more).

Exact, never a truncation: an id is its low 16 bits plus ``h`` high bits, where ``h`` is the
bit length of the chunk's largest id minus 16 (1 to 8), so ``n`` ids take
``2 + 2n + 2h·⌈n/16⌉`` bytes (256 ids of Llama 3's 128,256: 546 bytes, not uint32's 1,024).
One array of the dtype :data:`PLANES` (``V1``: no caller passes token ids as raw bytes, so
the form cannot be mistaken for ids), laid out as

- byte 0: ``h``; byte 1: 0;
- from byte 2: the ``n`` low halves, ``uint16`` in the machine's byte order (little-endian
  on every host kvatlas runs on: snapshots store the bytes as they are);
- then ``h`` bit planes of ``2·⌈n/16⌉`` bytes each (an even size: contents cut from one
  buffer stay 2-byte aligned): bit ``k & 7`` of byte ``k >> 3`` of plane ``p`` is bit
  ``16 + p`` of id ``k`` (unused bits and bytes 0).

The form is canonical (``h`` is the smallest that fits), so two stored contents of one form
are equal exactly when their bytes are. The kernels here are the only code that reads or
writes the bit planes; the blend index compares a query against a stored content without
widening it (:func:`planes_equal`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.pointers import (
    BIT_COLUMN,
    bit_column,
    helper,
    inline,
    u8_ptr,
    u16_ptr,
    u32_ptr,
)

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
def plane_bytes(n: Any) -> Any:
    """Bytes of one bit plane of ``n`` ids."""
    return ((n + 15) >> 4) << 1


@inline
def planes_nbytes(n: Any, h: Any) -> Any:
    """Bytes of ``n`` ids in the planes form with ``h`` high bits."""
    return HEADER + 2 * n + h * plane_bytes(n)


@inline
def form_of(high: Any, n: Any) -> Any:
    """The form code of a chunk of ``n`` ids that OR to ``high`` (the bit length of the OR
    is the bit length of the largest id): the smallest form that holds them."""
    if high < 1 << 16:
        return FORM_U16
    if high >= 1 << (16 + MAX_HIGH_BITS):
        return FORM_U32
    h = 1
    while high >> (16 + h):
        h += 1
    if planes_nbytes(n, h) >= 4 * n:  # (a short chunk: the header and padding weigh)
        return FORM_U32
    return FORM_PLANES + h


def stored_nbytes(n: int, form: int) -> int:
    """Bytes of ``n`` ids stored in form ``form`` (a form code)."""
    if form in (FORM_U16, FORM_U32):
        return n * form
    return HEADER + 2 * n + (form - FORM_PLANES) * (((n + 15) >> 4) << 1)


def planes_count(stored: npt.NDArray[Any]) -> int:
    """How many ids a planes-form array holds (``ValueError`` if it is not a valid one)."""
    size = len(stored)
    h = stored.item(0)[0] if size >= HEADER else 0  # (item: a 1-byte bytes, no view made)
    if not 1 <= h <= MAX_HIGH_BITS:
        raise ValueError("not a planes-form token array (bad header)")
    n, sixteenths = planes_ids(size, h)
    if size % 2 or n < 0 or (n + 15) >> 4 != sixteenths:
        raise ValueError("not a planes-form token array (bad length)")
    return n


def planes_ids(size: int, h: int) -> tuple[int, int]:
    """``(n, ⌈n/16⌉)`` of a valid planes-form array of ``size`` bytes: ``(size - 2) / 2 =
    n + h·⌈n/16⌉`` lies in ``[(16 + h)·⌈n/16⌉ - 15, (16 + h)·⌈n/16⌉]``, so one ``⌈n/16⌉``
    fits (16 + h > 15); ``contents._count`` computes the same, compiled."""
    half = (size - HEADER) // 2
    sixteenths = -(-half // (16 + h))
    return half - h * sixteenths, sixteenths


@helper
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
    stride = plane_bytes(n)
    planes: Any = u8_ptr(dst + HEADER + 2 * n)  # type: ignore[call-arg]
    for p in range(h):
        shift = np.uint32(16 + p)
        for j in range(stride):
            byte = np.uint32(0)
            for b in range(min(8, n - 8 * j)):
                byte |= ((s[8 * j + b] >> shift) & np.uint32(1)) << np.uint32(b)
            planes[p * stride + j] = np.uint8(byte)


@helper
def planes_load(out: Any, addr: Any, n: Any) -> None:
    """``out[:n]`` (``uint32``) = the ``n`` ids of the planes-form content at ``addr``. Each
    whole block of 64 ids takes a plane's bits from one 64-bit word, at a constant trip count
    (SIMD: a variable shift a lane); the last, shorter block one byte at a time."""
    h = np.int64(u8_ptr(addr)[0])  # type: ignore[call-arg]
    low: Any = u16_ptr(addr + HEADER)  # type: ignore[call-arg]
    for k in range(n):
        out[k] = np.uint32(low[k])
    stride = plane_bytes(n)
    planes: Any = u8_ptr(addr + HEADER + 2 * n)  # type: ignore[call-arg]
    whole = n - n % BIT_COLUMN
    for p in range(h):
        shift = np.uint32(16 + p)
        row = p * stride
        for k0 in range(0, whole, BIT_COLUMN):
            word = _plane_word(planes, row + (k0 >> 3), 8)
            for k in range(BIT_COLUMN):
                bit = np.uint32((word >> np.uint64(k)) & np.uint64(1))
                out[k0 + k] |= bit << shift
        for k in range(whole, n):
            bit = (np.uint32(planes[row + (k >> 3)]) >> np.uint32(k & 7)) & np.uint32(1)
            out[k] |= bit << shift


@inline
def _plane_word(planes: Any, at: Any, nbytes: Any) -> Any:
    """``nbytes`` (at most 8) bytes of the planes from byte ``at``, as a little-endian word
    (a whole block's 8 bytes compile to one load)."""
    word = np.uint64(0)
    for b in range(nbytes):
        word |= np.uint64(planes[at + b]) << np.uint64(8 * b)
    return word


@helper
def planes_equal(q: Any, pos: Any, addr: Any, chunk: Any) -> Any:
    """``q[pos:pos+chunk]`` (a contiguous ``uint32`` array) equals the planes-form content of
    ``chunk`` ids at ``addr``. Per block of 64 ids, stopping at the first differing one: an
    OR of ``id ^ low half`` over the block (SIMD) must be zero in its low 16 bits (the low
    halves agree) and above the planes (no id too large); then each plane is one 64-bit word
    against the same bit of the block's ids (:func:`bit_column`). Whole blocks run with a
    constant trip count (what makes the loop SIMD); the last, shorter block, if any, gathers
    its bits one id at a time."""
    h = np.int64(u8_ptr(addr)[0])  # type: ignore[call-arg]
    low: Any = u16_ptr(addr + HEADER)  # type: ignore[call-arg]
    stride = plane_bytes(chunk)
    planes: Any = u8_ptr(addr + HEADER + 2 * chunk)  # type: ignore[call-arg]
    top = np.uint32(16 + h)
    if q.strides[0] != 4:  # read through its address: any other layout would be misread
        raise ValueError("planes_equal: the query must be a contiguous uint32 array")
    start = q.ctypes.data + 4 * pos
    ids: Any = u32_ptr(start)  # type: ignore[call-arg]
    whole = chunk - chunk % BIT_COLUMN
    for k in range(0, whole, BIT_COLUMN):
        acc = np.uint32(0)
        for i in range(BIT_COLUMN):
            acc |= ids[k + i] ^ np.uint32(low[k + i])
        if (acc & np.uint32(0xFFFF)) != 0 or (acc >> top) != 0:
            return False
        for p in range(h):
            column: Any = bit_column(start + 4 * k, np.uint32(16 + p))  # type: ignore[call-arg]
            if column != _plane_word(planes, p * stride + (k >> 3), 8):
                return False
    if whole == chunk:
        return True
    acc = np.uint32(0)
    for i in range(whole, chunk):
        acc |= ids[i] ^ np.uint32(low[i])
    if (acc & np.uint32(0xFFFF)) != 0 or (acc >> top) != 0:
        return False
    for p in range(h):
        shift = np.uint32(16 + p)
        bits = np.uint64(0)
        for i in range(whole, chunk):
            bits |= np.uint64((ids[i] >> shift) & np.uint32(1)) << np.uint64(i - whole)
        if bits != _plane_word(planes, p * stride + (whole >> 3), (chunk - whole + 7) >> 3):
            return False
    return True
