"""The write kernel: a batch of add / remove_claim / remove_chunk ops, applied in order.

Every write of the index goes through :func:`apply_ops`; it reports per op what changed
(``F_*`` flags of ``occupants.py``) and which ids, so the caller can keep the Python references
that hold token arrays and chunk_hash bytes alive, and its counters, in step.
"""

from __future__ import annotations

from typing import Any

import numba

from kvatlas.directory.blend.kernels.filter import filter_add
from kvatlas.directory.blend.kernels.layout import (
    IDS_CONTENTS,
    IDS_FREE_CONTENT,
    IDS_FREE_OCCUPANT,
    IDS_OCCUPANTS,
    O_NCLAIMS,
    O_NEXT,
    O_NS0,
    O_OFF,
    BlendArrays,
)
from kvatlas.directory.blend.kernels.modhash import fingerprint
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
from kvatlas.directory.blend.kernels.pointers import i64_ptr, jit, u32_ptr
from kvatlas.directory.blend.kernels.table import content_reinsert, find_content

ADD, REMOVE_CLAIM, REMOVE_CHUNK, SKIP = 0, 1, 2, 3
"""Op kinds (``SKIP``: nothing to do, e.g. a removal for a namespace without claims)."""


OP_KIND, OP_TOKENS, OP_HASH, OP_HASH_LEN, OP_OFFSET, OP_NS = range(6)
"""Rows of the ``(6, k)`` int64 op array :func:`apply_ops` takes, one column per op:
kind; the token array (``id`` of a C-contiguous uint32 array, its data pointer read at
``id + data_off``, or with ``data_off < 0`` the data address itself); address and length of
the chunk_hash payload; token offset; namespace id (-1 for ``REMOVE_CHUNK``)."""


@jit
def apply_ops(
    ops: Any, chunk: Any, data_off: Any, base: Any, fmask: Any, arrays: Any, out: Any
) -> None:
    """Apply ``ops`` (see ``OP_*``) to ``arrays`` (a ``BlendArrays`` as a plain tuple) in order.

    ``out[i] = (flags, content id, occupant id, ns0)`` where ``ns0`` is the inline claim a
    ``REMOVE_CHUNK`` dropped (-1 if none; its extra-set claims are the caller's to drop: it
    knows their namespaces). New entries take free ids (``s.ids``), but ids freed by the batch
    are released only at its end, never reused within it. The caller keeps the capacity for
    one new content and occupant per add."""
    s = BlendArrays(*arrays)
    for i in range(ops.shape[1]):
        flags, cid, occ, ns0 = _apply(
            ops[OP_KIND, i], ops[OP_TOKENS, i], ops[OP_HASH, i], ops[OP_HASH_LEN, i],
            ops[OP_OFFSET, i], ops[OP_NS, i], chunk, data_off, base, fmask, s,
        )  # fmt: skip
        out[i, 0] = flags
        out[i, 1] = cid
        out[i, 2] = occ
        out[i, 3] = ns0
    for i in range(ops.shape[1]):
        _release_ids(out[i, 0], out[i, 1], out[i, 2], s)


@jit
def apply_op(
    kind: Any,
    tokens: Any,
    h_addr: Any,
    h_len: Any,
    offset: Any,
    ns: Any,
    chunk: Any,
    data_off: Any,
    base: Any,
    fmask: Any,
    arrays: Any,
) -> Any:
    """:func:`apply_ops` for a batch of one op, passed as scalars (no op arrays to build for
    the common single write); returns its ``out`` row."""
    s = BlendArrays(*arrays)
    flags, cid, occ, ns0 = _apply(
        kind, tokens, h_addr, h_len, offset, ns, chunk, data_off, base, fmask, s
    )
    _release_ids(flags, cid, occ, s)
    return flags, cid, occ, ns0


@jit
def _apply(
    kind: Any,
    tokens: Any,
    h_addr: Any,
    h_len: Any,
    offset: Any,
    ns: Any,
    chunk: Any,
    data_off: Any,
    base: Any,
    fmask: Any,
    s: Any,
) -> Any:
    """One op (the arguments of one ``ops`` column); returns its ``out`` row."""
    if kind == SKIP:
        return 0, -1, -1, -1
    addr = tokens if data_off < 0 else i64_ptr(tokens + data_off)[0]  # type: ignore[call-arg]
    arr = numba.carray(u32_ptr(addr), chunk)  # type: ignore[attr-defined,call-arg]
    fp = fingerprint(arr, 0, chunk, base, fmask)
    cid, slot = find_content(arr, fp, chunk, s.table, s.c_fp, s.c_addr)
    if kind == ADD:
        flags, cid, occ = _add(arr, fp, cid, slot, h_addr, h_len, offset, ns, s)
        return flags, cid, occ, -1
    flags, occ, ns0 = _remove(kind, cid, slot, h_addr, h_len, ns, s)
    return flags, cid, occ, ns0


@jit
def _release_ids(flags: Any, cid: Any, occ: Any, s: Any) -> None:
    """Free the ids an op's ``flags`` say it removed."""
    if flags & F_OCCUPANT_GONE:
        _release_id(s.ids, IDS_FREE_OCCUPANT, s.o_i32[:, O_NEXT], occ)
    if flags & F_CONTENT_GONE:
        _release_id(s.ids, IDS_FREE_CONTENT, s.c_first, cid)


@jit
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


@jit
def _release_id(ids: Any, free: Any, links: Any, i: Any) -> None:
    links[i] = ids[free]
    ids[free] = i


@jit
def _add(
    tokens: Any,
    fp: Any,
    cid: Any,
    slot: Any,
    h_addr: Any,
    h_len: Any,
    offset: Any,
    ns: Any,
    s: Any,
) -> Any:
    """Idempotent; re-adding updates the offset. Returns (flags, content id, occupant id)."""
    flags = 0
    o = -1
    if cid == -1:
        cid = _take_id(s.ids, IDS_FREE_CONTENT, IDS_CONTENTS, s.c_first)
        flags |= F_NEW_CONTENT
        s.c_fp[cid] = fp
        s.c_addr[cid] = tokens.ctypes.data
        s.c_first[cid] = -1
        s.table[slot] = cid
        filter_add(s.filt, fp)
    else:
        o = find_occupant(s.c_first, cid, s.o_i64, s.o_i32, s.o_hlen, h_addr, h_len)
    if o == -1:
        o = _take_id(s.ids, IDS_FREE_OCCUPANT, IDS_OCCUPANTS, s.o_i32[:, O_NEXT])
        flags |= F_NEW_OCCUPANT
        link_occupant(cid, o, h_addr, h_len, s.c_first, s.o_i64, s.o_i32, s.o_hlen)
    s.o_i64[o, O_OFF] = offset
    return flags | add_claim(o, ns, s.o_i32, s.claims), cid, o


@jit
def _remove(kind: Any, cid: Any, slot: Any, h_addr: Any, h_len: Any, ns: Any, s: Any) -> Any:
    """remove_claim drops ``ns``'s claim, the occupant with its last claim, the content with
    its last occupant; remove_chunk drops the occupant with all its claims. Returns (flags,
    occupant id, dropped inline claim)."""
    if cid == -1:
        return 0, -1, -1
    o = find_occupant(s.c_first, cid, s.o_i64, s.o_i32, s.o_hlen, h_addr, h_len)
    if o == -1:
        return 0, -1, -1
    ns0 = -1
    if kind == REMOVE_CLAIM:
        flags = drop_claim(o, ns, s.o_i32, s.claims)
        if flags == 0 or s.o_i32[o, O_NCLAIMS] > 0:
            return flags, o, -1
    else:
        flags = 0
        ns0 = s.o_i32[o, O_NS0]
        s.o_i32[o, O_NS0] = -1
        s.o_i32[o, O_NCLAIMS] = 0
    flags |= F_OCCUPANT_GONE
    if unlink_occupant(cid, slot, o, s.table, s.c_fp, s.c_addr, s.c_first, s.o_i32):
        flags |= F_CONTENT_GONE
    return flags, o, ns0


@jit
def rebuild(arrays: Any) -> None:
    """Re-insert every live content into the fresh (empty) table and filter of ``arrays`` (a
    ``BlendArrays`` as a plain tuple)."""
    s = BlendArrays(*arrays)
    for cid in range(s.ids[IDS_CONTENTS]):
        if s.c_addr[cid] != 0:
            fp = s.c_fp[cid]
            content_reinsert(s.table, fp, cid)
            filter_add(s.filt, fp)
