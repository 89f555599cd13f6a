"""BlendIndex: the fragment (CacheBlend) index — which cached chunks occur anywhere in a query.

A derived view of the directory's token bindings (blend-index.md). Guarantees:

- Complete recall: an open-addressed table with no eviction (backward-shift deletion, no
  tombstones) plus a Bloom filter that never has false negatives; every live claimed chunk
  whose content occurs at a probed position is returned.
- No wrong KV: entries are identified by (fingerprint, content); tokens are compared before
  an occupant is attached and before any match is returned. Hashes are for discovery only.
- No constructible collisions: the fingerprint is keyed (a per-process secret base mod
  2^61-1, see ``_blend_kernels``) and never leaves the process.
- Namespace pruning first: a candidate's claims are checked before its tokens are compared.

Memory: tokens are not copied when the caller hands in a read-only, self-owned ``uint32``
array (what the directory does): the index keeps a reference and its address, so the directory
binding and the index share one array per content. Anything else is copied once. Chunk hashes
are kept the same way: a reference to the caller's ``bytes`` (the directory's dict key), read by
the kernels through its address.

Writes come one at a time (``add``, ``remove_claim``, ``remove_chunk``) or as an ordered batch
(``apply``, ``add_many``, ``remove_claims``): a batch is one lock hold and one compiled call, so
a reader sees all of it or none of it, and per-call overhead is paid once per batch.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import secrets
import sys
import threading
from collections import deque
from collections.abc import Iterable
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvatlas.directory import _blend_kernels as _k
from kvatlas.keys import BlendMatch, BlendNamespace, as_token_array

log = logging.getLogger(__name__)

_HASH_WIDTH = 32
_MIN_CAPACITY = 1024
_SEGMENT_WINDOWS = 65536
"""Window starts probed per lock acquisition in ``match``: bounds how long one query can hold
the lock (≈0.3 ms) so a 1M-token query never stalls ingestion behind it."""


class AddOp(NamedTuple):
    """Index ``chunk_hash`` (stored at ``token_offset``) as matchable for ``namespace``."""

    tokens: Any
    chunk_hash: bytes
    token_offset: int
    namespace: BlendNamespace


class RemoveClaimOp(NamedTuple):
    """Drop ``namespace``'s claim on the chunk; the occupant goes with its last claim."""

    tokens: Any
    chunk_hash: bytes
    namespace: BlendNamespace


class RemoveChunkOp(NamedTuple):
    """Drop the chunk's occupant and all its claims (re-stored with new content)."""

    tokens: Any
    chunk_hash: bytes


BlendOp = AddOp | RemoveClaimOp | RemoveChunkOp
"""One write of :meth:`BlendIndex.apply`: the arguments of the method of the same name."""


def _bytes_data_offset() -> int:
    """Offset of a ``bytes`` object's payload from its ``id`` (CPython: the header size)."""
    probe = b"kvatlas-blend-probe"
    addr = ctypes.cast(ctypes.c_char_p(probe), ctypes.c_void_p).value
    assert addr is not None
    off = addr - id(probe)
    if ctypes.string_at(id(probe) + off, len(probe)) != probe:  # pragma: no cover
        raise RuntimeError("cannot locate the payload of bytes objects")
    return off


def _array_data_offset() -> int:
    """Offset of an ndarray's ``data`` pointer field from its ``id`` (-1 if not found: the
    batch path then passes data addresses computed in Python, ≈1 µs each)."""
    probe = np.zeros(4, np.uint32)
    want = probe.ctypes.data
    for off in range(8, 64, 8):
        if ctypes.c_int64.from_address(id(probe) + off).value == want:
            return off
    return -1  # pragma: no cover


def _list_items_offset() -> int:
    """Offset of a ``list``'s item-array pointer from its ``id`` (-1 if not found). Used only
    to prefetch the chunk_hash slots a match is about to read."""
    probe: list[object] = [None, None]
    want = id(probe[0])
    for off in range(8, 64, 8):
        items = ctypes.c_int64.from_address(id(probe) + off).value
        if items > 4096 and ctypes.c_int64.from_address(items).value == want:
            return off
    return -1  # pragma: no cover


_BYTES_OFF = _bytes_data_offset()
_LIST_OFF = _list_items_offset()
_ARRAY_OFF = _array_data_offset()
_ADD, _REMOVE_CLAIM, _REMOVE_CHUNK, _SKIP = _k.ADD, _k.REMOVE_CLAIM, _k.REMOVE_CHUNK, _k.SKIP
_KINDS: dict[type, int] = {AddOp: _ADD, RemoveClaimOp: _REMOVE_CLAIM, RemoveChunkOp: _REMOVE_CHUNK}


_set_hash = BlendMatch.__dict__["chunk_hash"].__set__
_set_old = BlendMatch.__dict__["old_st"].__set__
_set_cur = BlendMatch.__dict__["cur_st"].__set__


def _make_match(chunk_hash: bytes, old_st: int, cur_st: int) -> BlendMatch:
    """``BlendMatch(...)`` without the frozen-dataclass ``__init__`` (≈40% of the per-hit
    Python cost): writes the slots directly, same resulting value."""
    m: BlendMatch = _new_object(BlendMatch)
    _set_hash(m, chunk_hash)
    _set_old(m, old_st)
    _set_cur(m, cur_st)
    return m


def _make_matches(hashes: list[bytes], offsets: list[int], starts: list[int]) -> list[BlendMatch]:
    """``[_make_match(h, o, s) ...]`` field by field: each step is one C-level ``map``, no
    Python frame per match."""
    out: list[BlendMatch] = list(map(_new_object, repeat(BlendMatch, len(hashes))))
    deque(map(_set_hash, out, hashes), 0)
    deque(map(_set_old, out, offsets), 0)
    deque(map(_set_cur, out, starts), 0)
    return out


def _shareable(arr: npt.NDArray[np.uint32]) -> bool:
    """Keep a caller's array only if nobody can change it under us and it pins no larger
    buffer (a read-only view of a 1M-token request must not keep the whole request alive)."""
    if arr.flags.writeable or not arr.flags.c_contiguous:
        return False
    if arr.flags.owndata:
        return True
    base = arr.base
    return isinstance(base, bytes) and len(base) == arr.nbytes


def _hash_bytes(chunk_hash: bytes) -> bytes:
    """The chunk hash as an exact ``bytes`` object (kept by reference, read by address)."""
    raw = chunk_hash if type(chunk_hash) is bytes else bytes(chunk_hash)
    if len(raw) > _HASH_WIDTH:
        raise ValueError(f"chunk_hash must be at most {_HASH_WIDTH} bytes, got {len(raw)}")
    return raw


def _tokens(tokens: Any) -> npt.NDArray[np.uint32]:
    if type(tokens) is np.ndarray and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return tokens  # the directory's arrays: skip re-validation on the ingest path
    return as_token_array(tokens)


def _offset(token_offset: Any) -> int:
    offset = operator.index(token_offset)
    if not 0 <= offset < 1 << 63:
        raise ValueError(f"token_offset must be >= 0, got {offset}")
    return offset


_new_object = object.__new__
_U32 = np.dtype(np.uint32)


class BlendIndex:
    """Fragment index over chunk contents; see the module docstring for its guarantees.

    Concurrency: one lock guards all state. ``match`` takes it once per segment of
    ``_SEGMENT_WINDOWS`` window starts rather than for the whole query: each segment is probed
    against a consistent state, and writers get the lock between segments, so a long query
    delays an ``add``/``remove`` by at most one segment (copy-on-write snapshots of a
    1M-entry table would cost more per write than they save). A chunk removed while a query
    runs may or may not be returned, exactly as if the removal happened before or after it.
    """

    def __init__(
        self,
        chunk_size: int = 256,
        probe_stride: int = 1,
        *,
        _fingerprint_bits: int = 61,
        _fingerprint_base: int | None = None,
    ) -> None:
        for name, value in (("chunk_size", chunk_size), ("probe_stride", probe_stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 1 <= _fingerprint_bits <= 61:
            raise ValueError("_fingerprint_bits must be in [1, 61]")
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        p = _k.MERSENNE61
        base = secrets.randbelow(p - 3) + 2 if _fingerprint_base is None else _fingerprint_base
        if not 1 <= base < p:
            raise ValueError("_fingerprint_base must be in [1, 2^61-1)")
        # The base is secret and per process: fingerprints are internal, never on the wire.
        self._base = base
        self._base_pow = pow(base, chunk_size, p)
        self._fmask = (1 << _fingerprint_bits) - 1
        self._lock = threading.Lock()
        self._scratch = threading.local()

        cap = _MIN_CAPACITY
        self._c_fp = np.zeros(cap, np.uint64)
        self._c_addr = np.zeros(cap, np.int64)
        self._c_first = np.full(cap, -1, np.int32)
        self._arrays: list[npt.NDArray[np.uint32] | None] = []
        self._owned: set[int] = set()  # content ids whose array is the index's own copy
        self._c_free: list[int] = []
        self._table = np.full(2 * cap, -1, np.int32)
        self._filt = np.zeros(cap // 4, np.uint64)
        self._stale = 0

        self._o_i64 = np.zeros((cap, 2), np.int64)
        self._o_i32 = np.zeros((cap, 3), np.int32)  # rows are initialised on first use
        self._o_hlen = np.zeros(cap, np.uint8)
        self._o_hashes: list[bytes | None] = []
        self._o_free: list[int] = []

        self._extra = np.full(16, -1, np.int64)
        self._n_extra = 0
        self._extra_claims: dict[int, set[int]] = {}

        self._ns_ids: dict[BlendNamespace, int] = {}
        self._ns_list: list[BlendNamespace | None] = []
        self._ns_refs: list[int] = []
        self._ns_free: list[int] = []
        self._ns_unclaimed: set[int] = set()  # refcount hit 0 during the current write

        self._n_contents = 0
        self._n_occupants = 0
        self._n_claims = 0
        self._owned_bytes = 0

    # ------------------------------------------------------------------ writes

    def add(
        self, tokens: Any, chunk_hash: bytes, token_offset: int, namespace: BlendNamespace
    ) -> None:
        """Index ``chunk_hash`` (stored at ``token_offset``) as matchable for ``namespace``.

        Idempotent; re-adding updates the offset. Offset -1 (unknown) is rejected: a match
        without a stored position would re-RoPE from the wrong source (wrong KV)."""
        offset = _offset(token_offset)
        arr = self._content(tokens)
        if arr is None:
            return
        h = _hash_bytes(chunk_hash)
        owned = not _shareable(arr)
        keep = arr
        if owned:
            keep = np.array(arr, dtype=np.uint32, order="C", copy=True)
            keep.setflags(write=False)
        with self._lock:
            ns = self._ns_register(namespace)
            new_cid = self._reserve_content()
            new_occ = self._reserve_occupant()
            if 2 * (self._n_extra + 1) > self._extra.shape[0]:
                self._grow_extra()
            flags, cid, occ, _ = _k.op_apply(
                _ADD, keep, id(h) + _BYTES_OFF, len(h), offset, ns, new_cid, new_occ,
                self._base, self._fmask, self._table, self._filt, self._c_fp, self._c_addr,
                self._c_first, self._o_i64, self._o_i32, self._o_hlen, self._extra,
            )  # fmt: skip
            if flags & _k.F_NEW_CONTENT and self._c_free and self._c_free[-1] == cid:
                self._c_free.pop()
            if flags & _k.F_NEW_OCCUPANT and self._o_free and self._o_free[-1] == occ:
                self._o_free.pop()
            self._settle(_ADD, flags, cid, occ, -1, ns, keep, owned, h)
            if self._ns_refs[ns] == 0:
                self._ns_unregister(ns)

    def remove_claim(self, tokens: Any, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        """Drop ``namespace``'s claim; the occupant goes with its last claim. Unknown: no-op."""
        arr = self._content(tokens, quiet=True)
        if arr is None:
            return
        h = _hash_bytes(chunk_hash)
        with self._lock:
            ns = self._ns_ids.get(namespace)
            if ns is not None:
                self._remove_locked(_REMOVE_CLAIM, arr, h, ns)

    def remove_chunk(self, tokens: Any, chunk_hash: bytes) -> None:
        """Drop the occupant and all its claims at once (chunk_hash re-stored with new content)."""
        arr = self._content(tokens, quiet=True)
        if arr is None:
            return
        h = _hash_bytes(chunk_hash)
        with self._lock:
            self._remove_locked(_REMOVE_CHUNK, arr, h, -1)

    def apply(self, ops: Iterable[BlendOp]) -> None:
        """Apply writes in order, atomically: one lock hold and one compiled call for all.

        Each op has the effect of the method it names (see :data:`BlendOp`), in sequence; a
        concurrent ``match`` sees the state before the batch or after it, never in between
        (so a ``remove_chunk`` followed by re-``add``s of a re-stored chunk has no window).
        Every op is validated before anything changes: an invalid op raises and applies none.
        """
        kinds: list[int] = []
        arrays: list[npt.NDArray[np.uint32]] = []
        hashes: list[bytes] = []
        offsets: list[int] = []
        spaces: list[BlendNamespace | None] = []
        owned: list[bool] = []
        chunk = self.chunk_size
        for op in ops:
            kind = _KINDS.get(type(op))
            if kind is None:
                raise ValueError(f"not a blend index op: {op!r}")
            tokens, chunk_hash = op.tokens, op.chunk_hash
            offset, namespace = 0, None
            if isinstance(op, AddOp):
                offset, namespace = op.token_offset, op.namespace
                if type(offset) is not int or not 0 <= offset < 1 << 63:
                    offset = _offset(offset)
            elif isinstance(op, RemoveClaimOp):
                namespace = op.namespace
            if type(tokens) is np.ndarray and tokens.dtype is _U32 and tokens.ndim == 1:
                arr = tokens  # the directory's arrays: no re-validation on the ingest path
            else:
                arr = as_token_array(tokens)
            if arr.shape[0] != chunk:
                self._content(arr, quiet=kind != _ADD)  # logs for adds
                continue
            h = (
                chunk_hash
                if type(chunk_hash) is bytes and len(chunk_hash) <= _HASH_WIDTH
                else (_hash_bytes(chunk_hash))
            )
            own = False
            if kind == _ADD:
                own = not _shareable(arr)
                if own:
                    arr = np.array(arr, dtype=np.uint32, order="C", copy=True)
                    arr.setflags(write=False)
            elif not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            kinds.append(kind)
            arrays.append(arr)
            hashes.append(h)
            offsets.append(offset)
            spaces.append(namespace)
            owned.append(own)
        if kinds:
            with self._lock:
                self._apply_locked(kinds, arrays, hashes, offsets, spaces, owned)

    def add_many(self, items: Iterable[tuple[Any, bytes, int, BlendNamespace]]) -> None:
        """``add`` for each ``(tokens, chunk_hash, token_offset, namespace)``, as one batch."""
        self.apply([AddOp(*item) for item in items])

    def remove_claims(self, items: Iterable[tuple[Any, bytes, BlendNamespace]]) -> None:
        """``remove_claim`` for each ``(tokens, chunk_hash, namespace)``, as one batch."""
        self.apply([RemoveClaimOp(*item) for item in items])

    # ------------------------------------------------------------------ reads

    def match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """Chunks of ``namespace`` whose content occurs in ``tokens`` at a probed position.

        Ascending by ``cur_st``, at most one per chunk_hash (its first verified, claimed
        occurrence); matches may overlap."""
        q = np.ascontiguousarray(_tokens(tokens))
        chunk, stride = self.chunk_size, self.probe_stride
        n_starts = q.shape[0] - chunk + 1
        if n_starts <= 0:
            return []
        seg = max(1, _SEGMENT_WINDOWS // stride) * stride
        qt, fps_buf, cand_pos, cand_fp = self._scratch_for(min(seg, n_starts))
        out: list[BlendMatch] = []
        seen: set[bytes] = set()
        for start in range(0, n_starts, seg):
            stop = min(start + seg, n_starts)
            with self._lock:
                ns = self._ns_ids.get(namespace)
                if ns is None:
                    continue
                names = self._o_hashes
                items = (
                    ctypes.c_int64.from_address(id(names) + _LIST_OFF).value if _LIST_OFF > 0 else 0
                )
                pos, occ, off = _k.scan(
                    q, start, stop, stride, chunk, ns, self._base, self._base_pow, self._fmask,
                    self._table, self._filt, self._c_fp, self._c_addr, self._c_first,
                    self._o_i32, self._o_i64, self._extra, qt, fps_buf, cand_pos, cand_fp,
                    items, _BYTES_OFF,
                )  # fmt: skip
                if pos.shape[0] == 0:
                    continue
                hashes = list(map(names.__getitem__, occ.tolist()))
            fresh = set(hashes)
            if len(fresh) == len(hashes) and seen.isdisjoint(fresh):
                # the common case: every chunk_hash is new — no per-hit bookkeeping
                out += _make_matches(hashes, off.tolist(), pos.tolist())  # type: ignore[arg-type]
                seen |= fresh  # type: ignore[arg-type]
                continue
            for p, h, o in zip(pos.tolist(), hashes, off.tolist(), strict=True):
                if h not in seen:
                    assert h is not None
                    seen.add(h)
                    out.append(_make_match(h, o, p))
        return out

    def stats(self) -> dict[str, int]:
        """Counts, table sizes and bytes; ``index_bytes`` excludes token arrays (reported as
        ``token_bytes``: ``owned`` = copies the index made, ``shared`` = the caller's) but
        includes the chunk_hash payloads the index references."""
        with self._lock:
            arrays = (
                self._c_fp, self._c_addr, self._c_first, self._table, self._filt, self._o_i64,
                self._o_i32, self._o_hlen, self._extra,
            )  # fmt: skip
            index_bytes = sum(a.nbytes for a in arrays) + 8 * len(self._arrays)
            index_bytes += 8 * len(self._o_hashes) + _HASH_WIDTH * self._n_occupants
            index_bytes += sum(
                100 + sys.getsizeof(s) for s in self._extra_claims.values()
            )  # dict entry + set: multi-namespace occupants only
            token_bytes = self._n_contents * self.chunk_size * 4
            return {
                "contents": self._n_contents,
                "occupants": self._n_occupants,
                "claims": self._n_claims,
                "namespaces": len(self._ns_ids),
                "content_capacity": int(self._c_fp.shape[0]),
                "occupant_capacity": int(self._o_i64.shape[0]),
                "table_slots": int(self._table.shape[0]),
                "filter_bits": int(self._filt.shape[0]) * 64,
                "extra_claim_slots": int(self._extra.shape[0]),
                "index_bytes": int(index_bytes),
                "token_bytes": token_bytes,
                "token_bytes_owned": self._owned_bytes,
                "token_bytes_shared": token_bytes - self._owned_bytes,
            }

    # ------------------------------------------------------------------ internals

    def _content(self, tokens: Any, quiet: bool = False) -> npt.NDArray[np.uint32] | None:
        """The tokens as a uint32 array, or ``None`` (logged for adds) if not chunk-sized."""
        arr = _tokens(tokens)
        if arr.shape[0] == self.chunk_size:
            return arr
        if not quiet:
            log.info(
                "blend index: not indexing %d-token content (chunk_size %d)",
                arr.shape[0],
                self.chunk_size,
            )
        return None

    def _remove_locked(self, kind: int, arr: npt.NDArray[np.uint32], h: bytes, ns: int) -> None:
        flags, cid, occ, ns0 = _k.op_apply(
            kind, arr, id(h) + _BYTES_OFF, len(h), 0, ns, -1, -1, self._base, self._fmask,
            self._table, self._filt, self._c_fp, self._c_addr, self._c_first, self._o_i64,
            self._o_i32, self._o_hlen, self._extra,
        )  # fmt: skip
        if flags:
            self._settle(kind, flags, cid, occ, ns0, ns, None, False, h)
            self._ns_prune()
            self._maybe_rebuild()

    def _apply_locked(
        self,
        kinds: list[int],
        arrays: list[npt.NDArray[np.uint32]],
        hashes: list[bytes],
        offsets: list[int],
        spaces: list[BlendNamespace | None],
        owned: list[bool],
    ) -> None:
        k = len(kinds)
        nss: list[int] = []
        n_add = 0
        last: BlendNamespace | None = None  # batches are mostly one namespace: skip its hash
        last_ns = -1
        for i in range(k):
            if kinds[i] == _ADD:
                namespace = spaces[i]
                assert namespace is not None
                if namespace is not last:
                    last, last_ns = namespace, self._ns_register(namespace)
                nss.append(last_ns)
                n_add += 1
            elif kinds[i] == _REMOVE_CLAIM:
                ns = self._ns_ids.get(spaces[i])  # type: ignore[arg-type]
                if ns is None:
                    kinds[i] = _SKIP  # a namespace without claims has nothing to drop
                    ns = -1
                nss.append(ns)
            else:
                nss.append(-1)
        new_cids = self._content_pool(n_add)
        new_occs = self._occupant_pool(n_add)
        while 2 * (self._n_extra + n_add) > self._extra.shape[0]:
            self._grow_extra()
        if _ARRAY_OFF >= 0:
            t_addr = np.array([id(a) for a in arrays], np.int64)
        else:  # pragma: no cover - numpy layout not recognised
            t_addr = np.array([a.ctypes.data for a in arrays], np.int64)
        out = np.empty((k, 4), np.int64)
        used_c, used_o = _k.apply_ops(
            np.array(kinds, np.int8), t_addr,
            np.array([id(h) + _BYTES_OFF for h in hashes], np.int64),
            np.array([len(h) for h in hashes], np.int64), np.array(offsets, np.int64),
            np.array(nss, np.int64), self.chunk_size, _ARRAY_OFF, new_cids, new_occs,
            self._base, self._fmask, self._table, self._filt, self._c_fp, self._c_addr,
            self._c_first, self._o_i64, self._o_i32, self._o_hlen, self._extra, out,
        )  # fmt: skip
        self._take_pool(self._c_free, int(used_c), self._arrays)
        self._take_pool(self._o_free, int(used_o), self._o_hashes)
        settle = self._settle
        for i, (flags, cid, occ, ns0) in enumerate(out.tolist()):
            if flags:
                settle(kinds[i], flags, cid, occ, ns0, nss[i], arrays[i], owned[i], hashes[i])
        self._ns_prune()
        self._maybe_rebuild()

    def _settle(
        self,
        kind: int,
        flags: int,
        cid: int,
        occ: int,
        ns0: int,
        ns: int,
        keep: npt.NDArray[np.uint32] | None,
        owned: bool,
        h: bytes,
    ) -> None:
        """Python-side bookkeeping of one applied op (kernel ``flags``): the references that
        keep token arrays and hashes alive, counters, free lists, namespace refcounts."""
        if flags & _k.F_NEW_CONTENT:
            if cid == len(self._arrays):
                self._arrays.append(keep)
            else:
                self._arrays[cid] = keep
            if owned and keep is not None:
                self._owned.add(cid)
                self._owned_bytes += keep.nbytes
            self._n_contents += 1
        if flags & _k.F_NEW_OCCUPANT:
            if occ == len(self._o_hashes):
                self._o_hashes.append(h)
            else:
                self._o_hashes[occ] = h
            self._n_occupants += 1
        if flags & _k.F_NEW_CLAIM:
            self._ns_refs[ns] += 1
            self._n_claims += 1
            if flags & _k.F_EXTRA_CLAIM:
                self._extra_claims.setdefault(occ, set()).add(ns)
                self._n_extra += 1
        if flags & _k.F_CLAIM_DROPPED:
            self._release_claim(ns)
            if flags & _k.F_EXTRA_CLAIM:
                self._forget_extra(occ, ns)
        if kind == _REMOVE_CHUNK:
            if ns0 >= 0:
                self._release_claim(ns0)
            for other in self._extra_claims.pop(occ, ()):
                _k.extra_delete(self._extra, (occ << 32) | other)
                self._n_extra -= 1
                self._release_claim(other)
        if flags & _k.F_OCCUPANT_GONE:
            self._o_hashes[occ] = None
            self._o_free.append(occ)
            self._n_occupants -= 1
        if flags & _k.F_CONTENT_GONE:
            arr = self._arrays[cid]
            if cid in self._owned and arr is not None:
                self._owned.discard(cid)
                self._owned_bytes -= arr.nbytes
            self._arrays[cid] = None
            self._c_free.append(cid)
            self._n_contents -= 1
            self._stale += 1

    def _content_pool(self, n: int) -> npt.NDArray[np.int32]:
        """Ids for up to ``n`` new contents: free ids (last first), then fresh ones."""
        free = self._c_free
        f = min(n, len(free))
        hwm = len(self._arrays)
        while hwm + n - f > self._c_fp.shape[0]:
            self._grow_contents()
        return np.array([*free[len(free) - f :][::-1], *range(hwm, hwm + n - f)], np.int32)

    def _occupant_pool(self, n: int) -> npt.NDArray[np.int32]:
        free = self._o_free
        f = min(n, len(free))
        hwm = len(self._o_hashes)
        while hwm + n - f > self._o_i64.shape[0]:
            self._grow_occupants()
        return np.array([*free[len(free) - f :][::-1], *range(hwm, hwm + n - f)], np.int32)

    @staticmethod
    def _take_pool(free: list[int], used: int, slots: list[Any]) -> None:
        """Retire the first ``used`` pool ids: free ones leave the free list, fresh ones get a
        (placeholder) slot that ``_settle`` fills."""
        f = min(used, len(free))
        if f:
            del free[len(free) - f :]
        slots.extend([None] * (used - f))

    def _scratch_for(self, windows: int) -> tuple[Any, Any, Any, Any]:
        """Per-thread scan buffers, kept between queries: fresh large arrays cost page
        faults (≈40 µs per 64k windows), more than the filter pass itself."""
        qt_shape, fps_shape, n_cand = _k.scan_scratch_shapes(windows, self.chunk_size)
        cached = getattr(self._scratch, "buffers", None)
        if cached is None or cached[2].shape[0] < n_cand or cached[0].shape[0] < qt_shape[0]:
            cached = (
                np.empty(qt_shape, np.uint32),
                np.empty(fps_shape, np.uint64),
                np.empty(n_cand, np.int64),
                np.empty(n_cand, np.uint64),
            )
            self._scratch.buffers = cached
        return cached

    def _ns_register(self, namespace: BlendNamespace) -> int:
        ns = self._ns_ids.get(namespace)
        if ns is None:
            if self._ns_free:
                ns = self._ns_free.pop()
                self._ns_list[ns] = namespace
                self._ns_refs[ns] = 0
            else:
                ns = len(self._ns_list)
                self._ns_list.append(namespace)
                self._ns_refs.append(0)
            self._ns_ids[namespace] = ns
        return ns

    def _ns_unregister(self, ns: int) -> None:
        namespace = self._ns_list[ns]
        assert namespace is not None
        del self._ns_ids[namespace]
        self._ns_list[ns] = None
        self._ns_free.append(ns)

    def _ns_prune(self) -> None:
        """Unregister namespaces left without claims (deferred to the end of a write, so ids
        stay stable within a batch)."""
        if self._ns_unclaimed:
            for ns in self._ns_unclaimed:
                if self._ns_refs[ns] == 0 and self._ns_list[ns] is not None:
                    self._ns_unregister(ns)
            self._ns_unclaimed.clear()

    def _release_claim(self, ns: int) -> None:
        self._n_claims -= 1
        self._ns_refs[ns] -= 1
        if self._ns_refs[ns] == 0:
            self._ns_unclaimed.add(ns)

    def _forget_extra(self, occ: int, ns: int) -> None:
        claims = self._extra_claims[occ]
        claims.discard(ns)
        if not claims:
            del self._extra_claims[occ]
        self._n_extra -= 1

    def _maybe_rebuild(self) -> None:
        if self._stale > self._n_contents // 2 + _MIN_CAPACITY:
            self._rebuild()  # the filter only ever gains bits: shed removed contents' bits

    def _reserve_content(self) -> int:
        if self._c_free:
            return self._c_free[-1]
        cid = len(self._arrays)
        if cid == self._c_fp.shape[0]:
            self._grow_contents()
        return cid

    def _reserve_occupant(self) -> int:
        if self._o_free:
            return self._o_free[-1]
        occ = len(self._o_hashes)
        if occ == self._o_i64.shape[0]:
            self._grow_occupants()
        return occ

    def _grow_contents(self) -> None:
        cap = 2 * self._c_fp.shape[0]
        self._c_fp = _resized(self._c_fp, cap, 0)
        self._c_addr = _resized(self._c_addr, cap, 0)
        self._c_first = _resized(self._c_first, cap, -1)
        self._rebuild()

    def _rebuild(self) -> None:
        """Table = 2 slots per content slot (load <= 1/2); filter = 16 bits per content slot."""
        cap = self._c_fp.shape[0]
        self._table = np.full(2 * cap, -1, np.int32)
        self._filt = np.zeros(max(2, cap // 4), np.uint64)
        _k.rebuild(self._table, self._filt, self._c_fp, self._c_addr, len(self._arrays))
        self._stale = 0

    def _grow_occupants(self) -> None:
        cap = 2 * self._o_i64.shape[0]
        self._o_i64 = _resized(self._o_i64, cap, 0)
        self._o_i32 = _resized(self._o_i32, cap, 0)
        self._o_hlen = _resized(self._o_hlen, cap, 0)

    def _grow_extra(self) -> None:
        new = np.full(2 * self._extra.shape[0], -1, np.int64)
        _k.extra_rehash(self._extra, new)
        self._extra = new


def _resized(arr: npt.NDArray[Any], cap: int, fill: int) -> npt.NDArray[Any]:
    out = np.full((cap, *arr.shape[1:]), fill, dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out
