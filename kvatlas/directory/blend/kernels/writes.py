"""The write kernel: a batch of add / remove_claim / remove_chunk ops, applied in order.

Every write of the index goes through :func:`apply_ops`; it reports per op what changed
(``F_*`` flags of ``occupants.py``) so the caller can keep the Python references that hold
token arrays and chunk_hash bytes alive, its counters and its free lists in step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.filter import filter_add
from kvatlas.directory.blend.kernels.layout import O_NCLAIMS, O_NS0, O_OFF
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


class OpBatch(NamedTuple):
    """One row per op, in order."""

    kinds: npt.NDArray[np.int8]
    tokens: npt.NDArray[np.int64]
    """``id`` of the op's C-contiguous uint32 token array (its data pointer is read at
    ``id + data_off``), or, with ``data_off < 0``, the data address itself."""
    hashes: npt.NDArray[np.int64]
    """Address of the chunk_hash payload."""
    hash_lens: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    namespaces: npt.NDArray[np.int64]
    """Namespace id (-1 for ``REMOVE_CHUNK``)."""


@jit
def apply_ops(
    ops: Any,
    chunk: Any,
    data_off: Any,
    new_cids: Any,
    new_occs: Any,
    base: Any,
    fmask: Any,
    s: Any,
    out: Any,
) -> Any:
    """Apply ``ops`` (an :class:`OpBatch`) to ``s`` (a ``BlendArrays``) in order.

    New ids come from ``new_cids``/``new_occs`` in order (the caller provides one of each per
    add); ids freed by the batch are not reused within it. ``out[i] = (flags, content id,
    occupant id, ns0)`` where ``ns0`` is the inline claim a ``REMOVE_CHUNK`` dropped (-1 if
    none; its extra-set claims are the caller's to drop: it knows their namespaces). Returns
    (content ids used, occupant ids used)."""
    nc = 0
    no = 0
    for i in range(ops.kinds.shape[0]):
        kind = ops.kinds[i]
        out[i, 0] = 0
        out[i, 1] = -1
        out[i, 2] = -1
        out[i, 3] = -1
        if kind == SKIP:
            continue
        addr = ops.tokens[i]
        if data_off >= 0:
            addr = i64_ptr(addr + data_off)[0]  # type: ignore[call-arg]
        tokens = numba.carray(u32_ptr(addr), chunk)  # type: ignore[attr-defined,call-arg]
        fp = fingerprint(tokens, 0, chunk, base, fmask)
        cid, slot = find_content(tokens, fp, chunk, s.table, s.c_fp, s.c_addr)
        if kind == ADD:
            flags, cid, occ = _add(
                tokens, fp, cid, slot, ops.hashes[i], ops.hash_lens[i], ops.offsets[i],
                ops.namespaces[i], new_cids[nc], new_occs[no], s,
            )  # fmt: skip
            if flags & F_NEW_CONTENT:
                nc += 1
            if flags & F_NEW_OCCUPANT:
                no += 1
            ns0 = -1
        else:
            flags, occ, ns0 = _remove(
                kind, cid, slot, ops.hashes[i], ops.hash_lens[i], ops.namespaces[i], s
            )
        out[i, 0] = flags
        out[i, 1] = cid
        out[i, 2] = occ
        out[i, 3] = ns0
    return nc, no


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
    new_cid: Any,
    new_occ: Any,
    s: Any,
) -> Any:
    """Idempotent; re-adding updates the offset. Returns (flags, content id, occupant id)."""
    flags = 0
    o = -1
    if cid == -1:
        cid = new_cid
        flags |= F_NEW_CONTENT
        s.c_fp[cid] = fp
        s.c_addr[cid] = tokens.ctypes.data
        s.c_first[cid] = -1
        s.table[slot] = cid
        filter_add(s.filt, fp)
    else:
        o = find_occupant(s.c_first, cid, s.o_i64, s.o_i32, s.o_hlen, h_addr, h_len)
    if o == -1:
        o = new_occ
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
def rebuild(s: Any, hwm: Any) -> None:
    """Re-insert contents ``[0, hwm)`` into ``s``'s fresh (empty) table and filter."""
    for cid in range(hwm):
        if s.c_addr[cid] != 0:
            fp = s.c_fp[cid]
            content_reinsert(s.table, fp, cid)
            filter_add(s.filt, fp)
