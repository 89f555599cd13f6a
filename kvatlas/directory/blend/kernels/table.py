"""Open-addressed tables: the content table and the extra-claim set.

Both use linear probing over a power-of-two array with -1 for an empty slot, and both delete
by backward shift (:func:`backward_shift_delete`, written once): no tombstones, and no entry
is ever evicted or made unreachable by another's insert or delete, which is what makes the
index's recall complete. Callers keep the load at most 1/2, so a probe always ends.

- content table: ``int32`` content ids, homed by the content's fingerprint. A content is
  identified by (fingerprint, tokens): a colliding fingerprint with different tokens is a
  different entry, never an alias.
- extra-claim set: ``int64`` keys ``occupant << 32 | namespace`` (an occupant's claims beyond
  its inline first one), homed by the key itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.layout import ADDRESS_BITS, TOKENS_PLANES, TOKENS_U16
from kvatlas.directory.blend.kernels.planes import planes_equal
from kvatlas.directory.blend.kernels.pointers import (
    helper,
    inline,
    releasing,
    u16_ptr,
    u32_ptr,
)

EMPTY = -1
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xC2B2AE3D27D4EB4F)
_BLOCK = 64
"""Ids compared per block by :func:`_equal_to` before it may stop."""


@helper
def backward_shift_delete(slots: Any, slot: Any, home_of: Any, keys: Any) -> None:
    """Empty ``slots[slot]`` and shift later entries of its probe run back into the hole, so
    every remaining entry stays reachable from its home (``home_of(keys, entry, mask)``)."""
    mask = slots.shape[0] - 1
    hole = slot
    j = slot
    while True:
        j = (j + 1) & mask
        entry = slots[j]
        if entry == EMPTY:
            break
        home = home_of(keys, entry, mask)
        # move the entry into the hole unless its home lies cyclically in (hole, j]
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            slots[hole] = entry
            hole = j
    slots[hole] = EMPTY


# ---------------------------------------------------------------- content table


@inline
def content_home(fp: Any, tmask: Any) -> Any:
    return np.int64(((fp * _MIX2) >> np.uint64(20)) & np.uint64(tmask))


@inline
def _content_home_of(c_fp: Any, cid: Any, mask: Any) -> Any:
    return content_home(c_fp[cid], mask)


@helper
def equal_at(q: Any, pos: Any, addr: Any, chunk: Any) -> Any:
    """``q[pos:pos+chunk]`` (a contiguous ``uint32`` array) equals the ``chunk`` tokens at the
    token address ``addr`` (either width, see ``layout.TOKENS_U16``, or the planes form):
    compared 64 at a time with an OR of XORs (SIMD, no branch per token), stopping at the
    first differing block."""
    if q.strides[0] != 4:  # read through its address: any other layout would be misread
        raise ValueError("equal_at: the query must be a contiguous uint32 array")
    if addr & TOKENS_U16:
        return _equal_to(q, pos, u16_ptr(addr & ADDRESS_BITS), chunk)  # type: ignore[call-arg]
    if addr & TOKENS_PLANES:
        return planes_equal(q, pos, addr & ADDRESS_BITS, chunk)
    return _equal_to(q, pos, u32_ptr(addr), chunk)  # type: ignore[call-arg]


@helper
def _equal_to(q: Any, pos: Any, p: Any, chunk: Any) -> Any:
    """:func:`equal_at` of a typed pointer (compiled once per token width). Whole blocks of
    64 run with a constant trip count, read through the query's address: the form the
    compiler turns into SIMD (a loop bounded by ``min(k + 64, chunk)`` over the array is
    not)."""
    ids: Any = u32_ptr(q.ctypes.data + 4 * pos)  # type: ignore[call-arg]
    whole = chunk - chunk % _BLOCK
    for k in range(0, whole, _BLOCK):
        diff = np.uint32(0)
        for i in range(_BLOCK):
            diff |= ids[k + i] ^ np.uint32(p[k + i])
        if diff != 0:
            return False
    diff = np.uint32(0)
    for i in range(whole, chunk):
        diff |= ids[i] ^ np.uint32(p[i])
    return diff == 0


@helper
def find_content(tokens: Any, fp: Any, chunk: Any, table: Any, c_fp: Any, c_addr: Any) -> Any:
    """(content id or -1, the table slot where it is or where it would be inserted)."""
    tmask = table.shape[0] - 1
    slot = content_home(fp, tmask)
    while True:
        cid = table[slot]
        if cid == EMPTY:
            return -1, slot
        if c_fp[cid] == fp and equal_at(tokens, 0, c_addr[cid], chunk):
            return cid, slot
        slot = (slot + 1) & tmask


@helper
def fp_listed(fp: Any, table: Any, c_fp: Any) -> Any:
    """Whether a content of fingerprint ``fp`` is in the table (its probe run, no ids read)."""
    tmask = table.shape[0] - 1
    slot = content_home(fp, tmask)
    while True:
        cid = table[slot]
        if cid == EMPTY:
            return False
        if c_fp[cid] == fp:
            return True
        slot = (slot + 1) & tmask


@helper
def content_reinsert(table: Any, fp: Any, cid: Any) -> None:
    """Insert a content known to be absent (a rebuild): the first empty slot of its run."""
    tmask = table.shape[0] - 1
    slot = content_home(fp, tmask)
    while table[slot] != EMPTY:
        slot = (slot + 1) & tmask
    table[slot] = cid


@helper
def content_delete(table: Any, slot: Any, c_fp: Any) -> None:
    backward_shift_delete(table, slot, _content_home_of, c_fp)


# ---------------------------------------------------------------- extra-claim set


@inline
def claim_key(occ: Any, ns: Any) -> Any:
    return (np.int64(occ) << 32) | np.int64(ns)


@inline
def claim_home(key: Any, emask: Any) -> Any:
    return np.int64(((np.uint64(key) * _MIX1) >> np.uint64(24)) & np.uint64(emask))


@inline
def _claim_home_of(claims: Any, key: Any, mask: Any) -> Any:
    return claim_home(key, mask)


@helper
def claims_find(claims: Any, key: Any) -> Any:
    """(present, the slot where ``key`` is or where it would be inserted)."""
    emask = claims.shape[0] - 1
    slot = claim_home(key, emask)
    while True:
        k = claims[slot]
        if k == EMPTY:
            return False, slot
        if k == key:
            return True, slot
        slot = (slot + 1) & emask


@helper
def claims_contains(claims: Any, key: Any) -> Any:
    return claims_find(claims, key)[0]


@helper
def claims_insert(claims: Any, key: Any) -> Any:
    """Insert; False if already present."""
    present, slot = claims_find(claims, key)
    if present:
        return False
    claims[slot] = key
    return True


@helper
def claims_delete(claims: Any, key: Any) -> Any:
    """Delete; False if absent."""
    present, slot = claims_find(claims, key)
    if present:
        backward_shift_delete(claims, slot, _claim_home_of, claims)
    return present


@releasing
def claims_rehash(old: Any, new: Any) -> None:
    for i in range(old.shape[0]):
        if old[i] != EMPTY:
            claims_insert(new, old[i])
