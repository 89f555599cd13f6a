"""The write kernel: a batch of add / remove_claim / remove_chunk ops, applied in order.

Every write of the index goes through :func:`apply_ops`; it reports per op what changed
(``F_*`` flags of ``occupants.py``) and which ids, so the caller can keep the Python references
that hold token arrays alive, and its counters, in step. An op's chunk_hash is read from the
caller's ``bytes`` during the call only: a new occupant keeps a copy in its row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import types
from numba.np.numpy_support import carray

from kvatlas.directory.blend.kernels.fingerprints import load_ids, stored_fingerprint, tagged
from kvatlas.directory.blend.kernels.layout import (
    CTX_ARRAY_DATA,
    CTX_ARRAYS,
    CTX_BYTES_DATA,
    CTX_BYTES_SIZE,
    CTX_CHUNK,
    CTX_FMASK,
    CTX_LIST_ITEMS,
    CTX_OUT,
    CTX_ROW,
    CTX_TOKEN_LIST,
    CTX_WEIGHTS,
    IDS_CONTENTS,
    IDS_FREE_CONTENT,
    IDS_FREE_OCCUPANT,
    IDS_OCCUPANTS,
    O_COLUMNS,
    O_NCLAIMS,
    O_NEXT,
    O_NS0,
    O_OFF,
    BlendArrays,
)
from kvatlas.directory.blend.kernels.occupants import (
    F_CONTENT_GONE,
    F_NEW_CONTENT,
    F_NEW_OCCUPANT,
    F_OCCUPANT_GONE,
    add_claim,
    drop_claim,
    find_occupant,
    link_occupant,
    unlink_occupant,
)
from kvatlas.directory.blend.kernels.pointers import (
    helper,
    i32_ptr,
    i64_ptr,
    inline,
    jit,
    prefetch,
    prefetch_addr,
    releasing,
    u8_ptr,
    u32_ptr,
    u64_ptr,
)
from kvatlas.directory.blend.kernels.table import (
    content_home,
    content_reinsert,
    find_content,
    fp_listed,
)
from kvatlas.kernel_twins import gil_twins, releasing_twin

ADD, REMOVE_CLAIM, REMOVE_CHUNK, SKIP = 0, 1, 2, 3
"""Op kinds (``SKIP``: nothing to do, e.g. a removal for a namespace without claims)."""


OP_KIND, OP_TOKENS, OP_HASH, OP_HASH_LEN, OP_OFFSET, OP_NS, OP_TOKEN_BYTES, OP_FP = range(8)
"""Rows of the ``(7, k)`` int64 op array :func:`apply_ops` takes, one column per op:
kind; the token array (``id`` of a C-contiguous uint32 or uint16 array, its data pointer
read at ``id + data_off``, or with ``data_off < 0`` the data address itself); address and
length of the chunk_hash payload; token offset; namespace id (-1 for ``REMOVE_CHUNK``);
bytes per token of the array (4, or 2 for uint16; 1: the planes form, ``planes.py``). An
eighth row, if present, holds each op's content fingerprint (as int64 bits), computed
before under the same base and bits (a restore's saved column): the ids are then read only
to compare them with a content of the same fingerprint."""


@gil_twins()
def apply_ops(
    ops: Any, chunk: Any, data_off: Any, weights: Any, fmask: Any, arrays: Any, out: Any
) -> None:
    """Apply ``ops`` (see ``OP_*``) to ``arrays`` (a ``BlendArrays`` as a plain tuple) in order;
    ``weights``: the fingerprints' (``modhash.power_table`` of the index's base and ``chunk``).

    ``out[i] = (flags, content id, occupant id, ns0)`` where ``ns0`` is the inline claim a
    ``REMOVE_CHUNK`` dropped (-1 if none; its extra-set claims are the caller's to drop: it
    knows their namespaces). New entries take free ids (``ids``), but ids freed by the batch
    are released only at its end, never reused within it. The caller keeps the capacity for
    one new content and occupant per add.

    add: idempotent, re-adding updates the offset. remove_claim: drops the namespace's claim,
    the occupant with its last claim, the content with its last occupant. remove_chunk: drops
    the occupant with all its claims, the content with its last occupant."""
    s = BlendArrays(*arrays)
    # the arrays as locals, named once: a field read inside the loop would cost a reference
    # count update on every use
    table, c_fp, c_addr, c_first = s.table, s.c_fp, s.c_addr, s.c_first
    o_i64, o_i32, o_hlen, claims, ids = s.o_i64, s.o_i32, s.o_hlen, s.claims, s.ids
    # each op's fingerprint and token address, taken _LOOKAHEAD ops ahead (a ring): its
    # table slot is requested then, so those misses overlap the ops between
    fps = np.empty(_RING, np.uint64)
    addrs = np.empty(_RING, np.int64)
    tokens = np.empty(chunk, np.uint32)  # an op's ids, when a content has its fingerprint
    n = ops.shape[1]
    given = ops.shape[0] > OP_FP
    for i in range(min(_LOOKAHEAD, n)):
        _take_op(ops, i, chunk, data_off, weights, fmask, fps, addrs, table)
    for i in range(n):
        _prefetch_tokens(ops, i, n, data_off, given)
        if i + _LOOKAHEAD < n:
            _take_op(ops, i + _LOOKAHEAD, chunk, data_off, weights, fmask, fps, addrs, table)
        out[i, 0] = 0
        out[i, 1] = -1
        out[i, 2] = -1
        out[i, 3] = -1
        kind = ops[OP_KIND, i]
        if kind != SKIP:
            _apply_at(
                kind, fps[i % _RING], addrs[i % _RING], ops[OP_HASH, i], ops[OP_HASH_LEN, i],
                ops[OP_OFFSET, i], ops[OP_NS, i], tokens, chunk, table, c_fp, c_addr,
                c_first, o_i64, o_i32, o_hlen, claims, ids, out[i],
            )  # fmt: skip
    for i in range(n):
        _release_ids(out[i], ids, c_first, o_i32)


@helper
def _apply_at(
    kind: Any,
    fp: Any,
    addr: Any,
    h_addr: Any,
    h_len: Any,
    offset: Any,
    ns: Any,
    tokens: Any,
    chunk: Any,
    table: Any,
    c_fp: Any,
    c_addr: Any,
    c_first: Any,
    o_i64: Any,
    o_i32: Any,
    o_hlen: Any,
    claims: Any,
    ids: Any,
    out: Any,
) -> None:
    """One op of :func:`apply_ops` (not a ``SKIP``): its content of fingerprint ``fp`` at the
    tagged token address ``addr`` (``tokens``: a row its ids are read into, to compare them),
    its chunk_hash (``h_len`` bytes at ``h_addr``), offset and namespace id; ``out``: its
    report row, ``(0, -1, -1, -1)`` on entry (see there).

    The memory the op depends on comes in waves, each requested at once before any of it is
    read: the table's probe run; then each listed content's fingerprint, address and first
    occupant (also what a removal's backward shift reads); then the occupant's rows. The
    misses of one wave overlap instead of forming one serial chain (at 10^6 contents each
    array is larger than the cache). An add that takes a free id requests the lines of the
    next free one, which the next add takes (ids are reused last freed first)."""
    tmask = table.shape[0] - 1
    slot = content_home(fp, tmask)
    while table[slot] != -1:
        cid = table[slot]
        prefetch(c_fp, cid)  # type: ignore[call-arg]
        prefetch(c_addr, cid)  # type: ignore[call-arg]
        prefetch(c_first, cid)  # type: ignore[call-arg]
        slot = (slot + 1) & tmask
    if fp_listed(fp, table, c_fp):
        load_ids(tokens, addr, chunk)  # to compare with that content's
    cid, slot = find_content(tokens, fp, chunk, table, c_fp, c_addr)
    out[1] = cid
    o = -1
    if cid != -1:
        o = c_first[cid]
        if o != -1:
            _prefetch_occupant(o, o_i64, o_i32, o_hlen)
    flags = 0
    o = -1
    if kind == ADD:
        if cid == -1:
            cid = _take_id(ids, IDS_FREE_CONTENT, IDS_CONTENTS, c_first)
            nxt = ids[IDS_FREE_CONTENT]  # the next new content's lines, for a later add
            if nxt != -1:
                prefetch(c_fp, nxt)  # type: ignore[call-arg]
                prefetch(c_addr, nxt)  # type: ignore[call-arg]
                prefetch(c_first, nxt)  # type: ignore[call-arg]
            out[1] = cid
            flags = F_NEW_CONTENT
            c_fp[cid] = fp
            c_addr[cid] = addr
            c_first[cid] = -1
            table[slot] = cid
        else:
            o = find_occupant(c_first, cid, o_i64, o_i32, o_hlen, h_addr, h_len)
        if o == -1:
            o = _take_id(ids, IDS_FREE_OCCUPANT, IDS_OCCUPANTS, o_i32[:, O_NEXT])
            nxt = ids[IDS_FREE_OCCUPANT]  # the next new occupant's rows, for a later add
            if nxt != -1:
                _prefetch_occupant(nxt, o_i64, o_i32, o_hlen)
            flags |= F_NEW_OCCUPANT
            link_occupant(cid, o, h_addr, h_len, c_first, o_i64, o_i32, o_hlen)
        o_i64[o, O_OFF] = offset
        out[0] = flags | add_claim(o, ns, o_i32, claims)
        out[2] = o
        return
    if cid != -1:
        o = find_occupant(c_first, cid, o_i64, o_i32, o_hlen, h_addr, h_len)
    if o == -1:
        return
    out[2] = o
    if kind == REMOVE_CLAIM:
        flags = drop_claim(o, ns, o_i32, claims)
        if flags == 0 or o_i32[o, O_NCLAIMS] > 0:
            out[0] = flags
            return
    else:
        out[3] = o_i32[o, O_NS0]
        o_i32[o, O_NS0] = -1
        o_i32[o, O_NCLAIMS] = 0
    flags |= F_OCCUPANT_GONE
    if unlink_occupant(cid, slot, o, table, c_fp, c_addr, c_first, o_i32):
        flags |= F_CONTENT_GONE
    out[0] = flags


@inline
def _prefetch_occupant(o: Any, o_i64: Any, o_i32: Any, o_hlen: Any) -> None:
    """Request occupant ``o``'s rows, both lines its ``o_i64`` row may span (hints only)."""
    prefetch(o_hlen, o)  # type: ignore[call-arg]
    row = o_i64.ctypes.data + o * o_i64.strides[0]
    prefetch_addr(row)  # type: ignore[call-arg]
    prefetch_addr(row + o_i64.strides[0] - 1)  # type: ignore[call-arg]
    prefetch_addr(o_i32.ctypes.data + o * o_i32.strides[0])  # type: ignore[call-arg]


@helper
def _release_ids(out: Any, ids: Any, c_first: Any, o_i32: Any) -> None:
    """Free the ids an op's report row ``out`` says went (at the end of its batch)."""
    if out[0] & F_OCCUPANT_GONE:
        _release_id(ids, IDS_FREE_OCCUPANT, o_i32[:, O_NEXT], out[2])
    if out[0] & F_CONTENT_GONE:
        _release_id(ids, IDS_FREE_CONTENT, c_first, out[1])


RELEASE_OPS = 4096
"""Batches of at least this many ops are applied with the GIL released: long enough that a
waiting thread gets in; smaller ones hold it (see ``pointers.jit``)."""


apply_ops_releasing = releasing_twin(apply_ops)
""":func:`apply_ops`, the GIL released for the call (``kvatlas/kernel_twins.py``)."""


@jit
def apply_op(
    kind: Any, tokens: Any, token_bytes: Any, chunk_hash: Any, offset: Any, ns: Any, ctx: Any
) -> Any:
    """:func:`apply_ops` for a batch of one op passed as scalars (the common single write: no
    op arrays to build, seven arguments to unbox), on the arrays of the write context at
    address ``ctx`` (``layout.write_context``: one integer instead of ten arrays); returns its
    ``out`` row. ``tokens``: the ``id`` of a content (``token_bytes`` 0: a ``bytes`` whose
    header names its form, ``contents.py``) or of an array (``token_bytes`` its bytes per id,
    1: the planes form; with the context's ``CTX_ARRAY_DATA`` < 0 its data address itself);
    ``chunk_hash``: the ``id`` of an exact ``bytes``, read through the context's object
    offsets (``_cpython.py``) during the call only (a new occupant copies it)."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    s = _arrays_at(c)
    table, c_fp, c_addr, c_first, o_i64, o_i32, o_hlen, claims, ids = s
    chunk = c[CTX_CHUNK]
    weights = carray(u64_ptr(c[CTX_WEIGHTS]), (2, chunk))  # type: ignore[call-arg]
    row = carray(u32_ptr(c[CTX_ROW]), chunk)  # type: ignore[call-arg]
    out = carray(i64_ptr(c[CTX_OUT]), 4)  # type: ignore[call-arg]
    if token_bytes == 0:  # a content: its ids after its header (none for the planes form)
        at = tokens + c[CTX_BYTES_DATA]
        head: Any = u8_ptr(at)  # type: ignore[call-arg]
        token_bytes = 1 if head[0] else np.int64(head[1])
        addr = at if token_bytes == 1 else at + token_bytes
    elif c[CTX_ARRAY_DATA] >= 0:
        addr = i64_ptr(tokens + c[CTX_ARRAY_DATA])[0]  # type: ignore[call-arg]
    else:
        addr = tokens
    addr = tagged(addr, token_bytes)
    h_addr = chunk_hash + c[CTX_BYTES_DATA]
    h_len = i64_ptr(chunk_hash + c[CTX_BYTES_SIZE])[0]  # type: ignore[call-arg]
    prefetch_addr(h_addr)  # type: ignore[call-arg]
    fp = stored_fingerprint(addr, chunk, weights, c[CTX_FMASK])
    out[0] = 0
    out[1] = -1
    out[2] = -1
    out[3] = -1
    _apply_at(
        kind, fp, addr, h_addr, h_len, offset, ns, row, chunk, table, c_fp, c_addr,
        c_first, o_i64, o_i32, o_hlen, claims, ids, out,
    )  # fmt: skip
    _release_ids(out, ids, c_first, o_i32)
    items = c[CTX_LIST_ITEMS]
    if items >= 0 and out[1] >= 0:  # the list item the caller settles next (a hint only)
        prefetch_addr(i64_ptr(c[CTX_TOKEN_LIST] + items)[0] + 8 * out[1])  # type: ignore[call-arg]
    return out[0], out[1], out[2], out[3]


SingleWrite = Callable[[int, int, int, int, int, int, int], tuple[int, int, int, int]]  # apply_op


def single_write() -> SingleWrite:
    """:func:`apply_op` compiled (or loaded from numba's cache) for its one signature, seven
    ``int64``, and returned as that signature's compiled entry point: a call then skips
    numba's dispatch, which types every argument of every call (≈0.2–0.3 µs of a single
    write's ≈4 µs; docs/performance.md). Every caller passes Python integers (ids,
    addresses, small codes), which the entry point converts as the dispatcher's would; one
    out of ``int64``'s range raises ``OverflowError``."""
    signature = (types.int64,) * 7
    apply_op.compile(signature)
    entry: SingleWrite = apply_op.overloads[signature].entry_point  # type: ignore[attr-defined]
    return entry


@inline
def _arrays_at(c: Any) -> Any:
    """The ``BlendArrays`` tuple a write context (``c``: its ``int64*``) describes."""
    a = CTX_ARRAYS
    return (
        carray(i32_ptr(c[a]), c[a + 1]),  # type: ignore[call-arg]
        carray(u64_ptr(c[a + 2]), c[a + 3]),  # type: ignore[call-arg]
        carray(i64_ptr(c[a + 4]), c[a + 5]),  # type: ignore[call-arg]
        carray(i32_ptr(c[a + 6]), c[a + 7]),  # type: ignore[call-arg]
        carray(i64_ptr(c[a + 8]), (c[a + 9], O_COLUMNS)),  # type: ignore[call-arg]
        carray(i32_ptr(c[a + 10]), (c[a + 11], 3)),  # type: ignore[call-arg]
        carray(u8_ptr(c[a + 12]), c[a + 13]),  # type: ignore[call-arg]
        carray(i64_ptr(c[a + 14]), c[a + 15]),  # type: ignore[call-arg]
        carray(i64_ptr(c[a + 16]), c[a + 17]),  # type: ignore[call-arg]
    )


_LOOKAHEAD = 4
"""How many ops ahead :func:`apply_ops` fingerprints an op (:func:`_take_op`): far enough
for its table slot to arrive, near enough for its ids to stay in L1."""
_RING = _LOOKAHEAD + 1
"""Entries of the fingerprints' and addresses' ring: the current op's and the
``_LOOKAHEAD`` ops after it."""


@inline
def _take_op(
    ops: Any,
    j: Any,
    chunk: Any,
    data_off: Any,
    weights: Any,
    fmask: Any,
    fps: Any,
    addrs: Any,
    table: Any,
) -> None:
    """Op ``j``'s fingerprint and the token address its content keeps (``layout.py``: tagged
    with the array's form) into row ``j % _RING`` of ``fps`` and ``addrs``; then request the
    table slot the op will read. The fingerprint is given (row ``OP_FP``) or
    taken by ``weights`` from the ids in their stored form (``stored_fingerprint``); the op
    reads its ids only if a content of that fingerprint is in the table, to compare them. (A
    skipped op reads nothing.)"""
    if ops[OP_KIND, j] == SKIP:
        return
    r = j % _RING
    addr = ops[OP_TOKENS, j]
    if data_off >= 0:
        addr = i64_ptr(addr + data_off)[0]  # type: ignore[call-arg]
    addr = tagged(addr, ops[OP_TOKEN_BYTES, j])
    if ops.shape[0] > OP_FP:
        fp = np.uint64(ops[OP_FP, j])
    else:
        fp = stored_fingerprint(addr, chunk, weights, fmask)
    fps[r] = fp
    addrs[r] = addr
    prefetch(table, content_home(fp, table.shape[0] - 1))  # type: ignore[call-arg]


_AHEAD_OBJECT, _AHEAD_DATA = 16, 8
"""How many ops ahead :func:`_prefetch_tokens` requests a token array's object and its data."""


@inline
def _prefetch_tokens(ops: Any, i: Any, n: Any, data_off: Any, given: Any) -> None:
    """Overlap the cache misses of later ops' token arrays with this op's work (a bulk build
    of 10^6 contents is bound by them): the array object of op ``i + 16`` (if ids are read
    through one: ``data_off`` >= 0), then the first lines of the data of op ``i + 8`` (whose
    object was requested 8 ops ago; not with the fingerprints ``given``: the data is then
    rarely read). Hints only."""
    if data_off >= 0 and i + _AHEAD_OBJECT < n:
        prefetch_addr(ops[OP_TOKENS, i + _AHEAD_OBJECT] + data_off)  # type: ignore[call-arg]
    if i + _AHEAD_DATA < n and not given:
        data = ops[OP_TOKENS, i + _AHEAD_DATA]
        if data_off >= 0:
            data = i64_ptr(data + data_off)[0]  # type: ignore[call-arg]
        for line in range(4):
            prefetch_addr(data + 64 * line)  # type: ignore[call-arg]


@helper
def _take_id(ids: Any, free: Any, fresh: Any, links: Any) -> Any:
    """A free id (the head of the list at ``ids[free]``, linked through ``links``), else the
    next fresh one (``ids[fresh]``)."""
    i = ids[free]
    if i == -1:
        i = ids[fresh]
        ids[fresh] += 1
    else:
        ids[free] = links[i]
    return i


@helper
def _release_id(ids: Any, free: Any, links: Any, i: Any) -> None:
    links[i] = ids[free]
    ids[free] = i


@releasing
def rebuild(arrays: Any) -> None:
    """Re-insert every live content into the fresh (empty) table of ``arrays`` (a
    ``BlendArrays`` as a plain tuple)."""
    s = BlendArrays(*arrays)
    table, c_fp, c_addr = s.table, s.c_fp, s.c_addr
    for cid in range(s.ids[IDS_CONTENTS]):
        if c_addr[cid] != 0:
            content_reinsert(table, c_fp[cid], cid)
