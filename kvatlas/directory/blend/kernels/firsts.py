"""The first hit of each chunk_hash: hits kept by an open-addressed set of their hashes.

Two contents may carry one chunk_hash, and a long query's segments are scanned apart, so one
hash may be hit more than once; a lookup answers each at its first hit only. The hashes are
compared by their bytes (never by a digest of them): the set's key (a hash's length and first
8 bytes) only places a hash, equal keys are compared byte for byte. The scan keeps a
segment's hits with :func:`first_of_each` (over the hashes in the occupants' rows) and the
index joins segments with :func:`joined_firsts` (over the bytes the segments copied out).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.occupants import equal_bytes
from kvatlas.directory.blend.kernels.pointers import inline, jit, u8_ptr

_MIX = np.uint64(0x9E3779B97F4A7C15)
"""Spreads a hash's key over the set's slots."""


@inline
def _key(addr: Any, n: Any) -> Any:
    """A hash's set key: its length, then its first (up to 8) bytes."""
    p: Any = u8_ptr(addr)  # type: ignore[call-arg]
    key = np.uint64(n)
    for i in range(min(8, n)):
        key = (key << np.uint64(8)) | np.uint64(p[i])
    return key


@jit
def first_of_each(addrs: Any, lens: Any, n: Any) -> Any:
    """Of the hashes ``k < n`` (``lens[k]`` bytes at address ``addrs[k]``, in hit order), the
    indices of the first of each, ascending: ``(kept, n_kept)`` (``kept[:n_kept]``)."""
    keys = np.empty(n, np.uint64)
    for k in range(n):  # independent loads: the hashes' cache misses overlap
        keys[k] = _key(addrs[k], lens[k])
    smask = 15
    while smask + 1 < 2 * n:
        smask = 2 * smask + 1
    slots = np.full(smask + 1, -1, np.int64)  # open-addressed set of kept hits
    kept = np.empty(n, np.int64)
    n_kept = 0
    for k in range(n):
        key = keys[k]
        h = np.int64(((key ^ (key >> np.uint64(29))) * _MIX) >> np.uint64(32)) & smask
        dup = False
        while slots[h] != -1:
            j = slots[h]
            if keys[j] == key and lens[j] == lens[k] and equal_bytes(addrs[j], addrs[k], lens[k]):
                dup = True
                break
            h = (h + 1) & smask
        if not dup:
            slots[h] = k
            kept[n_kept] = k
            n_kept += 1
    return kept, n_kept


@jit
def joined_firsts(blob: Any, lengths: Any) -> Any:
    """Hits given as their hashes' bytes end to end (``blob``, ``lengths[k]`` bytes each, in
    hit order) kept at the first of each hash: ``(kept indices, their bytes end to end, their
    lengths)``."""
    n = lengths.shape[0]
    addrs = np.empty(n, np.int64)
    lens = np.empty(n, np.int64)
    at = blob.ctypes.data
    for k in range(n):
        addrs[k] = at
        lens[k] = lengths[k]
        at += lengths[k]
    kept, n_kept = first_of_each(addrs, lens, n)
    out, out_lengths = kept_bytes(addrs, lens, kept, n_kept)
    return kept[:n_kept].copy(), out, out_lengths


@jit
def kept_bytes(addrs: Any, lens: Any, kept: Any, n_kept: Any) -> Any:
    """The bytes of the hits ``kept[:n_kept]`` (``lens[k]`` bytes at ``addrs[k]`` each) end to
    end, and their lengths."""
    total = 0
    for i in range(n_kept):
        total += lens[kept[i]]
    blob = np.empty(total, np.uint8)
    lengths = np.empty(n_kept, np.uint8)
    at = 0
    for i in range(n_kept):
        k = kept[i]
        n = lens[k]
        lengths[i] = n
        src: Any = u8_ptr(addrs[k])  # type: ignore[call-arg]
        for b in range(n):
            blob[at + b] = src[b]
        at += n
    return blob, lengths
