"""The keyed fingerprint: a polynomial hash mod the Mersenne prime 2^61-1, direct and rolling.

``fingerprint(w) = Σ w[i]·B^(len-1-i) mod 2^61-1`` at a per-process secret random base ``B``:
two different windows of ``len`` tokens collide for at most ``len - 1`` of the 2^61-1 bases
(their difference is a nonzero polynomial in ``B``), so collisions cannot be constructed
without knowing ``B``. Mod 2^64 they can: a Thue-Morse pattern over tokens {0, 2^31} collides
for every odd base.

The modular step is written once (:func:`mul_lazy`, :func:`fold`; :func:`horner`, :func:`roll`);
every reduction ends in the canonical residue, so the direct fingerprint (:func:`fingerprint_at`:
the ids weighed by a table of the base's powers, :func:`power_table`) and the rolling lanes of
the scan agree bit for bit, whatever order their reductions run in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.pointers import TILE, helper, inline, jit, transpose_tile

MERSENNE61 = (1 << 61) - 1
SCHEME = "poly-mod-2^61-1/1"
"""Names the fingerprint function: the canonical residue of ``Σ w[i]·B^(len-1-i)`` mod 2^61-1,
masked to the index's bits. Fingerprints saved with a snapshot carry it (with the base and the
bits), and a restore takes them only under the same name: change it whenever the value for
given ids, base and bits changes (``tests/directory/test_fingerprint_column.py`` pins it)."""
_P = np.uint64(MERSENNE61)
_M31 = np.uint64((1 << 31) - 1)
_M30 = np.uint64((1 << 30) - 1)
_M29 = np.uint64((1 << 29) - 1)
_M32 = np.uint64((1 << 32) - 1)
_U0 = np.uint64(0)
_U1 = np.uint64(1)

LANES = 16
"""Independent rolling-hash chains advanced together. The per-window recurrence is a serial
dependency, so one chain is latency-bound; 16 chains over 16 sub-ranges of a query compile to
SIMD (see docs/performance.md)."""
assert LANES % TILE == 0  # lane_load turns whole tiles of lanes


@inline
def mul_lazy(a: Any, b: Any) -> Any:
    """(a * b) mod 2^61-1 for a, b < 2^61, left in [0, 2^61 + 4) (no final compare: SIMD).

    The high halves are masked to 31 bits (a no-op for these inputs: they are < 2^30 + 1) so
    the compiler can see every product is 32x32 -> 64 bits: one ``vpmuludq`` each instead of
    a 3-uop ``vpmullq``."""
    au = (a >> np.uint64(31)) & _M31
    ad = a & _M31
    bu = (b >> np.uint64(31)) & _M31
    bd = b & _M31
    mid = ad * bu + au * bd
    x = (au + au) * bu + (mid >> np.uint64(30)) + ((mid & _M30) << np.uint64(31)) + ad * bd
    return (x >> np.uint64(61)) + (x & _P)


@inline
def id_product(t: Any, low: Any, high: Any) -> Any:
    """An id ``t < 2^32`` times a weight ``w = high·2^31 + low`` (``low < 2^31``, ``high <
    2^30``), modulo 2^61-1 but not reduced: with ``t·high = u·2^30 + v`` and ``2^61 = 1``,
    ``t·low + u + v·2^31``, below 2^64. Two 32 x 32-bit products (the masks, no-ops for these
    inputs, show the compiler so)."""
    th = t * (high & _M31)
    return t * (low & _M31) + (th >> np.uint64(30)) + ((th & _M30) << np.uint64(31))


@inline
def fold(x: Any) -> Any:
    """Reduce any ``uint64`` x to the canonical residue in [0, 2^61-1).

    One step of 2^61 = 1 leaves at most 2^61 + 6, below twice the prime, so one conditional
    subtraction finishes. The subtraction's sign decides it (below the prime, it wraps past
    2^63): a signed compare, where an unsigned one is three more operations on AVX2 (it has
    no unsigned 64-bit compare)."""
    x = (x >> np.uint64(61)) + (x & _P)
    less = x - _P
    return x if np.int64(less) < 0 else less


@inline
def horner(h: Any, b: Any, t: Any) -> Any:
    """One Horner step: ``h·b + t`` for residues ``h``, ``b`` and ``t < 2^61``."""
    return fold(mul_lazy(h, b) + np.uint64(t))


@inline
def roll(h: Any, t_in: Any, t_out: Any, b: Any, b_pow: Any) -> Any:
    """Slide a window one token: ``h·b + t_in - t_out·b^len`` (``b_pow = b^len``, canonical;
    the ids ``t_in``, ``t_out`` below 2^32). The leaving id is added times ``P - b^len``
    (loop-invariant in a scan: the compiler hoists it and its halves) by :func:`id_product`'s
    two products, not reduced: with
    ``h·b`` (below 2^61 + 4) and ``t_in`` the sum stays below 2^63 + 2^62 + 2^34, which
    :func:`fold` takes whole: no reduction of the product, no subtraction (docs/performance.md)."""
    minus = _P - b_pow
    leaving = id_product(np.uint64(t_out), minus & _M31, minus >> np.uint64(31))
    return fold(mul_lazy(h, b) + np.uint64(t_in) + leaving)


@jit
def fingerprint(tokens: Any, start: Any, length: Any, base: Any, fmask: Any) -> Any:
    """Fingerprint of ``tokens[start:start+length]``, masked to the configured bits: one
    window on its own (:func:`fingerprint_at` with a table of weights of its own)."""
    weights = np.empty((2, length), np.uint64)
    power_table(base, length, weights)
    return fingerprint_at(tokens, start, length, weights, fmask)


@helper
def power_table(base: Any, length: Any, out: Any) -> None:
    """The weights :func:`fingerprint_at` gives the ids of a window of ``length``: ``B^e``
    for the id at ``i = length-1-e`` (canonical residue), split as ``out[0, i]`` its low 31
    bits and ``out[1, i]`` the high 30 (``out``: ``uint64``, shape ``(2, length)``). ``B^e``
    is taken as ``B^(LANES·a)·B^k`` (``e = LANES·a + k``): two serial chains of at most
    ``LANES`` and ``length / LANES`` steps, then independent products (≈0.2 µs for 256
    weights: an index keeps its table, a snapshot's column or a lookup builds one a call)."""
    b = np.uint64(base)
    full = out[0]
    p = _U1
    for k in range(min(LANES, length)):
        full[length - 1 - k] = p
        p = fold(mul_lazy(p, b))
    big = p  # B^LANES (when length > LANES)
    for a in range(1, (length + LANES - 1) // LANES):
        top = length - 1 - a * LANES
        for k in range(min(LANES, top + 1)):
            full[top - k] = fold(mul_lazy(big, full[length - 1 - k]))
        big = fold(mul_lazy(big, p))
    high = out[1]
    for i in range(length):
        high[i] = full[i] >> np.uint64(31)
        full[i] &= _M31


@inline
def weights_sum(lo: Any, hi: Any) -> Any:
    """The canonical residue of a sum of weights given as the sums of their low (31-bit) and
    high (30-bit) parts (:func:`power_table`'s split; each sum below 2^62): ``lo + hi·2^31``,
    where ``hi·2^31 = (hi mod 2^30)·2^31 + (hi >> 30)·2^61`` and ``2^61 = 1``."""
    return fold(lo + ((hi & _M30) << np.uint64(31)) + (hi >> np.uint64(30)))


@helper
def fingerprint_at(tokens: Any, start: Any, length: Any, weights: Any, fmask: Any) -> Any:
    """The fingerprint of ``tokens[start:start+length]`` by its weights (:func:`power_table`'s
    for the base and ``length``; ``length`` below 2^31), masked to ``fmask``. Every product is
    independent of the others and the sum needs no modular step but the last, so the loop
    compiles to SIMD with no serial chain (Horner's rule, 16 chains interleaved, took ≈2× as
    long for 256 ids: docs/performance.md).

    Each id times its weight is :func:`id_product`, added to the sum as its low and high 32
    bits."""
    return weighted_sum(tokens, start, length, weights) & np.uint64(fmask)


@helper
def weighted_sum(tokens: Any, start: Any, length: Any, weights: Any) -> Any:
    """:func:`fingerprint_at` before the mask: the canonical residue. ``tokens``: an array or
    a typed pointer to ``uint16`` or ``uint32`` ids."""
    low, high = weights[0], weights[1]
    lo = _U0
    hi = _U0
    for i in range(length):
        x = id_product(np.uint64(tokens[start + i]), low[i], high[i])
        lo += x & _M32
        hi += x >> np.uint64(32)
    # hi·2^32 = (hi mod 2^29)·2^32 + (hi >> 29)·2^61, and 2^61 = 1 (mod 2^61-1)
    return fold(fold(lo) + fold(((hi & _M29) << np.uint64(32)) + (hi >> np.uint64(29))))


@jit
def lane_load(q: Any, start: Any, blk: Any, rows: Any, qt: Any) -> Any:
    """Transpose ``q`` into ``qt[:rows]`` for the lanes: lane ``j`` reads the tokens from
    ``start + j * blk``, so window ``start + j * blk + i`` starts at row ``i`` of column ``j``.
    Reads past the end of ``q`` are clamped: they feed only windows at or past ``start + n``
    (junk the caller discards). Returns the ``qt[:rows]`` view.

    Rows whose every lane reads inside ``q`` are copied as tiles of :data:`TILE` rows and lanes,
    each turned by vector shuffles (``pointers.transpose_tile``) when both arrays are
    contiguous, copied id by id otherwise (a strided array: tests); the rest row by row."""
    m = q.shape[0]
    if rows > qt.shape[0] or qt.shape[1] != LANES:
        raise ValueError("lane_load: qt has fewer rows than asked, or not LANES columns")
    qv = qt[:rows]
    inside = min(rows, max(0, m - (start + (LANES - 1) * blk)))  # lane 15 reads furthest
    tiled = inside - inside % TILE
    if q.strides[0] == 4 and qt.strides[1] == 4 and qt.strides[0] == 4 * LANES:
        src = q.ctypes.data + 4 * start
        dst = qt.ctypes.data
        for r0 in range(0, tiled, TILE):
            for j0 in range(0, LANES, TILE):  # lanes j0.. from row r0: rows r0.. at column j0
                at = src + 4 * (j0 * blk + r0)
                transpose_tile(at, 4 * blk, dst + 4 * (r0 * LANES + j0), 4 * LANES)  # type: ignore[call-arg]
    else:
        for r in range(tiled):
            row = qv[r]
            for j in range(LANES):
                row[j] = q[start + j * blk + r]
    for r in range(tiled, rows):
        row = qv[r]
        for j in range(LANES):
            row[j] = q[min(start + j * blk + r, m - 1)]
    return qv


@jit
def lane_init(qt: Any, chunk: Any, b: Any) -> Any:
    """Fingerprints of the first window of every lane (rows ``[0, chunk)`` of ``qt``): one
    Horner chain per lane, all lanes in one SIMD loop (cheaper than 16 :func:`fingerprint`
    calls, a fixed cost per segment that would dominate short queries)."""
    h = np.zeros(LANES, np.uint64)
    for i in range(chunk):
        row = qt[i]
        for j in range(LANES):
            h[j] = horner(h[j], b, row[j])
    return h


@inline
def lane_step(h: Any, out: Any, t_in: Any, t_out: Any, b: Any, b_pow: Any) -> None:
    """Emit the lanes' current fingerprints into ``out`` and slide every lane one token
    (``t_in``/``t_out``: the rows of tokens entering and leaving). One SIMD loop."""
    for j in range(LANES):
        out[j] = h[j]
        h[j] = roll(h[j], t_in[j], t_out[j], b, b_pow)
