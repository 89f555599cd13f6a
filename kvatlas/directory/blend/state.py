"""The blend index's state, and the one way it changes: :meth:`IndexState.apply`.

State is the kernels' arrays (``kernels.BlendArrays``) plus what Python holds for them: the
token arrays and chunk_hash ``bytes`` whose addresses those arrays store (kept alive here, by
reference), free id lists, counters and namespace ids. A batch of writes is one compiled call
followed by the bookkeeping the kernel reports for each op, so the two never disagree once
``apply`` returns. Not thread-safe: :class:`BlendIndex` holds its lock around every use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import _cpython, kernels
from kvatlas.directory.blend.namespaces import NamespaceIds
from kvatlas.keys import BlendNamespace

MIN_CAPACITY = 1024
"""Initial content and occupant capacity; both double when full."""

Tokens = npt.NDArray[np.uint32]


@dataclass(slots=True)
class Batch:
    """Validated ops, in order: chunk-sized C-contiguous token arrays, exact ``bytes``
    hashes, non-negative offsets. ``owned``: the array is the index's own copy."""

    kinds: list[int] = field(default_factory=list)
    tokens: list[Tokens] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    namespaces: list[BlendNamespace | None] = field(default_factory=list)
    owned: list[bool] = field(default_factory=list)


class IndexState:
    def __init__(self, chunk_size: int, base: int, fmask: int) -> None:
        self.chunk_size = chunk_size
        self.base = base
        self.fmask = fmask
        self.arrays = kernels.BlendArrays.empty(MIN_CAPACITY)
        self.namespaces = NamespaceIds()
        self.tokens: list[Tokens | None] = []  # per content id: the array c_addr points into
        self.hashes: list[bytes | None] = []  # per occupant id: the bytes o_i64 points into
        self.owned: set[int] = set()  # content ids whose array is the index's own copy
        self.extra_claims: dict[int, set[int]] = {}  # occupant -> its extra-set namespaces
        self._c_free: list[int] = []
        self._o_free: list[int] = []
        self.contents = 0
        self.occupants = 0
        self.claims = 0
        self.owned_bytes = 0
        self.n_extra = 0
        self._stale = 0  # contents removed since the filter was last rebuilt

    def apply(self, batch: Batch) -> None:
        kinds = batch.kinds
        nss: list[int] = []
        n_add = 0
        last: BlendNamespace | None = None  # batches are mostly one namespace: skip its hash
        last_ns = -1
        for i, namespace in enumerate(batch.namespaces):
            if kinds[i] == kernels.ADD:
                assert namespace is not None
                if namespace is not last:
                    last, last_ns = namespace, self.namespaces.register(namespace)
                nss.append(last_ns)
                n_add += 1
            elif kinds[i] == kernels.REMOVE_CLAIM:
                assert namespace is not None
                ns = self.namespaces.get(namespace)
                if ns is None:
                    kinds[i] = kernels.SKIP  # a namespace without claims has nothing to drop
                    ns = -1
                nss.append(ns)
            else:
                nss.append(-1)
        new_cids = self._content_ids(n_add)
        new_occs = self._occupant_ids(n_add)
        while 2 * (self.n_extra + n_add) > self.arrays.claims.shape[0]:
            self._grow_claims()
        hashes = batch.hashes
        ops = kernels.OpBatch(
            np.array(kinds, np.int8),
            _cpython.array_handles(batch.tokens),
            np.array(list(map(_cpython.bytes_address, hashes)), np.int64),
            np.array(list(map(len, hashes)), np.int64),
            np.array(batch.offsets, np.int64),
            np.array(nss, np.int64),
        )
        out = np.empty((len(kinds), 4), np.int64)
        used_c, used_o = kernels.apply_ops(
            ops, self.chunk_size, _cpython.ARRAY_DATA_OFFSET, new_cids, new_occs, self.base,
            self.fmask, self.arrays, out,
        )  # fmt: skip
        _take_ids(self._c_free, int(used_c), self.tokens)
        _take_ids(self._o_free, int(used_o), self.hashes)
        tokens, owned = batch.tokens, batch.owned
        for i, (flags, cid, occ, ns0) in enumerate(out.tolist()):
            if flags:
                self._settle(kinds[i], flags, cid, occ, nss[i], ns0, tokens[i], owned[i], hashes[i])
        self.namespaces.end_write()
        if self._stale > self.contents // 2 + MIN_CAPACITY:
            self.rebuild()  # the filter only ever gains bits: shed removed contents' bits

    def _settle(
        self,
        kind: int,
        flags: int,
        cid: int,
        occ: int,
        ns: int,
        ns0: int,
        tokens: Tokens,
        owned: bool,
        h: bytes,
    ) -> None:
        """Python-side bookkeeping of one applied op (kernel ``flags``): the references that
        keep token arrays and hashes alive, counters, free lists, namespace claims."""
        if flags & kernels.F_NEW_CONTENT:
            self.tokens[cid] = tokens
            if owned:
                self.owned.add(cid)
                self.owned_bytes += tokens.nbytes
            self.contents += 1
        if flags & kernels.F_NEW_OCCUPANT:
            self.hashes[occ] = h
            self.occupants += 1
        if flags & kernels.F_NEW_CLAIM:
            self.namespaces.claim(ns)
            self.claims += 1
            if flags & kernels.F_EXTRA_CLAIM:
                self.extra_claims.setdefault(occ, set()).add(ns)
                self.n_extra += 1
        if flags & kernels.F_CLAIM_DROPPED:
            self._release_claim(ns)
            if flags & kernels.F_EXTRA_CLAIM:
                self._forget_extra(occ, ns)
        if kind == kernels.REMOVE_CHUNK:
            if ns0 >= 0:
                self._release_claim(ns0)
            for other in self.extra_claims.pop(occ, ()):
                kernels.drop_extra_claim(occ, other, self.arrays.claims)
                self.n_extra -= 1
                self._release_claim(other)
        if flags & kernels.F_OCCUPANT_GONE:
            self.hashes[occ] = None
            self._o_free.append(occ)
            self.occupants -= 1
        if flags & kernels.F_CONTENT_GONE:
            gone = self.tokens[cid]
            if cid in self.owned and gone is not None:
                self.owned.discard(cid)
                self.owned_bytes -= gone.nbytes
            self.tokens[cid] = None
            self._c_free.append(cid)
            self.contents -= 1
            self._stale += 1

    def _release_claim(self, ns: int) -> None:
        self.claims -= 1
        self.namespaces.release(ns)

    def _forget_extra(self, occ: int, ns: int) -> None:
        claims = self.extra_claims[occ]
        claims.discard(ns)
        if not claims:
            del self.extra_claims[occ]
        self.n_extra -= 1

    def _content_ids(self, n: int) -> npt.NDArray[np.int32]:
        """Ids for up to ``n`` new contents: free ones (last first), then fresh ones."""
        free = self._c_free
        f = min(n, len(free))
        hwm = len(self.tokens)
        while hwm + n - f > self.arrays.content_capacity:
            self.arrays = self.arrays.with_content_capacity(2 * self.arrays.content_capacity)
            self.rebuild()
        return np.array([*free[len(free) - f :][::-1], *range(hwm, hwm + n - f)], np.int32)

    def _occupant_ids(self, n: int) -> npt.NDArray[np.int32]:
        free = self._o_free
        f = min(n, len(free))
        hwm = len(self.hashes)
        while hwm + n - f > self.arrays.occupant_capacity:
            self.arrays = self.arrays.with_occupant_capacity(2 * self.arrays.occupant_capacity)
        return np.array([*free[len(free) - f :][::-1], *range(hwm, hwm + n - f)], np.int32)

    def _grow_claims(self) -> None:
        new = np.full(2 * self.arrays.claims.shape[0], -1, np.int64)
        kernels.claims_rehash(self.arrays.claims, new)
        self.arrays = self.arrays._replace(claims=new)

    def rebuild(self) -> None:
        """Fresh table and filter holding exactly the live contents."""
        self.arrays = self.arrays.with_empty_lookup()
        kernels.rebuild(self.arrays, len(self.tokens))
        self._stale = 0


def _take_ids(free: list[int], used: int, slots: list[Any]) -> None:
    """Retire the first ``used`` ids handed out: free ones leave the free list, fresh ones
    get a (placeholder) slot that ``_settle`` fills."""
    f = min(used, len(free))
    if f:
        del free[len(free) - f :]
    slots.extend([None] * (used - f))
