"""The match kernel: anchors → namespace → token comparison.

Probes the window starts ``p`` in ``[start, stop)`` with ``p % stride == 0`` and returns the
verified, claimed hits in ascending order, each chunk_hash at most once (its first occurrence),
with the hashes' bytes copied out. Its candidates are the contents whose anchor sits at one of
the query's window minima (``anchors.py``); the namespace test precedes the token comparison.
Recall is complete: a content equal to a probed window has its anchor at one of that window's
minima, and the anchor table holds every live content. Prefetches only steer the cache: a
wrong address costs speed, never a result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.anchors import anchor_candidates
from kvatlas.directory.blend.kernels.firsts import first_of_each, kept_bytes
from kvatlas.directory.blend.kernels.layout import (
    ADDRESS_BITS,
    O_NEXT,
    O_OFF,
    TOKENS_PLANES,
    TOKENS_U16,
    BlendArrays,
)
from kvatlas.directory.blend.kernels.occupants import claimed, hash_address
from kvatlas.directory.blend.kernels.planes import planes_nbytes
from kvatlas.directory.blend.kernels.pointers import jit, prefetch_addr
from kvatlas.directory.blend.kernels.table import equal_at
from kvatlas.kernel_twins import gil_twins, releasing_twin


@gil_twins()
def scan(
    q: Any,
    kgrams: Any,
    minima: Any,
    n_minima: Any,
    start: Any,
    stop: Any,
    stride: Any,
    chunk: Any,
    bits: Any,
    ns: Any,
    arrays: Any,
    slots: Any,
    tags: Any,
    c_anchor: Any,
) -> Any:
    """Hits of namespace ``ns`` among the probed windows ``[start, stop)`` of ``q``
    (``stride``: the probed ones' spacing), its candidates taken from the query's k-gram
    hashes and window minima (``anchors.py``) and the index's anchor table (``slots``,
    ``tags``, ``c_anchor``). Returns the hits, the first of each chunk_hash, as (positions,
    stored offsets, the hashes' bytes end to end, their lengths), and the number of
    candidates whose claimed content differs from its window."""
    s = BlendArrays(*arrays)
    pos, cids = anchor_candidates(
        kgrams, minima, n_minima, start, stop, stride, chunk, bits, slots, tags, c_anchor, s.c_addr
    )
    return _resolve(q, pos, cids, pos.shape[0], chunk, ns, s)


scan_releasing = releasing_twin(scan)
""":func:`scan`, the GIL released for the call (``kvatlas/kernel_twins.py``)."""

RELEASE_WINDOWS = 16384
"""Scans of at least this many windows (a long query's segment) run with the GIL released
(:func:`scan_releasing`): long enough that a waiting thread gets in; shorter ones, a lookup of
a prompt of a few chunks, hold it (see ``pointers.jit``)."""


@jit
def _resolve(q: Any, pair_pos: Any, pair_cid: Any, n_p: Any, chunk: Any, ns: Any, s: Any) -> Any:
    """Namespace → token comparison of ``n_p`` (window start, content) pairs, by window
    start: the hits, as :func:`scan` returns them, with the number of pairs whose claimed
    content differs from its window.

    Each step's memory is requested for every pair before any is used (a pass of prefetches
    per level: occupant rows, then token lines), so the cache misses of all pairs overlap
    instead of costing one serial chain per pair; the decisions are then taken in pair
    order, exactly as a one-pair-at-a-time walk would."""
    c_addr, c_first, o_i32, o_i64, claims = s.c_addr, s.c_first, s.o_i32, s.o_i64, s.claims
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
    n_unequal = 0
    for k in range(n_p):
        pos = pair_pos[k]
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
                        n_unequal += 1
                        break
                    seen[h] = o
                    out_pos[n_out] = pos
                    out_occ[n_out] = o
                    n_out += 1
                    # its row's end (the hash, copied at the end; its start was requested)
                    prefetch_addr(o64_base + (o + 1) * o64_row - 1)  # type: ignore[call-arg]
            o = o_i32[o, O_NEXT]
    pos, off, blob, lengths = _first_of_each_hash(out_pos, out_occ, n_out, s.o_i64, s.o_hlen)
    return pos, off, blob, lengths, n_unequal


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
