"""The match kernel: rolling fingerprint → filter → table → namespace → token comparison.

Probes the window starts ``p`` in ``[start, stop)`` with ``p % stride == 0`` and returns the
verified, claimed hits in ascending order, each chunk_hash at most once (its first occurrence),
with the hashes' bytes copied out. The namespace test precedes the token comparison. Recall is
complete: the filter has no false negatives and the table never loses an entry, so every stored
content at a probed window is compared. Prefetches only steer the cache: a wrong address costs
speed, never a result.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.filter import bloom_mask, may_contain, mix, word_shift
from kvatlas.directory.blend.kernels.firsts import first_of_each, kept_bytes
from kvatlas.directory.blend.kernels.layout import (
    ADDRESS_BITS,
    O_NEXT,
    O_OFF,
    TOKENS_PLANES,
    TOKENS_U16,
    BlendArrays,
)
from kvatlas.directory.blend.kernels.modhash import (
    LANES,
    fingerprint_at,
    lane_init,
    lane_load,
    lane_step,
    power_table,
)
from kvatlas.directory.blend.kernels.occupants import claimed, hash_address
from kvatlas.directory.blend.kernels.planes import planes_nbytes
from kvatlas.directory.blend.kernels.pointers import jit, prefetch, prefetch_addr
from kvatlas.directory.blend.kernels.table import content_home, equal_at
from kvatlas.kernel_twins import gil_twins, releasing_twin

SCAN_ROWS = 64
"""Rows (of ``LANES`` windows) rolled per block: the block's fingerprints stay in L1 between
the roll and the filter test, leaving the rest of the cache to the filter (writing a whole
segment's fingerprints out and reading them back would evict it)."""


class ScanScratch(NamedTuple):
    """Caller-owned buffers, reused between queries (fresh large arrays cost page faults)."""

    qt: npt.NDArray[np.uint32]
    """The query transposed into lanes: ``(blk + chunk, LANES)``."""
    block: npt.NDArray[np.uint64]
    """One block's fingerprints: ``(SCAN_ROWS, LANES)``."""
    cand_pos: npt.NDArray[np.int64]
    cand_fp: npt.NDArray[np.uint64]

    @classmethod
    def for_windows(cls, windows: int, chunk: int) -> ScanScratch:
        """Buffers for segments of up to ``windows`` window starts."""
        blk = (windows + LANES - 1) // LANES
        n_cand = max(windows, blk * LANES)
        return cls(
            np.empty((blk + chunk, LANES), np.uint32),
            np.empty((SCAN_ROWS, LANES), np.uint64),
            np.empty(n_cand, np.int64),
            np.empty(n_cand, np.uint64),
        )

    def fits(self, windows: int, chunk: int) -> bool:
        blk = (windows + LANES - 1) // LANES
        return bool(self.qt.shape[0] >= blk + chunk and self.cand_pos.shape[0] >= blk * LANES)


@gil_twins()
def scan(
    q: Any,
    start: Any,
    stop: Any,
    stride: Any,
    chunk: Any,
    ns: Any,
    base: Any,
    base_pow: Any,
    fmask: Any,
    arrays: Any,
    buffers: Any,
) -> Any:
    """Hits of namespace ``ns`` among the probed windows of ``q[start:stop + chunk - 1]``.

    ``arrays`` is the index's ``BlendArrays``, ``buffers`` a :class:`ScanScratch` that fits
    ``stop - start`` windows, both as plain tuples (see ``BlendArrays``). Returns the hits,
    the first of each chunk_hash (:func:`_first_of_each_hash`), as (positions, stored offsets,
    the hashes' bytes end to end, their lengths), and the false-positive probes: windows the
    filter passed whose fingerprint no content has."""
    s = BlendArrays(*arrays)
    scratch = ScanScratch(*buffers)
    # arrays are read through locals named once, never through a field inside a loop (each
    # field read costs a reference count update)
    filt, cand_pos, cand_fp = s.filt, scratch.cand_pos, scratch.cand_fp
    n = stop - start
    if n <= 0:
        no_hits = np.empty(0, np.int64)
        return no_hits, no_hits, np.empty(0, np.uint8), np.empty(0, np.uint8), 0
    if cand_pos.shape[0] < n or cand_fp.shape[0] < n:
        raise ValueError("scan scratch too small (see ScanScratch.for_windows)")
    if stride * 2 < chunk:
        n_c = _dense_candidates(q, start, stop, stride, chunk, base, base_pow, fmask, s, scratch)
    else:
        # sparse probes: hashing each probed window directly costs <= 2 passes over q
        fshift = word_shift(filt)
        powers = np.empty((2, chunk), np.uint64)
        power_table(base, chunk, powers)
        n_c = 0
        for p in range(((start + stride - 1) // stride) * stride, stop, stride):
            fp = fingerprint_at(q, p, chunk, powers, fmask)
            if may_contain(filt, fp, fshift):
                cand_pos[n_c] = p
                cand_fp[n_c] = fp
                n_c += 1
    return _resolve(q, n_c, cand_pos, cand_fp, chunk, ns, s)


RELEASE_WINDOWS = 16384
"""Scans of at least this many windows (a long query's segment) run with the GIL released
(:func:`scan_releasing`): long enough that a waiting thread gets in; shorter ones, a lookup of
a prompt of a few chunks, hold it (see ``pointers.jit``)."""


scan_releasing = releasing_twin(scan)
""":func:`scan`, the GIL released for the call (``kvatlas/kernel_twins.py``)."""


@jit
def _dense_candidates(
    q: Any,
    start: Any,
    stop: Any,
    stride: Any,
    chunk: Any,
    base: Any,
    base_pow: Any,
    fmask: Any,
    s: Any,
    scratch: Any,
) -> Any:
    """Rolling fingerprints fused with the filter test, ``SCAN_ROWS`` rows at a time.
    Candidates (ascending) land in ``scratch.cand_pos/cand_fp[:n]``; returns ``n``."""
    filt, qt, block = s.filt, scratch.qt, scratch.block
    cand_pos, cand_fp = scratch.cand_pos, scratch.cand_fp
    blk = (stop - start + LANES - 1) // LANES
    rows = blk + chunk
    if qt.shape[0] < rows or block.shape[0] < SCAN_ROWS or qt.shape[1] != LANES:
        raise ValueError("scan scratch too small (see ScanScratch.for_windows)")
    if cand_pos.shape[0] < blk * LANES or cand_fp.shape[0] < blk * LANES:
        raise ValueError("scan scratch too small (see ScanScratch.for_windows)")
    qv = lane_load(q, start, blk, rows, qt)
    b = np.uint64(base)
    b_pow = np.uint64(base_pow)
    h = lane_init(qv, chunk, b)
    um = np.uint64(fmask)
    fshift = np.uint64(word_shift(filt))
    counts = np.zeros(LANES, np.int64)
    hits = np.zeros(LANES, np.int64)
    words = np.empty((SCAN_ROWS, LANES), np.int64)
    masks = np.empty((SCAN_ROWS, LANES), np.uint64)
    for i0 in range(0, blk, SCAN_ROWS):
        r = min(SCAN_ROWS, blk - i0)
        _roll_block(qv[i0:], h, r, chunk, b, b_pow, block, words, masks, um, filt, fshift)
        _filter_block(
            block, words, masks, r, start + i0, blk, stop, stride, um, filt, hits, cand_pos,
            cand_fp, counts,
        )  # fmt: skip
    n_c = 0
    for j in range(LANES):  # compact the lanes in order: candidates stay ascending
        for k in range(j * blk, j * blk + counts[j]):
            cand_pos[n_c] = cand_pos[k]
            cand_fp[n_c] = cand_fp[k]
            n_c += 1
    return n_c


@jit
def _roll_block(
    qt: Any,
    h: Any,
    r: Any,
    chunk: Any,
    b: Any,
    b_pow: Any,
    out: Any,
    words: Any,
    masks: Any,
    um: Any,
    filt: Any,
    fshift: Any,
) -> None:
    """Roll ``r`` rows into ``out``, leaving each window's filter word index and bit mask in
    ``words``/``masks`` (computed in SIMD rather than lane by lane in the test) and
    prefetching the word as soon as it is known: the misses then overlap the arithmetic of
    the following rows instead of stalling the filter test."""
    for i in range(r):
        oi = out[i]
        wi = words[i]
        bi = masks[i]
        lane_step(h, oi, qt[i + chunk], qt[i], b, b_pow)
        for j in range(LANES):  # separate loops: each one compiles to SIMD on its own
            mx = mix(oi[j] & um)
            wi[j] = np.int64(mx >> fshift)
            bi[j] = bloom_mask(mx)
        for j in range(LANES):
            prefetch(filt, wi[j])  # type: ignore[call-arg]


@jit
def _filter_block(
    fps: Any,
    words: Any,
    masks: Any,
    r: Any,
    p0: Any,
    blk: Any,
    stop: Any,
    stride: Any,
    um: Any,
    filt: Any,
    hits: Any,
    cand_pos: Any,
    cand_fp: Any,
    counts: Any,
) -> None:
    """Test rows ``[0, r)`` of a rolled block (window ``p0 + j * blk + ii`` at ``[ii, j]``)
    against the words and masks :func:`_roll_block` left: branch-free per row (all lanes'
    filter loads in flight); candidates are appended per lane, so each lane's stay
    ascending."""
    for ii in range(r):
        row = fps[ii]
        wrow = words[ii]
        brow = masks[ii]
        anyhit: Any = 0
        for j in range(LANES):
            bm = brow[j]
            hit = np.int64((filt[wrow[j]] & bm) == bm)
            hits[j] = hit
            anyhit |= hit
        if anyhit:
            for j in range(LANES):
                if hits[j]:
                    p = p0 + j * blk + ii
                    if p < stop and (stride == 1 or p % stride == 0):
                        k = j * blk + counts[j]
                        cand_pos[k] = p
                        cand_fp[k] = row[j] & um
                        counts[j] += 1


@jit
def _resolve(
    q: Any,
    n_c: Any,
    cand_pos: Any,
    cand_fp: Any,
    chunk: Any,
    ns: Any,
    s: Any,
) -> Any:
    """Table → namespace → token comparison of the filter's candidates (ascending).

    Each step's memory is requested for every candidate before any is used (a pass of
    prefetches per level: table slots, the run's fingerprints, content heads, occupant rows
    and token lines), so the cache misses of all candidates overlap instead of costing one
    serial chain per candidate; the decisions are then taken in candidate order, exactly as
    a one-candidate-at-a-time walk would. Returns what :func:`scan` returns."""
    table, c_fp, c_addr, c_first = s.table, s.c_fp, s.c_addr, s.c_first
    o_i32, o_i64, claims = s.o_i32, s.o_i64, s.claims
    tmask = table.shape[0] - 1
    slots = np.empty(n_c, np.int64)
    for c in range(n_c):
        slot = content_home(cand_fp[c], tmask)
        slots[c] = slot
        prefetch(table, slot)  # type: ignore[call-arg]
    n_run = 0
    for c in range(n_c):
        slot = slots[c]
        while True:
            cid = table[slot]
            if cid == -1:
                break
            prefetch(c_fp, cid)  # type: ignore[call-arg]
            n_run += 1
            slot = (slot + 1) & tmask
    # (candidate, content) pairs whose fingerprints agree: true hits but for 2^-61 collisions.
    # Arrays are sized up front from counts: growing one inside these loops (reassigning an
    # array variable) makes numba refcount it every iteration.
    pair_c = np.empty(n_run, np.int64)
    pair_cid = np.empty(n_run, np.int64)
    n_p = 0
    n_false = 0  # candidates whose fingerprint no content has: the filter's false positives
    for c in range(n_c):
        fp = cand_fp[c]
        slot = slots[c]
        n_before = n_p
        while True:
            cid = table[slot]
            if cid == -1:
                break
            slot = (slot + 1) & tmask
            if c_fp[cid] == fp:
                pair_c[n_p] = c
                pair_cid[n_p] = cid
                n_p += 1
                prefetch(c_first, cid)  # type: ignore[call-arg]
                prefetch(c_addr, cid)  # type: ignore[call-arg]
        if n_p == n_before:
            n_false += 1
    o_base = o_i32.ctypes.data
    o_row = o_i32.strides[0]
    o64_base = o_i64.ctypes.data
    o64_row = o_i64.strides[0]
    for k in range(n_p):
        o = c_first[pair_cid[k]]
        if o != -1:
            prefetch_addr(o_base + o * o_row)  # type: ignore[call-arg]
            prefetch_addr(o64_base + o * o64_row)  # type: ignore[call-arg]
    n_occ = 0  # bound on the results: occupants over all pairs
    for k in range(n_p):
        cid = pair_cid[k]
        o = c_first[cid]
        is_claimed = False
        while o != -1:
            n_occ += 1
            is_claimed = is_claimed or claimed(o, ns, o_i32, claims)
            o = o_i32[o, O_NEXT]
        if is_claimed:  # only the requester's contents are compared: fetch their tokens
            addr = c_addr[cid]
            size = 4 * chunk
            if addr & TOKENS_U16:
                size = 2 * chunk
            elif addr & TOKENS_PLANES:  # (the low halves and two planes: Llama 3, Qwen, Gemma)
                size = planes_nbytes(chunk, 2)
            addr &= ADDRESS_BITS
            for line in range(0, size, 64):
                prefetch_addr(addr + line)  # type: ignore[call-arg]
    out_pos = np.empty(n_occ, np.int64)
    out_occ = np.empty(n_occ, np.int32)
    n_out = 0
    smask = 63
    while smask + 1 < 2 * n_occ:
        smask = 2 * smask + 1
    seen = np.full(smask + 1, -1, np.int32)  # open-addressed set of emitted occupants
    for k in range(n_p):
        pos = cand_pos[pair_c[k]]
        cid = pair_cid[k]
        verified = -1  # unknown until a claimed, not yet emitted occupant needs it
        o = c_first[cid]
        while o != -1:
            if claimed(o, ns, o_i32, claims):
                h = (o * 0x9E3779B1) & smask
                dup = False
                while seen[h] != -1:
                    if seen[h] == o:
                        dup = True
                        break
                    h = (h + 1) & smask
                if not dup:
                    if verified == -1:
                        verified = 1 if equal_at(q, pos, c_addr[cid], chunk) else 0
                    if verified == 0:
                        break
                    seen[h] = o
                    out_pos[n_out] = pos
                    out_occ[n_out] = o
                    n_out += 1
                    # its row's end (the hash, copied at the end; its start was requested)
                    prefetch_addr(o64_base + (o + 1) * o64_row - 1)  # type: ignore[call-arg]
            o = o_i32[o, O_NEXT]
    pos, off, blob, lengths = _first_of_each_hash(out_pos, out_occ, n_out, s.o_i64, s.o_hlen)
    return pos, off, blob, lengths, n_false


@jit
def _first_of_each_hash(out_pos: Any, out_occ: Any, n_out: Any, o_i64: Any, o_hlen: Any) -> Any:
    """The hits ``[0, n_out)`` (occupant ``out_occ[k]`` at ``out_pos[k]``, ascending) kept at
    the first of each chunk_hash (``firsts.first_of_each``), as (positions, stored offsets,
    the kept hashes' bytes end to end, their lengths). The bytes are copied here, under the
    caller's lock, from the occupants' rows (``occupants.hash_address``): the caller makes no
    object per hit."""
    addrs = np.empty(n_out, np.int64)
    lens = np.empty(n_out, np.int64)
    for k in range(n_out):
        o = out_occ[k]
        addrs[k] = hash_address(o, o_i64)
        lens[k] = o_hlen[o]
    kept, n_kept = first_of_each(addrs, lens, n_out)
    pos = np.empty(n_kept, np.int64)
    off = np.empty(n_kept, np.int64)
    for i in range(n_kept):
        k = kept[i]
        pos[i] = out_pos[k]
        off[i] = o_i64[out_occ[k], O_OFF]
    blob, lengths = kept_bytes(addrs, lens, kept, n_kept)
    return pos, off, blob, lengths
