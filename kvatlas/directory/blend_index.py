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
binding and the index share one array per content. Anything else is copied once.
"""

from __future__ import annotations

import logging
import operator
import secrets
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory import _blend_kernels as _k
from kvatlas.keys import BlendNamespace, as_token_array

log = logging.getLogger(__name__)

_HASH_WIDTH = 32
_MIN_CAPACITY = 1024
_SEGMENT_WINDOWS = 32768
"""Window starts probed per lock acquisition in ``match``: bounds how long one query can hold
the lock (≈0.1 ms) so a 1M-token query never stalls ingestion behind it."""


@dataclass(frozen=True, slots=True)
class BlendMatch:
    """A cached chunk found in a query: re-RoPE its KV from ``old_st`` to ``cur_st``."""

    chunk_hash: bytes
    old_st: int
    cur_st: int


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


def _shareable(arr: npt.NDArray[np.uint32]) -> bool:
    """Keep a caller's array only if nobody can change it under us and it pins no larger
    buffer (a read-only view of a 1M-token request must not keep the whole request alive)."""
    if arr.flags.writeable or not arr.flags.c_contiguous:
        return False
    if arr.flags.owndata:
        return True
    base = arr.base
    return isinstance(base, bytes) and len(base) == arr.nbytes


def _hash_array(chunk_hash: bytes) -> bytes:
    """Kernels read ``bytes`` directly (a read-only uint8 buffer to numba)."""
    raw = chunk_hash if type(chunk_hash) is bytes else bytes(chunk_hash)
    if len(raw) > _HASH_WIDTH:
        raise ValueError(f"chunk_hash must be at most {_HASH_WIDTH} bytes, got {len(raw)}")
    return raw


def _tokens(tokens: Any) -> npt.NDArray[np.uint32]:
    if type(tokens) is np.ndarray and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return tokens  # the directory's arrays: skip re-validation on the ingest path
    return as_token_array(tokens)


_new_object = object.__new__


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

        cap = _MIN_CAPACITY
        self._c_fp = np.zeros(cap, np.uint64)
        self._c_addr = np.zeros(cap, np.int64)
        self._c_first = np.full(cap, -1, np.int32)
        self._c_owned = np.zeros(cap, np.uint8)
        self._arrays: list[npt.NDArray[np.uint32] | None] = []
        self._c_free: list[int] = []
        self._table = np.full(2 * cap, -1, np.int32)
        self._filt = np.zeros(cap // 4, np.uint64)
        self._stale = 0

        self._o_hash = np.zeros((cap, _HASH_WIDTH), np.uint8)
        self._o_hlen = np.zeros(cap, np.uint8)
        self._o_off = np.zeros(cap, np.int64)
        self._o_next = np.full(cap, -1, np.int32)
        self._o_ns0 = np.full(cap, -1, np.int32)
        self._o_nclaims = np.zeros(cap, np.int32)
        self._o_hwm = 0
        self._o_free: list[int] = []

        self._extra = np.full(16, -1, np.int64)
        self._n_extra = 0
        self._extra_claims: dict[int, set[int]] = {}

        self._ns_ids: dict[BlendNamespace, int] = {}
        self._ns_list: list[BlendNamespace | None] = []
        self._ns_refs: list[int] = []
        self._ns_free: list[int] = []

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
        offset = operator.index(token_offset)
        if not 0 <= offset < 1 << 63:
            raise ValueError(f"token_offset must be >= 0, got {offset}")
        arr = _tokens(tokens)
        if arr.shape[0] != self.chunk_size:
            log.info(
                "blend index: not indexing %d-token content (chunk_size %d)",
                arr.shape[0],
                self.chunk_size,
            )
            return
        h = _hash_array(chunk_hash)
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
            flags, cid, occ = _k.add_entry(
                keep, h, offset, ns, new_cid, new_occ, self._base, self._fmask,
                self._table, self._filt, self._c_fp, self._c_addr, self._c_first,
                self._o_hash, self._o_hlen, self._o_off, self._o_next, self._o_ns0,
                self._o_nclaims, self._extra,
            )  # fmt: skip
            if flags & 1:
                if self._c_free and self._c_free[-1] == cid:
                    self._c_free.pop()
                if cid == len(self._arrays):
                    self._arrays.append(keep)
                else:
                    self._arrays[cid] = keep
                self._c_owned[cid] = owned
                if owned:
                    self._owned_bytes += keep.nbytes
                self._n_contents += 1
            if flags & 2:
                if self._o_free and self._o_free[-1] == occ:
                    self._o_free.pop()
                else:
                    self._o_hwm += 1
                self._n_occupants += 1
            if flags & 4:
                self._ns_refs[ns] += 1
                self._n_claims += 1
            if flags & 8:
                self._extra_claims.setdefault(occ, set()).add(ns)
                self._n_extra += 1
            if self._ns_refs[ns] == 0:
                self._ns_unregister(ns)

    def remove_claim(self, tokens: Any, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        """Drop ``namespace``'s claim; the occupant goes with its last claim. Unknown: no-op."""
        arr = _tokens(tokens)
        if arr.shape[0] != self.chunk_size:
            return
        h = _hash_array(chunk_hash)
        with self._lock:
            ns = self._ns_ids.get(namespace)
            if ns is None:
                return
            cid, slot, occ = self._locate(arr, h)
            if occ == -1:
                return
            where = _k.drop_claim(occ, ns, self._o_ns0, self._o_nclaims, self._extra)
            if where == 0:
                return
            if where == 2:
                self._forget_extra(occ, ns)
            self._release_claim(ns)
            if self._o_nclaims[occ] == 0:
                self._drop_occupant(cid, slot, occ)

    def remove_chunk(self, tokens: Any, chunk_hash: bytes) -> None:
        """Drop the occupant and all its claims at once (chunk_hash re-stored with new content)."""
        arr = _tokens(tokens)
        if arr.shape[0] != self.chunk_size:
            return
        h = _hash_array(chunk_hash)
        with self._lock:
            cid, slot, occ = self._locate(arr, h)
            if occ == -1:
                return
            for ns in self._extra_claims.pop(occ, ()):
                _k.extra_delete(self._extra, (occ << 32) | ns)
                self._n_extra -= 1
                self._release_claim(ns)
            ns0 = int(self._o_ns0[occ])
            if ns0 >= 0:
                self._release_claim(ns0)
            self._o_ns0[occ] = -1
            self._o_nclaims[occ] = 0
            self._drop_occupant(cid, slot, occ)

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
        out: list[BlendMatch] = []
        seen: set[bytes] = set()
        for start in range(0, n_starts, seg):
            stop = min(start + seg, n_starts)
            with self._lock:
                ns = self._ns_ids.get(namespace)
                if ns is None:
                    continue
                pos, occ = _k.scan(
                    q, start, stop, stride, chunk, ns, self._base, self._base_pow, self._fmask,
                    self._table, self._filt, self._c_fp, self._c_addr, self._c_first,
                    self._o_next, self._o_ns0, self._o_nclaims, self._extra,
                )  # fmt: skip
                if pos.shape[0] == 0:
                    continue
                hashes = self._hash_bytes(occ)
                offsets = self._o_off[occ].tolist()
            for p, h, off in zip(pos.tolist(), hashes, offsets, strict=True):
                if h not in seen:
                    seen.add(h)
                    out.append(_make_match(h, off, p))
        return out

    def stats(self) -> dict[str, int]:
        """Counts, table sizes and bytes; ``index_bytes`` excludes token arrays (reported as
        ``token_bytes``: ``owned`` = copies the index made, ``shared`` = the caller's)."""
        with self._lock:
            arrays = (
                self._c_fp, self._c_addr, self._c_first, self._c_owned, self._table,
                self._filt, self._o_hash, self._o_hlen, self._o_off, self._o_next,
                self._o_ns0, self._o_nclaims, self._extra,
            )  # fmt: skip
            index_bytes = sum(a.nbytes for a in arrays) + 8 * len(self._arrays)
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
                "occupant_capacity": int(self._o_off.shape[0]),
                "table_slots": int(self._table.shape[0]),
                "filter_bits": int(self._filt.shape[0]) * 64,
                "extra_claim_slots": int(self._extra.shape[0]),
                "index_bytes": int(index_bytes),
                "token_bytes": token_bytes,
                "token_bytes_owned": self._owned_bytes,
                "token_bytes_shared": token_bytes - self._owned_bytes,
            }

    # ------------------------------------------------------------------ internals

    def _locate(self, arr: npt.NDArray[np.uint32], h: bytes) -> tuple[int, int, int]:
        cid, slot, occ = _k.locate(
            arr, h, self._base, self._fmask, self._table, self._c_fp, self._c_addr,
            self._c_first, self._o_next, self._o_hash, self._o_hlen,
        )  # fmt: skip
        return int(cid), int(slot), int(occ)

    def _hash_bytes(self, occ: npt.NDArray[np.int32]) -> list[bytes]:
        rows = self._o_hash[occ]
        lens = self._o_hlen[occ]
        if bool((lens == _HASH_WIDTH).all()):
            flat = rows.tobytes()
            return [flat[i : i + _HASH_WIDTH] for i in range(0, len(flat), _HASH_WIDTH)]
        return [rows[i, : lens[i]].tobytes() for i in range(rows.shape[0])]

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

    def _release_claim(self, ns: int) -> None:
        self._n_claims -= 1
        self._ns_refs[ns] -= 1
        if self._ns_refs[ns] == 0:
            self._ns_unregister(ns)

    def _forget_extra(self, occ: int, ns: int) -> None:
        claims = self._extra_claims[occ]
        claims.discard(ns)
        if not claims:
            del self._extra_claims[occ]
        self._n_extra -= 1

    def _drop_occupant(self, cid: int, slot: int, occ: int) -> None:
        gone = _k.unlink_occupant(
            cid, slot, occ, self._table, self._c_fp, self._c_addr, self._c_first, self._o_next
        )
        self._o_free.append(occ)
        self._n_occupants -= 1
        if not gone:
            return
        arr = self._arrays[cid]
        if self._c_owned[cid] and arr is not None:
            self._owned_bytes -= arr.nbytes
        self._arrays[cid] = None
        self._c_free.append(cid)
        self._n_contents -= 1
        self._stale += 1
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
        if self._o_hwm == self._o_off.shape[0]:
            self._grow_occupants()
        return self._o_hwm

    def _grow_contents(self) -> None:
        cap = 2 * self._c_fp.shape[0]
        self._c_fp = _resized(self._c_fp, cap, 0)
        self._c_addr = _resized(self._c_addr, cap, 0)
        self._c_first = _resized(self._c_first, cap, -1)
        self._c_owned = _resized(self._c_owned, cap, 0)
        self._rebuild()

    def _rebuild(self) -> None:
        """Table = 2 slots per content slot (load <= 1/2); filter = 16 bits per content slot."""
        cap = self._c_fp.shape[0]
        self._table = np.full(2 * cap, -1, np.int32)
        self._filt = np.zeros(max(2, cap // 4), np.uint64)
        _k.rebuild(self._table, self._filt, self._c_fp, self._c_addr, len(self._arrays))
        self._stale = 0

    def _grow_occupants(self) -> None:
        cap = 2 * self._o_off.shape[0]
        self._o_hash = _resized(self._o_hash, cap, 0)
        self._o_hlen = _resized(self._o_hlen, cap, 0)
        self._o_off = _resized(self._o_off, cap, 0)
        self._o_next = _resized(self._o_next, cap, -1)
        self._o_ns0 = _resized(self._o_ns0, cap, -1)
        self._o_nclaims = _resized(self._o_nclaims, cap, 0)

    def _grow_extra(self) -> None:
        new = np.full(2 * self._extra.shape[0], -1, np.int64)
        _k.extra_rehash(self._extra, new)
        self._extra = new


def _resized(arr: npt.NDArray[Any], cap: int, fill: int) -> npt.NDArray[Any]:
    out = np.full((cap, *arr.shape[1:]), fill, dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out
