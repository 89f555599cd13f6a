"""Compiled (numba) kernels behind :class:`kvatlas.directory.blend_index.BlendIndex`.

All state lives in plain numpy arrays owned by the index; these functions only read and write
them while the caller holds the index lock. Layout (ids are dense, recycled through free lists):

- contents: ``c_fp`` (uint64 fingerprint), ``c_addr`` (address of the content's read-only
  uint32 token array, kept alive by the index's Python list; 0 = free slot), ``c_first``
  (first occupant, -1 = none).
- content table: open addressing, linear probing, ``int32`` content ids (-1 = empty), deleted
  by backward shift so there are no tombstones and no entry is ever evicted (complete recall).
- filter: blocked Bloom filter, one uint64 word per key, 5 bits set; only ever gains bits
  between rebuilds, so it has false positives but never false negatives.
- occupants: ``o_i64[o] = (token_offset, address of the chunk_hash bytes)`` (the ``bytes``
  object is kept alive by the index's Python list, shared with the caller: no copy),
  ``o_hlen`` (hash length), ``o_i32[o] = (next occupant of the content, inline first claim
  or -1, number of claims)`` — one row per occupant, so the namespace test reads one line.
- extra claims (an occupant claimed by a second namespace): an open-addressed int64 set of
  ``occupant << 32 | namespace``.

The fingerprint is a polynomial hash mod the Mersenne prime 2^61-1 at a per-process secret
random base: for two different windows the collision probability is at most 255/2^61 whatever
the content, so collisions cannot be constructed without the base (mod 2^64 they can: a
Thue-Morse pattern over tokens {0, 2^31} collides for every odd base).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

MERSENNE61 = (1 << 61) - 1
_P = np.uint64(MERSENNE61)
_M31 = np.uint64((1 << 31) - 1)
_M30 = np.uint64((1 << 30) - 1)
_M32 = np.uint64((1 << 32) - 1)
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xC2B2AE3D27D4EB4F)
_U0 = np.uint64(0)
_U1 = np.uint64(1)


@intrinsic
def _u32_ptr(typingctx: Any, addr: Any) -> Any:
    """Reinterpret an integer address as ``uint32*``: lets the scan verify against the token
    arrays shared with the directory (one array per content, never copied)."""
    sig = types.CPointer(types.uint32)(addr)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _u8_ptr(typingctx: Any, addr: Any) -> Any:
    """Reinterpret an integer address as ``uint8*`` (the chunk_hash ``bytes`` the index keeps)."""
    sig = types.CPointer(types.uint8)(addr)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _i64_ptr(typingctx: Any, addr: Any) -> Any:
    """Reinterpret an integer address as ``int64*`` (reads an object's data pointer)."""
    sig = types.CPointer(types.int64)(addr)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


def _emit_prefetch(builder: Any, ptr: Any) -> None:
    """``llvm.prefetch(ptr, read, locality 3 = all cache levels, data)``."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, fnty, "llvm.prefetch.p0"
    )
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])


@intrinsic
def _prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Software prefetch of ``arr[idx]`` (1-D array): a hint only — never faults, never
    changes a value, so a wrong address costs speed, not correctness. Lets the scan request
    the filter words and table slots of many windows before it needs them, so their cache
    misses overlap instead of forming one serial chain per window."""
    sig = types.void(arr, idx)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
            context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
        )
        _emit_prefetch(builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch_addr(typingctx: Any, addr: Any) -> Any:
    """:func:`_prefetch` of a raw address (a token array's data, a row of a 2-D array)."""
    sig = types.void(addr)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit_prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


_jit = numba.njit(cache=True, nogil=True)
_inline = numba.njit(cache=True, nogil=True, inline="always")

O_OFF, O_HADDR = 0, 1  # o_i64 columns
O_NEXT, O_NS0, O_NCLAIMS = 0, 1, 2  # o_i32 columns


@_jit
def mulmod61(a: Any, b: Any) -> Any:
    """(a * b) mod 2^61-1 for a, b < 2^61 with 64-bit arithmetic only."""
    a = np.uint64(a)
    b = np.uint64(b)
    au = a >> np.uint64(31)
    ad = a & _M31
    bu = b >> np.uint64(31)
    bd = b & _M31
    mid = ad * bu + au * bd
    midu = mid >> np.uint64(30)
    midd = mid & _M30
    x = au * bu * np.uint64(2) + midu + (midd << np.uint64(31)) + ad * bd
    x = (x >> np.uint64(61)) + (x & _P)
    if x >= _P:
        x -= _P
    return x


@_jit
def powmod61(base: Any, exp: Any) -> Any:
    result = _U1
    b = np.uint64(base)
    e = exp
    while e > 0:
        if e & 1:
            result = mulmod61(result, b)
        b = mulmod61(b, b)
        e >>= 1
    return result


@numba.njit(cache=True, nogil=True, inline="always")
def _mm_lazy(a: Any, b: Any) -> Any:
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


@_jit
def fingerprint(tokens: Any, start: Any, length: Any, base: Any, fmask: Any) -> Any:
    """Polynomial hash of ``tokens[start:start+length]``, masked to the configured bits.

    Four Horner chains over the window's quarters run interleaved (one serial chain is
    latency-bound at ≈9 ns/token; adds and removals hash every chunk) and are then joined:
    h = ((h0·B^q + h1)·B^q + h2)·B^q + h3 after a head of ``length % 4`` tokens."""
    b = np.uint64(base)
    q = length // 4
    head = length - 4 * q
    h = _U0
    for i in range(start, start + head):
        h = mulmod61(h, b) + np.uint64(tokens[i])
        if h >= _P:
            h -= _P
    if q > 0:
        s0 = start + head
        h0 = _U0
        h1 = _U0
        h2 = _U0
        h3 = _U0
        for i in range(q):
            h0 = _fold(_mm_lazy(h0, b) + np.uint64(tokens[s0 + i]))
            h1 = _fold(_mm_lazy(h1, b) + np.uint64(tokens[s0 + q + i]))
            h2 = _fold(_mm_lazy(h2, b) + np.uint64(tokens[s0 + 2 * q + i]))
            h3 = _fold(_mm_lazy(h3, b) + np.uint64(tokens[s0 + 3 * q + i]))
        bq = powmod61(b, q)
        h = _fold(_mm_lazy(h, bq) + h0)
        h = _fold(_mm_lazy(h, bq) + h1)
        h = _fold(_mm_lazy(h, bq) + h2)
        h = _fold(_mm_lazy(h, bq) + h3)
    return h & np.uint64(fmask)


@numba.njit(cache=True, nogil=True, inline="always")
def _fold(x: Any) -> Any:
    """Reduce x < 2^63 to [0, 2^61-1)."""
    x = (x >> np.uint64(61)) + (x & _P)
    x = (x >> np.uint64(61)) + (x & _P)
    return x - _P if x >= _P else x


@_inline
def _mix(fp: Any) -> Any:
    return (fp ^ (fp >> np.uint64(29))) * _MIX1


@_inline
def _bloom_mask(mixed: Any) -> Any:
    """The key's bits within its filter word: 5 of 64 (at 16 bits per content that is ≈0.36%
    false positives, vs ≈0.71% with 3; every false positive costs table probes)."""
    return (
        (_U1 << (mixed & np.uint64(63)))
        | (_U1 << ((mixed >> np.uint64(6)) & np.uint64(63)))
        | (_U1 << ((mixed >> np.uint64(12)) & np.uint64(63)))
        | (_U1 << ((mixed >> np.uint64(18)) & np.uint64(63)))
        | (_U1 << ((mixed >> np.uint64(24)) & np.uint64(63)))
    )


@_jit
def _bloom_word(mixed: Any, fshift: Any) -> Any:
    return np.int64(mixed >> np.uint64(fshift))


@_jit
def _filter_shift(filt: Any) -> Any:
    """Words are addressed by the top bits of the mixed fingerprint (filter has >= 2 words)."""
    bits = 0
    n = filt.shape[0]
    while n > 1:
        n >>= 1
        bits += 1
    return 64 - bits


@_jit
def _table_home(fp: Any, tmask: Any) -> Any:
    return np.int64(((fp * _MIX2) >> np.uint64(20)) & np.uint64(tmask))


@_jit
def _claim_key(occ: Any, ns: Any) -> Any:
    return (np.int64(occ) << 32) | np.int64(ns)


@_jit
def _claim_home(key: Any, emask: Any) -> Any:
    return np.int64(((np.uint64(key) * _MIX1) >> np.uint64(24)) & np.uint64(emask))


@_jit
def extra_contains(extra: Any, key: Any) -> Any:
    emask = extra.shape[0] - 1
    slot = _claim_home(key, emask)
    while True:
        k = extra[slot]
        if k == -1:
            return False
        if k == key:
            return True
        slot = (slot + 1) & emask


@_jit
def extra_insert(extra: Any, key: Any) -> Any:
    """Insert; False if already present. Caller keeps load <= 1/2 (so a free slot exists)."""
    emask = extra.shape[0] - 1
    slot = _claim_home(key, emask)
    while True:
        k = extra[slot]
        if k == -1:
            extra[slot] = key
            return True
        if k == key:
            return False
        slot = (slot + 1) & emask


@_jit
def extra_delete(extra: Any, key: Any) -> Any:
    """Delete by backward shift (no tombstones): keeps every other key reachable."""
    emask = extra.shape[0] - 1
    slot = _claim_home(key, emask)
    while True:
        k = extra[slot]
        if k == -1:
            return False
        if k == key:
            break
        slot = (slot + 1) & emask
    hole = slot
    j = slot
    while True:
        j = (j + 1) & emask
        k = extra[j]
        if k == -1:
            break
        home = _claim_home(k, emask)
        # move k into the hole unless its home lies cyclically in (hole, j]
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            extra[hole] = k
            hole = j
    extra[hole] = -1
    return True


@_jit
def extra_rehash(old: Any, new: Any) -> None:
    for i in range(old.shape[0]):
        if old[i] != -1:
            extra_insert(new, old[i])


@_jit
def _claimed(o: Any, ns: Any, o_i32: Any, extra: Any) -> Any:
    """Namespace membership: the cheap test that runs before any token comparison."""
    ns0 = o_i32[o, O_NS0]
    if ns0 == ns:
        return True
    inline = 1 if ns0 >= 0 else 0
    if o_i32[o, O_NCLAIMS] > inline:
        return extra_contains(extra, _claim_key(o, ns))
    return False


@_jit
def _equal_at(q: Any, pos: Any, addr: Any, chunk: Any) -> Any:
    """``q[pos:pos+chunk]`` equals the ``chunk`` tokens at ``addr``: compared 64 at a time
    with an OR of XORs (SIMD, no branch per token), stopping at the first differing block."""
    p: Any = _u32_ptr(addr)  # type: ignore[call-arg]
    k = 0
    while k < chunk:
        end = min(k + 64, chunk)
        diff = np.uint32(0)
        for i in range(k, end):
            diff |= q[pos + i] ^ p[i]
        if diff != 0:
            return False
        k = end
    return True


@_jit
def find_content(tokens: Any, fp: Any, chunk: Any, table: Any, c_fp: Any, c_addr: Any) -> Any:
    """Return (content id or -1, table slot where it is or where it would be inserted).

    Entries are identified by (fingerprint, content): a colliding fingerprint with different
    tokens is a different entry, never an alias.
    """
    tmask = table.shape[0] - 1
    slot = _table_home(fp, tmask)
    while True:
        cid = table[slot]
        if cid == -1:
            return -1, slot
        if c_fp[cid] == fp and _equal_at(tokens, 0, c_addr[cid], chunk):
            return cid, slot
        slot = (slot + 1) & tmask


@_jit
def table_delete(table: Any, slot: Any, c_fp: Any) -> None:
    """Backward-shift delete at ``slot``: no tombstones, no entry becomes unreachable."""
    tmask = table.shape[0] - 1
    hole = slot
    j = slot
    while True:
        j = (j + 1) & tmask
        cid = table[j]
        if cid == -1:
            break
        home = _table_home(c_fp[cid], tmask)
        if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
            table[hole] = cid
            hole = j
    table[hole] = -1


@_jit
def rebuild(table: Any, filt: Any, c_fp: Any, c_addr: Any, hwm: Any) -> None:
    """Re-insert every live content into fresh (all -1 / all 0) table and filter arrays."""
    tmask = table.shape[0] - 1
    fshift = _filter_shift(filt)
    for cid in range(hwm):
        if c_addr[cid] == 0:
            continue
        fp = c_fp[cid]
        slot = _table_home(fp, tmask)
        while table[slot] != -1:
            slot = (slot + 1) & tmask
        table[slot] = cid
        mixed = _mix(fp)
        filt[_bloom_word(mixed, fshift)] |= _bloom_mask(mixed)


@_jit
def find_occupant(
    c_first: Any, cid: Any, o_i64: Any, o_i32: Any, o_hlen: Any, h_addr: Any, n: Any
) -> Any:
    """The occupant of content ``cid`` whose chunk_hash equals the ``n`` bytes at ``h_addr``."""
    h: Any = _u8_ptr(h_addr)  # type: ignore[call-arg]
    o = c_first[cid]
    while o != -1:
        if o_hlen[o] == n:
            p: Any = _u8_ptr(o_i64[o, O_HADDR])  # type: ignore[call-arg]
            same = True
            for k in range(n):
                if p[k] != h[k]:
                    same = False
                    break
            if same:
                return o
        o = o_i32[o, O_NEXT]
    return -1


ADD, REMOVE_CLAIM, REMOVE_CHUNK, SKIP = 0, 1, 2, 3
"""Operation kinds of :func:`apply_ops` (``SKIP``: e.g. a removal for an unknown namespace)."""

F_NEW_CONTENT = 1
F_NEW_OCCUPANT = 2
F_NEW_CLAIM = 4
F_EXTRA_CLAIM = 8  # the added/dropped claim lives in the extra set
F_CLAIM_DROPPED = 16
F_OCCUPANT_GONE = 32
F_CONTENT_GONE = 64
F_HAD_EXTRA = 128  # remove_chunk: the occupant had extra-set claims (the caller drops them)


@_jit
def op_apply(
    kind: Any,
    tokens: Any,
    h_addr: Any,
    h_len: Any,
    offset: Any,
    ns: Any,
    new_cid: Any,
    new_occ: Any,
    base: Any,
    fmask: Any,
    table: Any,
    filt: Any,
    c_fp: Any,
    c_addr: Any,
    c_first: Any,
    o_i64: Any,
    o_i32: Any,
    o_hlen: Any,
    extra: Any,
) -> Any:
    """One add / remove_claim / remove_chunk. Returns (flags, content id, occupant id, ns0).

    add: idempotent; ``new_cid``/``new_occ`` are used when flags say so (the caller then keeps
    ``tokens`` and the hash bytes alive). remove_claim: drops ``ns``'s claim, the occupant with
    its last claim, the content with its last occupant. remove_chunk: drops the occupant and
    its inline claim (``ns0`` returned, -1 if none); its extra-set claims are flagged
    ``F_HAD_EXTRA`` for the caller, who knows their namespaces.
    """
    chunk = tokens.shape[0]
    fp = fingerprint(tokens, 0, chunk, base, fmask)
    cid, slot = find_content(tokens, fp, chunk, table, c_fp, c_addr)
    flags = 0
    if kind != ADD:
        if cid == -1:
            return 0, -1, -1, -1
        o = find_occupant(c_first, cid, o_i64, o_i32, o_hlen, h_addr, h_len)
        if o == -1:
            return 0, cid, -1, -1
        ns0 = -1
        if kind == REMOVE_CLAIM:
            if o_i32[o, O_NS0] == ns:
                o_i32[o, O_NS0] = -1
                flags = F_CLAIM_DROPPED
            elif o_i32[o, O_NCLAIMS] > (1 if o_i32[o, O_NS0] >= 0 else 0) and extra_delete(
                extra, _claim_key(o, ns)
            ):
                flags = F_CLAIM_DROPPED | F_EXTRA_CLAIM
            else:
                return 0, cid, o, -1
            o_i32[o, O_NCLAIMS] -= 1
            if o_i32[o, O_NCLAIMS] > 0:
                return flags, cid, o, -1
        else:
            ns0 = o_i32[o, O_NS0]
            if o_i32[o, O_NCLAIMS] > (1 if ns0 >= 0 else 0):
                flags |= F_HAD_EXTRA
            o_i32[o, O_NS0] = -1
            o_i32[o, O_NCLAIMS] = 0
        flags |= F_OCCUPANT_GONE
        if unlink_occupant(cid, slot, o, table, c_fp, c_addr, c_first, o_i32):
            flags |= F_CONTENT_GONE
        return flags, cid, o, ns0
    if cid == -1:
        cid = new_cid
        flags |= F_NEW_CONTENT
        c_fp[cid] = fp
        c_addr[cid] = tokens.ctypes.data
        c_first[cid] = -1
        table[slot] = cid
        fshift = _filter_shift(filt)
        mixed = _mix(fp)
        filt[_bloom_word(mixed, fshift)] |= _bloom_mask(mixed)
        o = -1
    else:
        o = find_occupant(c_first, cid, o_i64, o_i32, o_hlen, h_addr, h_len)
    if o == -1:
        o = new_occ
        flags |= F_NEW_OCCUPANT
        o_i64[o, O_HADDR] = h_addr
        o_hlen[o] = h_len
        o_i32[o, O_NEXT] = c_first[cid]
        c_first[cid] = o
        o_i32[o, O_NS0] = -1
        o_i32[o, O_NCLAIMS] = 0
    o_i64[o, O_OFF] = offset
    if o_i32[o, O_NS0] == ns:
        return flags, cid, o, -1
    if o_i32[o, O_NS0] == -1:
        # the inline slot is free: the claim may already live in the extra set
        if o_i32[o, O_NCLAIMS] > 0 and extra_contains(extra, _claim_key(o, ns)):
            return flags, cid, o, -1
        o_i32[o, O_NS0] = ns
        o_i32[o, O_NCLAIMS] += 1
        return flags | F_NEW_CLAIM, cid, o, -1
    if extra_insert(extra, _claim_key(o, ns)):
        o_i32[o, O_NCLAIMS] += 1
        return flags | F_NEW_CLAIM | F_EXTRA_CLAIM, cid, o, -1
    return flags, cid, o, -1


@_jit
def apply_ops(
    kinds: Any,
    t_addr: Any,
    h_addr: Any,
    h_len: Any,
    offsets: Any,
    nss: Any,
    chunk: Any,
    data_off: Any,
    new_cids: Any,
    new_occs: Any,
    base: Any,
    fmask: Any,
    table: Any,
    filt: Any,
    c_fp: Any,
    c_addr: Any,
    c_first: Any,
    o_i64: Any,
    o_i32: Any,
    o_hlen: Any,
    extra: Any,
    out: Any,
) -> Any:
    """:func:`op_apply` over a batch, in order, in one call (one dispatch, one lock hold).

    Tokens are C-contiguous uint32 arrays the caller keeps alive, passed as ``id(array)``: the
    data pointer is read at ``id + data_off`` (the ndarray struct's ``data`` field, located at
    import by the caller); with ``data_off < 0``, ``t_addr`` holds data addresses already.
    New ids come from ``new_cids``/``new_occs`` in order; ids freed by the batch are not
    reused within it. ``out[i] = (flags, cid, occ, ns0)``. Returns (cids used, occs used).
    """
    nc = 0
    no = 0
    for i in range(kinds.shape[0]):
        kind = kinds[i]
        if kind == SKIP:
            out[i, 0] = 0
            out[i, 1] = -1
            out[i, 2] = -1
            out[i, 3] = -1
            continue
        addr = t_addr[i] if data_off < 0 else _i64_ptr(t_addr[i] + data_off)[0]  # type: ignore[call-arg]
        tokens = numba.carray(_u32_ptr(addr), chunk)  # type: ignore[attr-defined,call-arg]
        new_cid = new_cids[nc] if nc < new_cids.shape[0] else -1
        new_occ = new_occs[no] if no < new_occs.shape[0] else -1
        flags, cid, occ, ns0 = op_apply(
            kind, tokens, h_addr[i], h_len[i], offsets[i], nss[i], new_cid, new_occ, base,
            fmask, table, filt, c_fp, c_addr, c_first, o_i64, o_i32, o_hlen, extra,
        )  # fmt: skip
        if flags & F_NEW_CONTENT:
            nc += 1
        if flags & F_NEW_OCCUPANT:
            no += 1
        out[i, 0] = flags
        out[i, 1] = cid
        out[i, 2] = occ
        out[i, 3] = ns0
    return nc, no


@_jit
def unlink_occupant(
    cid: Any, slot: Any, o: Any, table: Any, c_fp: Any, c_addr: Any, c_first: Any, o_i32: Any
) -> Any:
    """Unlink occupant ``o`` from its content; drop the content with its last occupant.

    Returns True when the content entry went (the caller releases its token array)."""
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
    table_delete(table, slot, c_fp)
    c_addr[cid] = 0
    return True


LANES = 16
"""Independent rolling-hash chains advanced together: the per-window recurrence is a serial
dependency, so one chain is latency-bound (≈6 ns/token); 16 chains over 16 sub-ranges of the
query compile to SIMD and run at ≈1.5 ns/token."""

_2P = np.uint64(2 * MERSENNE61)


@_jit
def _lane_init(qt: Any, chunk: Any, b: Any) -> Any:
    """Fingerprints of the first window of every lane (rows ``[0, chunk)`` of ``qt``): one
    Horner chain per lane, all lanes in one SIMD loop (16 scalar :func:`fingerprint` calls
    cost ≈10 µs, a fixed cost per segment that dominated short queries)."""
    h = np.zeros(LANES, np.uint64)
    for i in range(chunk):
        row = qt[i]
        for j in range(LANES):
            x = _mm_lazy(h[j], b) + np.uint64(row[j])
            x = (x >> np.uint64(61)) + (x & _P)
            x = (x >> np.uint64(61)) + (x & _P)
            h[j] = x - _P if x >= _P else x
    return h


@_jit
def _lane_roll(qt: Any, h: Any, blk: Any, chunk: Any, b: Any, bp: Any, out: Any) -> None:
    """out[i, j] = fingerprint of the window starting at lane j's origin + i."""
    for i in range(blk):
        oi = out[i]
        tin = qt[i + chunk]
        tout = qt[i]
        for j in range(LANES):
            oi[j] = h[j]
            x = _mm_lazy(h[j], b) + np.uint64(tin[j]) + (_2P - _mm_lazy(np.uint64(tout[j]), bp))
            x = (x >> np.uint64(61)) + (x & _P)
            x = (x >> np.uint64(61)) + (x & _P)
            h[j] = x - _P if x >= _P else x


@_jit
def _lane_roll_prefetch(
    qt: Any,
    h: Any,
    blk: Any,
    chunk: Any,
    b: Any,
    bp: Any,
    out: Any,
    words: Any,
    masks: Any,
    um: Any,
    filt: Any,
    fshift: Any,
) -> None:
    """:func:`_lane_roll` that also leaves each window's filter word index and bit mask in
    ``words``/``masks`` (computed here, in SIMD, rather than lane by lane in the test) and
    prefetches the filter word as soon as it is known: the misses then overlap the rolling
    arithmetic of the following rows instead of stalling the filter test (the filter is
    about as large as L2 at 10^6 contents)."""
    for i in range(blk):
        oi = out[i]
        wi = words[i]
        bi = masks[i]
        tin = qt[i + chunk]
        tout = qt[i]
        for j in range(LANES):  # separate loops: each one compiles to SIMD on its own
            oi[j] = h[j]
            x = _mm_lazy(h[j], b) + np.uint64(tin[j]) + (_2P - _mm_lazy(np.uint64(tout[j]), bp))
            x = (x >> np.uint64(61)) + (x & _P)
            x = (x >> np.uint64(61)) + (x & _P)
            h[j] = x - _P if x >= _P else x
        for j in range(LANES):
            mx = _mix(oi[j] & um)
            wi[j] = np.int64(mx >> fshift)
            bi[j] = _bloom_mask(mx)
        for j in range(LANES):
            _prefetch(filt, wi[j])  # type: ignore[call-arg]


@_jit
def window_fingerprints(
    q: Any, start: Any, n: Any, chunk: Any, base: Any, base_pow: Any, qt: Any, out: Any
) -> Any:
    """Unmasked fingerprints of the ``n`` windows starting at ``start``, as a (blk, LANES)
    view of ``out``: window ``start + j * blk + i`` is at ``[i, j]`` (entries past ``n`` are
    junk). ``qt`` and ``out`` are caller-owned scratch (reused: no page faults per query)."""
    blk = (n + LANES - 1) // LANES
    m = q.shape[0]
    rows = blk + chunk
    if qt.shape[0] < rows or out.shape[0] < blk or qt.shape[1] != LANES:
        raise ValueError("scratch buffers too small (see scratch_shapes)")
    qv = qt[:rows]
    # windows before ``start + n`` read only real tokens; clamped reads feed junk windows only
    for r in range(rows):
        row = qv[r]
        for j in range(LANES):
            row[j] = q[min(start + j * blk + r, m - 1)]
    h = _lane_init(qv, chunk, np.uint64(base))
    ov = out[:blk]
    _lane_roll(qv, h, blk, chunk, np.uint64(base), np.uint64(base_pow), ov)
    return ov


def scratch_shapes(windows: int, chunk: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """Shapes of the (qt, out) scratch and the candidate length for up to ``windows`` windows."""
    blk = (windows + LANES - 1) // LANES
    return (blk + chunk, LANES), (blk, LANES), max(windows, blk * LANES)


SCAN_ROWS = 64
"""Rows (of ``LANES`` windows) rolled per block in ``scan``: the block's fingerprints stay in
L1 between the roll and the filter probe, so the cache is left to the filter (writing all of
a 64k-window segment's fingerprints out and reading them back costs an extra 1 MB of traffic
that evicts the filter from L2)."""


@_jit
def _filter_block(
    fps: Any,
    words: Any,
    masks: Any,
    r: Any,
    i0: Any,
    blk: Any,
    start: Any,
    stop: Any,
    stride: Any,
    um: Any,
    filt: Any,
    hits: Any,
    cand_pos: Any,
    cand_fp: Any,
    counts: Any,
) -> None:
    """Bloom-test rows ``[0, r)`` of a rolled block (rows ``i0 + ii`` of the lane layout)
    against the word indices and masks :func:`_lane_roll_prefetch` left (and prefetched):
    the test is branch-free per row (16 independent filter loads in flight), candidates are
    appended per lane so each lane's stay ascending."""
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
                    p = start + j * blk + i0 + ii
                    if p < stop and (stride == 1 or p % stride == 0):
                        k = j * blk + counts[j]
                        cand_pos[k] = p
                        cand_fp[k] = row[j] & um
                        counts[j] += 1


@_jit
def _dense_candidates(
    q: Any,
    start: Any,
    stop: Any,
    stride: Any,
    chunk: Any,
    base: Any,
    base_pow: Any,
    um: Any,
    filt: Any,
    qt: Any,
    fps_buf: Any,
    cand_pos: Any,
    cand_fp: Any,
) -> Any:
    """Rolling fingerprints fused with the filter probe, ``SCAN_ROWS`` rows at a time.
    Candidates (ascending) land in ``cand_pos/cand_fp[:n]``; returns ``n``."""
    n = stop - start
    blk = (n + LANES - 1) // LANES
    m = q.shape[0]
    rows = blk + chunk
    if qt.shape[0] < rows or fps_buf.shape[0] < SCAN_ROWS or qt.shape[1] != LANES:
        raise ValueError("scratch buffers too small (see scan_scratch_shapes)")
    if cand_pos.shape[0] < blk * LANES or cand_fp.shape[0] < blk * LANES:
        raise ValueError("scratch buffers too small (see scan_scratch_shapes)")
    qv = qt[:rows]
    # windows before ``stop`` read only real tokens; clamped reads feed junk windows only
    for r in range(rows):
        row = qv[r]
        for j in range(LANES):
            row[j] = q[min(start + j * blk + r, m - 1)]
    h = _lane_init(qv, chunk, np.uint64(base))
    b = np.uint64(base)
    bp = np.uint64(base_pow)
    fshift = _filter_shift(filt)
    counts = np.zeros(LANES, np.int64)
    hits = np.zeros(LANES, np.int64)
    words = np.empty((SCAN_ROWS, LANES), np.int64)
    masks = np.empty((SCAN_ROWS, LANES), np.uint64)
    for i0 in range(0, blk, SCAN_ROWS):
        r = min(SCAN_ROWS, blk - i0)
        _lane_roll_prefetch(
            qv[i0:], h, r, chunk, b, bp, fps_buf, words, masks, um, filt, np.uint64(fshift)
        )
        _filter_block(
            fps_buf, words, masks, r, i0, blk, start, stop, stride, um, filt, hits, cand_pos,
            cand_fp, counts,
        )  # fmt: skip
    n_c = 0
    for j in range(LANES):  # compact the lanes in order: candidates stay ascending
        for k in range(j * blk, j * blk + counts[j]):
            cand_pos[n_c] = cand_pos[k]
            cand_fp[n_c] = cand_fp[k]
            n_c += 1
    return n_c


def scan_scratch_shapes(windows: int, chunk: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """Shapes of ``scan``'s (qt, block) scratch and its candidate length for ``windows``."""
    blk = (windows + LANES - 1) // LANES
    return (blk + chunk, LANES), (SCAN_ROWS, LANES), max(windows, blk * LANES)


@_jit
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
    table: Any,
    filt: Any,
    c_fp: Any,
    c_addr: Any,
    c_first: Any,
    o_i32: Any,
    o_i64: Any,
    extra: Any,
    qt: Any,
    fps_buf: Any,
    cand_pos: Any,
    cand_fp: Any,
    names_items: Any,
    hash_data_off: Any,
) -> Any:
    """Rolling fingerprint → Bloom filter → table → namespace → token verification.

    Probes the window starts ``p`` in ``[start, stop)`` with ``p % stride == 0``. Returns
    (positions, occupants, stored offsets) of verified, claimed hits, ascending, each
    occupant at most once (its first occurrence). The namespace test precedes the token
    comparison. ``names_items`` (address of the caller's occupant → chunk_hash list items)
    and ``hash_data_off`` only steer prefetches: a wrong value costs speed, never a result.
    """
    um = np.uint64(fmask)
    n = stop - start
    if n <= 0:
        return np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64)
    if stride * 2 < chunk:
        n_c = _dense_candidates(
            q, start, stop, stride, chunk, base, base_pow, um, filt, qt, fps_buf, cand_pos,
            cand_fp,
        )  # fmt: skip
    else:
        # sparse probes: hashing each probed window directly costs <= 2 passes over q
        if cand_pos.shape[0] < n or cand_fp.shape[0] < n:
            raise ValueError("scratch buffers too small (see scan_scratch_shapes)")
        fshift = _filter_shift(filt)
        n_c = 0
        first = ((start + stride - 1) // stride) * stride
        for p in range(first, stop, stride):
            fp = fingerprint(q, p, chunk, base, fmask)
            mixed = _mix(fp)
            bm = _bloom_mask(mixed)
            if (filt[_bloom_word(mixed, fshift)] & bm) == bm:
                cand_pos[n_c] = p
                cand_fp[n_c] = fp
                n_c += 1
    return _resolve(
        q, n_c, cand_pos, cand_fp, chunk, ns, table, c_fp, c_addr, c_first, o_i32, o_i64, extra,
        names_items, hash_data_off,
    )  # fmt: skip


@_jit
def _resolve(
    q: Any,
    n_c: Any,
    cand_pos: Any,
    cand_fp: Any,
    chunk: Any,
    ns: Any,
    table: Any,
    c_fp: Any,
    c_addr: Any,
    c_first: Any,
    o_i32: Any,
    o_i64: Any,
    extra: Any,
    names_items: Any,
    hash_data_off: Any,
) -> Any:
    """Table → namespace → token verification of the filter's candidates (ascending).

    Each step's memory is requested for every candidate before any is used (a pass of
    prefetches per level: table slots, the run's fingerprints, content heads, occupant rows
    and token lines), so the cache misses of all candidates overlap instead of costing one
    serial chain per candidate; the decisions are then taken in candidate order, exactly as
    a one-candidate-at-a-time walk would. Returns (positions, occupants, stored offsets)."""
    tmask = table.shape[0] - 1
    slots = np.empty(n_c, np.int64)
    for c in range(n_c):
        slot = _table_home(cand_fp[c], tmask)
        slots[c] = slot
        _prefetch(table, slot)  # type: ignore[call-arg]
    n_run = 0
    for c in range(n_c):
        slot = slots[c]
        while True:
            cid = table[slot]
            if cid == -1:
                break
            _prefetch(c_fp, cid)  # type: ignore[call-arg]
            n_run += 1
            slot = (slot + 1) & tmask
    # (candidate, content) pairs whose fingerprints agree: true hits but for 2^-61 collisions.
    # Arrays are sized up front from counts: growing one inside these loops (reassigning an
    # array variable) makes numba refcount it every iteration, ≈10x slower.
    pair_c = np.empty(n_run, np.int64)
    pair_cid = np.empty(n_run, np.int64)
    n_p = 0
    for c in range(n_c):
        fp = cand_fp[c]
        slot = slots[c]
        while True:
            cid = table[slot]
            if cid == -1:
                break
            slot = (slot + 1) & tmask
            if c_fp[cid] == fp:
                pair_c[n_p] = c
                pair_cid[n_p] = cid
                n_p += 1
                _prefetch(c_first, cid)  # type: ignore[call-arg]
                _prefetch(c_addr, cid)  # type: ignore[call-arg]
    o_base = o_i32.ctypes.data
    o_row = o_i32.strides[0]
    o64_base = o_i64.ctypes.data
    o64_row = o_i64.strides[0]
    for k in range(n_p):
        o = c_first[pair_cid[k]]
        if o != -1:
            _prefetch_addr(o_base + o * o_row)  # type: ignore[call-arg]
            _prefetch_addr(o64_base + o * o64_row)  # type: ignore[call-arg]
    n_occ = 0  # bound on the results: occupants over all pairs
    for k in range(n_p):
        cid = pair_cid[k]
        o = c_first[cid]
        claimed = False
        while o != -1:
            n_occ += 1
            claimed = claimed or _claimed(o, ns, o_i32, extra)
            o = o_i32[o, O_NEXT]
        if claimed:  # only the requester's contents are compared: fetch their tokens
            addr = c_addr[cid]
            for line in range(0, 4 * chunk, 64):
                _prefetch_addr(addr + line)  # type: ignore[call-arg]
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
            if _claimed(o, ns, o_i32, extra):
                s = (o * 0x9E3779B1) & smask
                dup = False
                while seen[s] != -1:
                    if seen[s] == o:
                        dup = True
                        break
                    s = (s + 1) & smask
                if not dup:
                    if verified == -1:
                        verified = 1 if _equal_at(q, pos, c_addr[cid], chunk) else 0
                    if verified == 0:
                        break
                    seen[s] = o
                    out_pos[n_out] = pos
                    out_occ[n_out] = o
                    n_out += 1
            o = o_i32[o, O_NEXT]
    out_off = np.empty(n_out, np.int64)
    for k in range(n_out):
        o = out_occ[k]
        out_off[k] = o_i64[o, O_OFF]
        # what the caller reads next, per result: its slot of the occupant -> chunk_hash list
        # and the chunk_hash object's header (refcount, cached hash)
        _prefetch_addr(names_items + 8 * o)  # type: ignore[call-arg]
        _prefetch_addr(o_i64[o, O_HADDR] - hash_data_off)  # type: ignore[call-arg]
    return out_pos[:n_out], out_occ[:n_out], out_off


@_jit
def rolling_floor(q: Any, chunk: Any, base: Any, base_pow: Any, qt: Any, fps_buf: Any) -> Any:
    """The floor the scan is measured against: the rolling fingerprint alone over the query
    (same SIMD lanes as ``scan``), folded to one value so nothing is optimised away."""
    n = q.shape[0] - chunk + 1
    if n <= 0:
        return 0
    fps = window_fingerprints(q, 0, n, chunk, base, base_pow, qt, fps_buf)
    acc = np.uint64(0)
    for i in range(fps.shape[0]):
        for j in range(LANES):
            acc ^= fps[i, j]
    return np.int64(acc & np.uint64(0x7FFFFFFFFFFFFFFF))
