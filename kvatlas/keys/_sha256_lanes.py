"""SHA-256 of many single-block messages ``seed || counter``, computed lane-parallel with numba.

``mm_hash_to_token_values`` needs one SHA-256 per 8 output values; calling hashlib per block
pays a Python call per block. Every message is 40 bytes (32-byte seed + 8-byte big-endian
counter), i.e. exactly one padded 64-byte block, so blocks are independent: the kernel runs
the compression function over a tile of counters at once (the inner loop is over lanes, which
LLVM vectorises). Bit-exactness against hashlib is pinned by the tests.

This module imports numba: ``mm_values`` imports it on first use only, so that importing
``kvatlas.keys`` (and every client) stays free of numba. Keep it that way.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

_K = np.array(
    [
        0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4,
        0xAB1C5ED5, 0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE,
        0x9BDC06A7, 0xC19BF174, 0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F,
        0x4A7484AA, 0x5CB0A9DC, 0x76F988DA, 0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7,
        0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967, 0x27B70A85, 0x2E1B2138, 0x4D2C6DFC,
        0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85, 0xA2BFE8A1, 0xA81A664B,
        0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070, 0x19A4C116,
        0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
        0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7,
        0xC67178F2,
    ],
    dtype=np.uint32,
)  # fmt: skip
_H0 = np.array(
    [
        0x6A09E667,
        0xBB67AE85,
        0x3C6EF372,
        0xA54FF53A,
        0x510E527F,
        0x9B05688C,
        0x1F83D9AB,
        0x5BE0CD19,
    ],
    dtype=np.uint32,
)
_TILE = 64
_MESSAGE_BITS = 320  # 40-byte message


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _rotr(x: np.uint32, n: int) -> np.uint32:  # pragma: no cover - compiled
    return np.uint32((x >> np.uint32(n)) | (x << np.uint32(32 - n)))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _counter_blocks(seed_words, k, h0, first, n_blocks, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    w = np.empty((64, _TILE), np.uint32)
    st = np.empty((8, _TILE), np.uint32)
    for base in range(0, n_blocks, _TILE):
        for i in range(8):
            for t in range(_TILE):
                w[i, t] = seed_words[i]
        for t in range(_TILE):
            c = first + base + t
            w[8, t] = np.uint32(c >> 32)
            w[9, t] = np.uint32(c & 0xFFFFFFFF)
            w[10, t] = np.uint32(0x80000000)
            w[11, t] = 0
            w[12, t] = 0
            w[13, t] = 0
            w[14, t] = 0
            w[15, t] = np.uint32(_MESSAGE_BITS)
        for i in range(16, 64):
            for t in range(_TILE):
                x = w[i - 15, t]
                y = w[i - 2, t]
                s0 = _rotr(x, 7) ^ _rotr(x, 18) ^ (x >> np.uint32(3))
                s1 = _rotr(y, 17) ^ _rotr(y, 19) ^ (y >> np.uint32(10))
                w[i, t] = np.uint32(w[i - 16, t] + s0 + w[i - 7, t] + s1)
        for j in range(8):
            for t in range(_TILE):
                st[j, t] = h0[j]
        for i in range(64):
            ki = k[i]
            for t in range(_TILE):
                a = st[0, t]
                b = st[1, t]
                c2 = st[2, t]
                e = st[4, t]
                f = st[5, t]
                g = st[6, t]
                s1e = _rotr(e, 6) ^ _rotr(e, 11) ^ _rotr(e, 25)
                ch = (e & f) ^ (~e & g)
                t1 = np.uint32(st[7, t] + s1e + ch + ki + w[i, t])
                s0a = _rotr(a, 2) ^ _rotr(a, 13) ^ _rotr(a, 22)
                maj = (a & b) ^ (a & c2) ^ (b & c2)
                st[7, t] = g
                st[6, t] = f
                st[5, t] = e
                st[4, t] = np.uint32(st[3, t] + t1)
                st[3, t] = c2
                st[2, t] = b
                st[1, t] = a
                st[0, t] = np.uint32(t1 + s0a + maj)
        for t in range(min(_TILE, n_blocks - base)):
            for j in range(8):
                out[(base + t) * 8 + j] = np.uint32(st[j, t] + h0[j])


def counter_block_words(seed: bytes, first: int, n_blocks: int) -> npt.NDArray[np.uint32]:
    """Big-endian words of ``SHA-256(seed || c.to_bytes(8, 'big'))`` for ``c`` in ``[first, first+n)``."""
    if len(seed) != 32:
        raise ValueError("seed must be 32 bytes")
    seed_words = np.frombuffer(seed, dtype=">u4").astype(np.uint32)
    out = np.empty(n_blocks * 8, dtype=np.uint32)
    if n_blocks:
        _counter_blocks(seed_words, _K, _H0, first, n_blocks, out)
    return out
