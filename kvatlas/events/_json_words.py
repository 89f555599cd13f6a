"""Machine words and vectors for the JSON number parser (``_json_tokens``): unaligned 8-byte
loads, trailing zeros, a number's digits to its value (one a word, four a vector), and the
masks of a 64-byte block's digits, commas and zeros.

The vector forms are for little-endian machines, where a word's first byte is its lowest
(the word-at-a-time forms stand in elsewhere). This module imports numba (see
``_json_tokens``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvatlas.kernel_twins import njit_without_nrt


@intrinsic
def trailing_zeros(typingctx: Any, x: Any) -> Any:
    """Count of trailing zero bits of a non-zero ``uint64`` (one instruction)."""
    sig = types.uint64(types.uint64)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


ONES = np.uint64(0x0101010101010101)
ZEROS = np.uint64(0x3030303030303030)  # eight ASCII '0'
ABOVE_NINE = np.uint64(0x4646464646464646)  # 0x80 - ':' per byte: a byte > '9' sets its top bit
TOPS = np.uint64(0x8080808080808080)
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_LOW_BYTES = np.uint64(0x00FF00FF00FF00FF)
_LOW_PAIRS = np.uint64(0x0000FFFF0000FFFF)
U64_8, _U64_16, _U64_32, U64_64 = np.uint64(8), np.uint64(16), np.uint64(32), np.uint64(64)
_BY_10 = np.uint64(10 * 256 + 1)
_BY_100 = np.uint64(100 * 65536 + 1)
_BY_10000 = np.uint64(10000 * (1 << 32) + 1)


def item_pointer(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """In an intrinsic ``(array, index)``: the address of ``array[index]`` (no bounds check:
    the caller's)."""
    aryty = signature.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
        context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
    )


@intrinsic
def _load_word(typingctx: Any, buf: Any, i: Any) -> Any:
    """``buf[i:i + 8]`` as one unaligned 64-bit load (no bounds check: the caller's)."""
    sig = types.uint64(buf, i)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = item_pointer(context, builder, signature, args)
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _assembled_word(buf, i):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """:func:`_load_word`, byte by byte (big-endian machines)."""
    x = np.uint64(0)
    for t in range(8):
        x |= np.uint64(buf[i + t]) << np.uint64(8 * t)
    return x


word = _load_word if sys.byteorder == "little" else _assembled_word
"""``buf[i:i + 8]`` as a little-endian ``uint64``."""


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def digits_value(x, bits):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The value of the decimal digits that are the low ``bits // 8`` bytes of ``x`` (1–8 of
    them, little-endian: the first digit in the lowest byte)."""
    v = (x << (U64_64 - bits)) & _LOW_NIBBLES  # the digits at the top, zeros before them
    v = (v * _BY_10) >> U64_8  # pairs of digits
    v = ((v & _LOW_BYTES) * _BY_100) >> _U64_16  # fours
    return ((v & _LOW_PAIRS) * _BY_10000) >> _U64_32  # eights


_SEVEN_BITS = np.uint64(0x7F7F7F7F7F7F7F7F)
_GATHER_TOPS = np.uint64(0x0002040810204081)  # the top bit of byte j to bit 56 + j
_U64_56 = np.uint64(56)
BLOCK = 64
"""Bytes a mask covers (:func:`masks`)."""


_COMMAS = np.uint64(0x2C2C2C2C2C2C2C2C)  # eight ASCII ','
ALL_BITS = np.uint64(0xFFFFFFFFFFFFFFFF)
TOP_BIT = np.uint64(1 << 63)
U64_1 = np.uint64(1)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _gathered(tops, j):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The top bits of word ``j``'s eight bytes (``tops``) as bits ``8 * j`` to ``8 * j + 7``."""
    return ((tops * _GATHER_TOPS) >> _U64_56) << np.uint64(8 * j)


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def swar_masks(buf, b):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """:func:`masks` eight bytes a word (big-endian machines). Exact for every byte: each
    byte's top bit is set (or cleared) before the subtraction or addition that tests it, so
    no borrow or carry crosses into the next."""
    digits = commas = zeros = np.uint64(0)
    for j in range(8):
        x = word(buf, b + 8 * j)  # type: ignore[call-arg]
        low = x & _SEVEN_BITS
        digits |= _gathered(((low | TOPS) - ZEROS) & ~(low + ABOVE_NINE) & ~x & TOPS, j)
        commas |= _gathered(_equal_tops(x, _COMMAS), j)
        zeros |= _gathered(_equal_tops(x, ZEROS), j)
    return digits, commas, zeros


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _equal_tops(x, pattern):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The top bit of each byte of ``x`` equal to ``pattern``'s (its eight bytes alike), set;
    every other bit clear. Exact for every byte (the low seven bits are added apart)."""
    y = x ^ pattern  # a byte equal to the pattern's: zero
    return ~(((y & _SEVEN_BITS) + _SEVEN_BITS) | y) & TOPS


@intrinsic
def _vector_masks(typingctx: Any, buf: Any, b: Any) -> Any:
    """:func:`masks` as one vector of 64 bytes and three compares (``byte - '0' < 10``
    unsigned, ``byte == ','``, ``byte == '0'`` per lane), each's 64 lanes' flags as a mask's
    bits (lane ``t``, bit ``t``: little-endian). LLVM lowers them to the machine's vector
    compares (AVX-512: a compare into a mask register and a move each; AVX2: two halves and
    their byte masks), where the word-by-word form takes ≈80 instructions a mask."""
    sig = types.UniTuple(types.uint64, 3)(buf, b)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = item_pointer(context, builder, signature, args)
        lanes = ir.VectorType(ir.IntType(8), BLOCK)
        block = builder.load(builder.bitcast(ptr, lanes.as_pointer()), align=1)

        def bits(flags: Any) -> Any:
            return builder.bitcast(flags, ir.IntType(BLOCK))

        above_zero = builder.sub(block, ir.Constant(lanes, [48] * BLOCK))
        digits = builder.icmp_unsigned("<", above_zero, ir.Constant(lanes, [10] * BLOCK))
        commas = builder.icmp_unsigned("==", block, ir.Constant(lanes, [44] * BLOCK))
        zeros = builder.icmp_unsigned("==", block, ir.Constant(lanes, [48] * BLOCK))
        return context.make_tuple(
            builder, signature.return_type, [bits(digits), bits(commas), bits(zeros)]
        )

    return sig, codegen


masks = _vector_masks if sys.byteorder == "little" else swar_masks
"""``(digits, commas, zeros)`` of the block at ``buf[b]``: bit ``t`` of each set iff
``buf[b + t]`` is an ASCII digit, ``,``, ``0``, for ``t`` < 64 (the caller's bounds check:
``b + 64 <= len``)."""


@intrinsic
def _vector_values4(
    typingctx: Any,
    arena: Any,
    k: Any,
    x0: Any,
    x1: Any,
    x2: Any,
    x3: Any,
    s0: Any,
    s1: Any,
    s2: Any,
    s3: Any,
) -> Any:
    """:func:`values4` in four vector lanes: each word shifted, then :func:`digits_value`'s
    three steps as multiplies of pairs of 8-, 16- and 32-bit lanes (the low half of a pair
    the more significant: a little-endian word's first byte is its lowest), the four values
    stored at once."""
    sig = types.none(arena, k, x0, x1, x2, x3, s0, s1, s2, s3)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = item_pointer(context, builder, signature, args[:2])
        quad = ir.VectorType(ir.IntType(64), 4)
        words = shifts = ir.Constant(quad, ir.Undefined)
        for t in range(4):
            lane = ir.Constant(ir.IntType(32), t)
            words = builder.insert_element(words, args[2 + t], lane)
            shifts = builder.insert_element(shifts, args[6 + t], lane)
        v = builder.and_(builder.shl(words, shifts), ir.Constant(quad, [0x0F0F0F0F0F0F0F0F] * 4))
        for bits, weight in ((16, 10), (32, 100), (64, 10000)):
            pairs = ir.VectorType(ir.IntType(bits), 256 // bits)
            w = builder.bitcast(v, pairs)
            low = builder.and_(w, ir.Constant(pairs, [(1 << bits // 2) - 1] * pairs.count))
            high = builder.lshr(w, ir.Constant(pairs, [bits // 2] * pairs.count))
            v = builder.add(builder.mul(low, ir.Constant(pairs, [weight] * pairs.count)), high)
        values = builder.trunc(v, ir.VectorType(ir.IntType(32), 4))
        builder.store(values, builder.bitcast(ptr, values.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def _word_values4(arena, k, x0, x1, x2, x3, s0, s1, s2, s3):  # type: ignore[no-untyped-def]  # pragma: no cover
    """:func:`values4` word by word (big-endian machines)."""
    arena[k] = digits_value(x0, U64_64 - s0)
    arena[k + 1] = digits_value(x1, U64_64 - s1)
    arena[k + 2] = digits_value(x2, U64_64 - s2)
    arena[k + 3] = digits_value(x3, U64_64 - s3)


values4 = _vector_values4 if sys.byteorder == "little" else _word_values4
"""``values4(arena, k, x0, x1, x2, x3, s0, s1, s2, s3)``: ``arena[k + t]`` = the value of
the number whose digits are the low bytes of word ``xt`` (as :func:`word` reads it), ``st``
being ``64 - 8 * digits`` (1–8 digits: the shift that brings them to the top of the word),
for ``t`` < 4 (the caller's bounds check: ``k + 4 <= len(arena)``). A word of zeros reads as
0: the caller's lanes beyond its last number."""
