"""Occupants (one chunk_hash stored with one content) and their namespace claims.

A content's occupants form a singly linked chain from ``c_first``. An occupant's first claim
is kept inline (``O_NS0``), further ones in the extra-claim set; ``O_NCLAIMS`` counts both, so
the common single-claim occupant never touches the set. Its chunk_hash is kept by value in its
``o_i64`` row (``layout.py``): copied in when it is linked, compared and read from there, so
the index holds no reference to a writer's ``bytes``.
"""

from __future__ import annotations

from typing import Any

from kvatlas.directory.blend.kernels.layout import (
    HASH_WIDTH,
    O_COLUMNS,
    O_HASH,
    O_NCLAIMS,
    O_NEXT,
    O_NS0,
)
from kvatlas.directory.blend.kernels.pointers import helper, i64_ptr, inline, u8_ptr, u64_ptr
from kvatlas.directory.blend.kernels.table import (
    claim_key,
    claims_contains,
    claims_delete,
    claims_insert,
    content_delete,
)

# What an applied op changed: the bits of its flags (``writes.apply_ops``, ``out[i, 0]``)
F_NEW_CONTENT = 1
F_NEW_OCCUPANT = 2
F_NEW_CLAIM = 4
F_EXTRA_CLAIM = 8
"""The added or dropped claim lives in the extra-claim set."""
F_CLAIM_DROPPED = 16
F_OCCUPANT_GONE = 32
F_CONTENT_GONE = 64


@helper
def claimed(o: Any, ns: Any, o_i32: Any, claims: Any) -> Any:
    """Namespace membership: the cheap test that runs before any token comparison."""
    ns0 = o_i32[o, O_NS0]
    if ns0 == ns:
        return True
    inline = 1 if ns0 >= 0 else 0
    if o_i32[o, O_NCLAIMS] > inline:
        return claims_contains(claims, claim_key(o, ns))
    return False


@helper
def add_claim(o: Any, ns: Any, o_i32: Any, claims: Any) -> Any:
    """Claim ``o`` for ``ns``; flags ``F_NEW_CLAIM`` (+ ``F_EXTRA_CLAIM``), 0 if it was."""
    ns0 = o_i32[o, O_NS0]
    if ns0 == ns:
        return 0
    if ns0 == -1:
        # the inline slot is free: the claim may already live in the extra set
        if o_i32[o, O_NCLAIMS] > 0 and claims_contains(claims, claim_key(o, ns)):
            return 0
        o_i32[o, O_NS0] = ns
        o_i32[o, O_NCLAIMS] += 1
        return F_NEW_CLAIM
    if claims_insert(claims, claim_key(o, ns)):
        o_i32[o, O_NCLAIMS] += 1
        return F_NEW_CLAIM | F_EXTRA_CLAIM
    return 0


@helper
def drop_claim(o: Any, ns: Any, o_i32: Any, claims: Any) -> Any:
    """Drop ``ns``'s claim on ``o``; flags ``F_CLAIM_DROPPED`` (+ ``F_EXTRA_CLAIM``), 0 if
    there was none."""
    ns0 = o_i32[o, O_NS0]
    if ns0 == ns:
        o_i32[o, O_NS0] = -1
        flags = F_CLAIM_DROPPED
    elif o_i32[o, O_NCLAIMS] > (1 if ns0 >= 0 else 0) and claims_delete(claims, claim_key(o, ns)):
        flags = F_CLAIM_DROPPED | F_EXTRA_CLAIM
    else:
        return 0
    o_i32[o, O_NCLAIMS] -= 1
    return flags


@inline
def equal_bytes(a_addr: Any, b_addr: Any, n: Any) -> Any:
    """Whether the ``n`` bytes at ``a_addr`` and at ``b_addr`` are equal (chunk_hashes):
    8 bytes at a time (unaligned loads), then the rest byte by byte."""
    words = n >> 3
    a8: Any = u64_ptr(a_addr)  # type: ignore[call-arg]
    b8: Any = u64_ptr(b_addr)  # type: ignore[call-arg]
    a: Any = u8_ptr(a_addr)  # type: ignore[call-arg]
    b: Any = u8_ptr(b_addr)  # type: ignore[call-arg]
    same = True
    for k in range(words):
        if a8[k] != b8[k]:
            same = False
            break
    if same:
        for k in range(8 * words, n):
            if a[k] != b[k]:
                same = False
                break
    return same


@inline
def hash_address(o: Any, o_i64: Any) -> Any:
    """Address of occupant ``o``'s chunk_hash bytes (its ``o_i64`` row from ``O_HASH`` on)."""
    return o_i64.ctypes.data + o * o_i64.strides[0] + 8 * O_HASH


@helper
def find_occupant(
    c_first: Any, cid: Any, o_i64: Any, o_i32: Any, o_hlen: Any, h_addr: Any, n: Any
) -> Any:
    """The occupant of content ``cid`` whose chunk_hash equals the ``n`` bytes at ``h_addr``."""
    o = c_first[cid]
    while o != -1:
        if o_hlen[o] == n and equal_bytes(hash_address(o, o_i64), h_addr, n):
            return o
        o = o_i32[o, O_NEXT]
    return -1


@helper
def link_occupant(
    cid: Any, o: Any, h_addr: Any, h_len: Any, c_first: Any, o_i64: Any, o_i32: Any, o_hlen: Any
) -> None:
    """Make ``o`` (a free id) an unclaimed occupant of ``cid``, head of its chain, with the
    chunk_hash of ``h_len`` (at most ``HASH_WIDTH``) bytes at ``h_addr`` copied into its row
    (zero-padded: a reused id keeps nothing of its last hash)."""
    n = min(h_len, HASH_WIDTH)
    words = n >> 3
    src8: Any = i64_ptr(h_addr)  # type: ignore[call-arg]
    for w in range(words):  # (whole words: a full-width hash is 4 loads and 4 stores)
        o_i64[o, O_HASH + w] = src8[w]
    for w in range(O_HASH + words, O_COLUMNS):
        o_i64[o, w] = 0
    if n > 8 * words:
        dst: Any = u8_ptr(hash_address(o, o_i64))  # type: ignore[call-arg]
        src: Any = u8_ptr(h_addr)  # type: ignore[call-arg]
        for k in range(8 * words, n):
            dst[k] = src[k]
    o_hlen[o] = h_len
    o_i32[o, O_NEXT] = c_first[cid]
    o_i32[o, O_NS0] = -1
    o_i32[o, O_NCLAIMS] = 0
    c_first[cid] = o


@helper
def unlink_occupant(
    cid: Any, slot: Any, o: Any, table: Any, c_fp: Any, c_addr: Any, c_first: Any, o_i32: Any
) -> Any:
    """Unlink occupant ``o`` from its content (at table ``slot``); drop the content with its
    last occupant. True when the content went (the caller releases its token array)."""
    prev = -1
    cur = c_first[cid]
    while cur != o:
        prev = cur
        cur = o_i32[cur, O_NEXT]
    if prev == -1:
        c_first[cid] = o_i32[o, O_NEXT]
    else:
        o_i32[prev, O_NEXT] = o_i32[o, O_NEXT]
    o_i32[o, O_NEXT] = -1
    if c_first[cid] != -1:
        return False
    content_delete(table, slot, c_fp)
    c_addr[cid] = 0
    return True


@helper
def drop_extra_claim(o: Any, ns: Any, claims: Any) -> Any:
    """Drop an extra-set claim a remove_chunk left behind (the caller knows its namespace)."""
    return claims_delete(claims, claim_key(o, ns))
