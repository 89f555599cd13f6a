"""Strict base64 decoding of query tokens in one compiled pass.

A long query's ``tokens_b64`` is the largest text a blend lookup decodes, and the standard
library's decoder is a visible share of the request's server time (docs/performance.md). This
kernel decodes the standard alphabet with mandatory padding (also the URL-safe alphabet, and
line-wrapped input) and rejects anything else: it accepts exactly what is unambiguous.

The text runs in blocks of 64 characters (:func:`_block_decoder`: 48 bytes out), each written
as vector operations — every character classified and mapped to its 6 bits, four of them
joined into 3 bytes, the 48 bytes picked out by one shuffle — which the compiler turns into
SIMD on any target (a 64-byte block on AVX-512); a loop written in Python does not compile to
it (numba widens byte arithmetic to 64 bits). The characters are mapped by range compares, one
per run of the alphabet, or where the machine has AVX-512 VBMI by one lookup in a table of 128
(``vpermi2b``: 14 against 25 µs for a 32k-token query's 175 KB, docs/performance.md). Any character outside
the alphabet sets a bit of the block's invalid mask, checked once for the whole text. The
quartets after the last whole block are read as 32-bit words and decoded with two loads from a
table indexed by a pair of characters (65,536 entries of 12 bits; a pair holding a character
outside the alphabet maps to ``0xF000``); the last quartet (padding) with per-position tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kvatlas.checks import refuse_big_endian

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
_FIRST, _SECOND = 0, 16
"""Shifts of a quartet's first and second character pair within its 32-bit word, read
little-endian: the byte order of every target numba compiles for (x86-64, AArch64,
ppc64le), checked at import."""
refuse_big_endian("kvatlas's base64 kernel")


_BLOCK = 64
"""Characters per vector block (:func:`_decode_block`): 16 quartets, 48 bytes out."""


def _alphabet_runs(tables: npt.NDArray[np.uint32]) -> tuple[tuple[int, int, int], ...]:
    """The alphabet of ``tables`` (both alphabets, written once in :func:`_tables`) as runs of
    consecutive characters with consecutive values: (first character, how many, its value)."""
    values = tables[0] >> 18
    runs: list[list[int]] = []
    for char in np.flatnonzero(tables[0] < _INVALID).tolist():
        value = int(values[char])
        if runs and runs[-1][0] + runs[-1][1] == char and runs[-1][2] + runs[-1][1] == value:
            runs[-1][1] += 1
        else:
            runs.append([char, 1, value])
    return tuple((first, count, value) for first, count, value in runs)


_RUNS = _alphabet_runs(_TABLES)


_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_CHARS, _WORDS = ir.VectorType(_I8, _BLOCK), ir.VectorType(_I32, _BLOCK // 4)


def _chars(x: int | list[int]) -> ir.Constant:
    return ir.Constant(_CHARS, x if isinstance(x, list) else [x] * _BLOCK)


def _words(x: int) -> ir.Constant:
    return ir.Constant(_WORDS, [x] * (_BLOCK // 4))


def _by_runs(builder: ir.IRBuilder, c: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The 64 characters' 6-bit values and the mask of those outside the alphabet: each run
    of the alphabet (:data:`_RUNS`) a range compare (``c - first < count``) selecting
    ``c - first + value``."""
    value, valid = _chars(0), None
    for first, count, base in _RUNS:
        offset = builder.sub(c, _chars(first))
        inside = builder.icmp_unsigned("<", offset, _chars(count))
        value = builder.select(inside, builder.add(offset, _chars(base)), value)
        valid = inside if valid is None else builder.or_(valid, inside)
    return value, builder.xor(builder.bitcast(valid, _I64), ir.Constant(_I64, -1))


_LOOKUP = [int(v >> 18) if v < _INVALID else 0x80 for v in _TABLES[0, :128].tolist()]
"""The first 128 characters' 6-bit values, 0x80 for those outside the alphabet."""


def _by_lookup(builder: ir.IRBuilder, c: ir.Value) -> tuple[ir.Value, ir.Value]:
    """:func:`_by_runs` as one table lookup of 128 entries (AVX-512 VBMI's ``vpermi2b``,
    which reads a character's low 7 bits): a character is outside the alphabet when its
    entry or itself has the top bit set."""
    lookup = builder.module.declare_intrinsic(
        "llvm.x86.avx512.vpermi2var.qi.512", fnty=ir.FunctionType(_CHARS, [_CHARS] * 3)
    )
    value = builder.call(lookup, [_chars(_LOOKUP[:_BLOCK]), c, _chars(_LOOKUP[_BLOCK:])])
    outside = builder.icmp_signed("<", builder.or_(value, c), _chars(0))
    return value, builder.bitcast(outside, _I64)


def _block_decoder(
    classify: Callable[[ir.IRBuilder, ir.Value], tuple[ir.Value, ir.Value]],
) -> Any:
    """An intrinsic decoding the 64 characters at address ``src`` into the 48 bytes at
    ``dst``, returning the mask of the characters outside the alphabet (bit ``k``: character
    ``k``; 0 when valid). ``classify`` maps the characters to their 6-bit values; the values,
    read as 16 little-endian words of four, are joined as ``a << 18 | b << 12 | c << 6 | d``
    and stored big-endian, 3 bytes a word."""

    def decode_block(typingctx, src, dst):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
        sig = types.uint64(types.int64, types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            source, dest = args
            c = builder.load(builder.inttoptr(source, _CHARS.as_pointer()), align=1)
            value, invalid = classify(builder, c)
            w = builder.bitcast(value, _WORDS)  # character k of a quartet: byte k
            joined = _words(0)
            for k, shift in enumerate((18, 12, 6, 0)):
                six = builder.and_(builder.lshr(w, _words(8 * k)), _words(0x3F))
                joined = builder.or_(joined, builder.shl(six, _words(shift)))
            swapped = builder.or_(  # bytes 0, 1, 2 of a word: bits 16-23, 8-15, 0-7
                builder.or_(
                    builder.and_(builder.lshr(joined, _words(16)), _words(0xFF)),
                    builder.and_(joined, _words(0xFF00)),
                ),
                builder.shl(builder.and_(joined, _words(0xFF)), _words(16)),
            )
            picks = [4 * (k // 3) + k % 3 for k in range(_BLOCK // 4 * 3)]
            out = builder.shuffle_vector(
                builder.bitcast(swapped, _CHARS),
                ir.Constant(_CHARS, ir.Undefined),
                ir.Constant(ir.VectorType(_I32, len(picks)), picks),
            )
            stored = ir.VectorType(_I8, len(picks)).as_pointer()
            builder.store(out, builder.inttoptr(dest, stored), align=1)
            return invalid

        return sig, codegen

    decode_block.__name__ = decode_block.__qualname__ = f"decode_block{classify.__name__}"
    return intrinsic(decode_block)


_decode_block_by_runs = _block_decoder(_by_runs)
_decode_block_by_lookup = _block_decoder(_by_lookup)


def _compiled_with_vbmi() -> bool:
    """Whether numba compiles for AVX-512 VBMI: the features it is told to
    (``NUMBA_CPU_FEATURES``), else the host's (numba's own choice; it keys its cache by
    them)."""
    told = getattr(numba.config, "CPU_FEATURES", None)  # (set by NUMBA_CPU_FEATURES)
    if told is not None:
        return "+avx512vbmi" in told.split(",")
    return bool(llvm.get_host_cpu_features().get("avx512vbmi", False))


_decode_block = _decode_block_by_lookup if _compiled_with_vbmi() else _decode_block_by_runs
"""The block decoder: the table lookup where the compiled code has AVX-512 VBMI, the range
compares elsewhere (any target)."""


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _decode(src, words, pairs, tables, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Returns the number of bytes written, or -1 for invalid input. ``words``: ``src``'s
    quartets but the last, as native uint32."""
    n = len(src)
    if n % 4:
        return -1
    if n == 0:
        return 0
    if src.strides[0] != 1 or out.strides[0] != 1:  # blocks are read and written by address
        raise ValueError("base64: the text and the output must be contiguous")
    seen = np.uint32(0)
    first, second, low = np.uint32(_FIRST), np.uint32(_SECOND), np.uint32(0xFFFF)
    last = n // 4 - 1
    blocks = (4 * last) // _BLOCK  # whole blocks before the last quartet
    invalid = np.uint64(0)
    for block in range(blocks):
        at = _BLOCK * block
        invalid |= _decode_block(src.ctypes.data + at, out.ctypes.data + at // 4 * 3)  # type: ignore[call-arg]
    if invalid:
        return -1
    for q in range(blocks * _BLOCK // 4, last):  # the other quartets but the last
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
