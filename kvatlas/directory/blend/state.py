"""The blend index's state, and the one way it changes: :meth:`IndexState.apply`.

State is the kernels' arrays (``kernels.BlendArrays``, the occupants' chunk_hashes among them,
by value) plus what Python holds for them: the token arrays whose addresses those arrays store
(kept alive here), counters, namespace ids, the anchor table (``anchors.py``). A batch of
writes is one compiled call followed by the bookkeeping the kernel reports for each op, so the
two never disagree once ``apply`` returns. Not thread-safe: :class:`BlendIndex` locks around it."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import kernels
from kvatlas.directory.blend._cpython import WRITE_OFFSETS, array_handle
from kvatlas.directory.blend.anchors import Anchors
from kvatlas.directory.blend.drops import settle_drops
from kvatlas.directory.blend.id_lists import chosen, put, put_one, tally
from kvatlas.directory.blend.kernels import (
    ADD,
    F_CLAIM_DROPPED,
    F_CONTENT_GONE,
    F_EXTRA_CLAIM,
    F_NEW_CLAIM,
    F_NEW_CONTENT,
    F_NEW_OCCUPANT,
    F_OCCUPANT_GONE,
    REMOVE_CHUNK,
    REMOVE_CLAIM,
    SKIP,
)
from kvatlas.directory.blend.kernels.layout import IDS_OCCUPANTS, write_context
from kvatlas.directory.blend.kernels.modhash import power_table
from kvatlas.directory.blend.kernels.objects import payload_addresses
from kvatlas.directory.blend.kernels.writes import (
    OP_FP,
    OP_HASH,
    OP_HASH_LEN,
    OP_KIND,
    OP_NS,
    OP_OFFSET,
    OP_TOKEN_BYTES,
    OP_TOKENS,
    single_write,
)
from kvatlas.directory.blend.namespaces import NamespaceIds
from kvatlas.directory.blend.op_checks import Tokens, filled, token_nbytes
from kvatlas.directory.blend.op_columns import OpColumns, SingleOp
from kvatlas.keys import BlendNamespace

MIN_CAPACITY = 1024
"""Initial content and occupant capacity."""
GROWTH = 1.125
"""Factor by which content and occupant capacity grow when full. Their arrays are ≈50 bytes
per id: growing by an eighth keeps the unused share of them (and so the index's bytes per
chunk) small at every size, for an amortised copy of ≈8 bytes per id per add. The table
grows separately, by doubling (``_make_room``)."""

_ALL_NEW = F_NEW_CONTENT | F_NEW_OCCUPANT | F_NEW_CLAIM
"""The flags of an add of a new content, occupant and inline claim: a fresh chunk's add."""
_OP_BY_OP = F_EXTRA_CLAIM | F_CLAIM_DROPPED | F_OCCUPANT_GONE | F_CONTENT_GONE
"""Flags settled op by op (:meth:`IndexState._settle`), but for plain drops (``drops.py``)."""
_NOT_A_DROP = _ALL_NEW | F_EXTRA_CLAIM
"""Flags no plain drop has (``drops.py`` settles the others as columns)."""


class IndexState:
    def __init__(
        self, chunk_size: int, base: int, fmask: int, anchor_keys: npt.NDArray[np.uint32]
    ) -> None:
        self.chunk_size = chunk_size
        self.fmask = fmask
        self.weights = np.empty((2, chunk_size), np.uint64)  # the fingerprints', by the base
        power_table(base, chunk_size, self.weights)
        self._single = np.empty(chunk_size, np.uint32), np.empty(4, np.int64)  # its scratch
        self._single_write = single_write()  # (kernels.apply_op, without numba's dispatch)
        self.tokens: list[Tokens | None] = []  # per content id: the array c_addr points into
        self.arrays = kernels.BlendArrays.empty(MIN_CAPACITY)
        self.namespaces = NamespaceIds()
        self.owned: set[int] = set()  # content ids whose array is the index's own copy
        self.extra_claims: dict[int, set[int]] = {}  # occupant -> its extra-set namespaces
        self.contents = 0
        self.occupants = 0
        self.claims = 0
        self.owned_bytes = 0
        self.token_bytes = 0  # of the live contents' arrays
        self.n_extra = 0
        self.anchors = Anchors(chunk_size, anchor_keys)

    @property
    def arrays(self) -> kernels.BlendArrays:
        return self._arrays

    @arrays.setter
    def arrays(self, arrays: kernels.BlendArrays) -> None:
        self._arrays = arrays
        self.kernel_arrays = tuple(arrays)  # what the kernels take
        self._ids = arrays.ids.data  # (a memoryview: its items as Python ints, occupant_ids)
        # the same arrays as one address (single writes), kept alive with them
        contents = id(self.tokens)
        self._context = write_context(
            arrays, self.chunk_size, self.weights, self.fmask, self._single, WRITE_OFFSETS, contents
        )
        self._context_address = int(self._context.ctypes.data)
        # capacities as plain ints, for the check every add makes (_has_room)
        self._room = (
            arrays.content_capacity,
            arrays.occupant_capacity,
            int(arrays.claims.shape[0]) // 2,
            arrays.table_slots // 2,
        )

    @property
    def occupant_ids(self) -> int:
        """Occupant ids ever handed out (live or free: the rows in use)."""
        return self._ids[IDS_OCCUPANTS]  # type: ignore[no-any-return]

    def apply_one(self, op: SingleOp) -> None:
        """Apply one validated op: :meth:`apply` with scalars (a node adds and drops its
        claims one chunk at a time, where building op columns would cost more than the
        write itself)."""
        kind, arr, chunk_hash, offset, namespace, _ = op
        ns = -1 if namespace is None else self._namespace_id(kind, namespace)
        if ns >= 0 or kind != REMOVE_CLAIM:  # else: no claims, nothing to drop
            if kind == ADD and not self._has_room(1):
                self._make_room(1)
            if isinstance(arr, bytes):  # a content: the kernel reads its header
                handle, width = id(arr), 0
            else:
                handle, width = array_handle(arr), arr.itemsize
            result = self._single_write(
                kind, handle, width, id(chunk_hash), offset, ns, self._context_address
            )
            if result[0]:
                self._settle_one(op, result, ns)
        self.namespaces.end_write()

    def apply(self, cols: OpColumns, fps: npt.NDArray[np.uint64] | None = None) -> None:
        """Apply validated ops in order (see :func:`kernels.apply_ops`), then release the
        namespace ids left without claims.
        ``fps``: each op's content fingerprint under this state's base and bits, computed
        before (the kernel then reads an op's ids only to compare them)."""
        if len(cols):
            self._apply_batch(cols, fps)
        self.namespaces.end_write()

    def _apply_batch(self, cols: OpColumns, fps: npt.NDArray[np.uint64] | None) -> None:
        kinds = cols.kinds
        n = len(kinds)
        adds = kinds == ADD
        n_add = int(np.count_nonzero(adds))
        if n_add == n and len(cols.spaces) == 1:  # adds in one namespace (an ingest batch)
            ns = filled(n, self.namespaces.register(cols.spaces[0]))
        else:
            ns = self._op_namespaces(cols, adds)
            skip = (kinds == REMOVE_CLAIM) & (ns < 0)
            if skip.any():
                kinds = kinds.copy()
                kinds[skip] = SKIP
        if not self._has_room(n_add):
            self._make_room(n_add)
        hashes = payload_addresses(cols.hashes)
        out = self.run_ops(
            kinds, cols.addrs, cols.token_bytes, hashes, cols.hash_lens, cols.offsets, ns, fps
        )
        self._settle(cols, kinds, out, ns)

    def run_ops(
        self,
        kinds: npt.NDArray[np.int64] | int,
        tokens: npt.NDArray[np.int64],
        token_bytes: npt.NDArray[np.int64],
        hashes: npt.NDArray[np.int64],
        hash_lens: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        ns: npt.NDArray[np.int64],
        fps: npt.NDArray[np.uint64] | None,
    ) -> npt.NDArray[np.int64]:
        """The write kernel over ops given as columns (``kernels.writes.OP_*``: addresses of
        the ids and of the hashes, their lengths, offsets, namespace ids, ``fps`` the
        fingerprints if computed before), the GIL released for a large batch; returns its
        per-op report (flags, content, occupant, claim). Room must have been made."""
        n = len(tokens)
        ops = np.empty((7 if fps is None else 8, n), np.int64)  # in OP_* order
        if fps is not None:
            ops[OP_FP] = fps.view(np.int64)
        ops[OP_KIND] = kinds
        ops[OP_TOKENS] = tokens
        ops[OP_HASH] = hashes
        ops[OP_HASH_LEN] = hash_lens
        ops[OP_OFFSET] = offsets
        ops[OP_NS] = ns
        ops[OP_TOKEN_BYTES] = token_bytes
        out = np.empty((n, 4), np.int64)
        apply = kernels.apply_ops if n < kernels.RELEASE_OPS else kernels.apply_ops_releasing
        apply(ops, self.chunk_size, -1, self.weights, self.fmask, self.kernel_arrays, out)
        return out

    def _op_namespaces(self, cols: OpColumns, adds: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
        """Each op's namespace id: registered for a namespace some add uses (an id, once
        known, is stable in a batch), else looked up (-1: no claims, nothing to drop)."""
        if len(cols.spaces) == 1:  # one namespace: no unique to take
            added = {0} if adds.any() else set()
        else:
            added = set(cols.space_of[adds].tolist())  # (np.unique would release the GIL)
        ids = [
            self._namespace_id(ADD if s in added else REMOVE_CLAIM, namespace)
            for s, namespace in enumerate(cols.spaces)
        ]
        space_of = cols.space_of
        ns = filled(len(space_of), -1)
        present = space_of >= 0
        ns[present] = np.array(ids, np.int64)[space_of[present]]
        return ns

    def _namespace_id(self, kind: int, namespace: BlendNamespace | None) -> int:
        """The op's namespace id: registered for an add, -1 if it has none."""
        if namespace is None:
            return -1
        if kind == ADD:
            return self.namespaces.register(namespace)
        ns = self.namespaces.get(namespace)
        return -1 if ns is None else ns

    def _settle(
        self,
        cols: OpColumns,
        kinds: npt.NDArray[np.int64],
        results: npt.NDArray[np.int64],
        nss: npt.NDArray[np.int64],
    ) -> None:
        """Python-side bookkeeping of applied ops (per op, the kernel's ``(flags, content id,
        occupant id, ns0)``): the references that keep token arrays alive,
        counters, free lists, namespace claims.

        What adds do (new contents, occupants and claims) is settled column-wise; the rest
        (extra-set claims, drops, removals) op by op, in order, after it. That order is
        equivalent: ids freed by a batch are not reused within it, so an id that is new in
        a batch is new before anything can remove it, and claim counts only meet zero at the
        end of the write (``NamespaceIds.end_write``)."""
        # (columns, then 1-D masks: a 2-D mask or index releases the GIL on every call)
        flags, contents, occupants = results[:, 0], results[:, 1], results[:, 2]
        if len(cols.spaces) == 1 and bool((flags == _ALL_NEW).all()):
            self._settle_fresh(cols, results, nss)
            return
        new = flags & F_NEW_CONTENT != 0
        if new.any():
            self._new_contents(cols, contents[new], new)
        self.occupants += int(np.count_nonzero(flags & F_NEW_OCCUPANT))
        new = flags & F_NEW_CLAIM != 0
        if new.any():
            ns_claims = self.namespaces.claims
            for ns, n in tally(nss[new]):
                ns_claims[ns] += n
            self.claims += int(np.count_nonzero(new))
        by_op = (flags & _OP_BY_OP != 0) | (kinds == REMOVE_CHUNK)
        drops = by_op & (kinds == REMOVE_CLAIM) & (flags & _NOT_A_DROP == 0)
        if drops.any():  # (a fence's or a delete's: drops.py)
            settle_drops(self, flags[drops], contents[drops], occupants[drops], nss[drops])
            by_op &= ~drops
        rest = np.flatnonzero(by_op)
        if len(rest):  # (the results' rows as 1-D columns: ``results[rest]`` released the GIL)
            flags, cids, occs, ns0s = (results[:, k][rest].tolist() for k in range(4))
            ops = zip(
                kinds[rest].tolist(), flags, cids, occs, ns0s, nss[rest].tolist(), strict=True
            )
            for kind, flag, cid, occ, ns0, ns in ops:  # (in order)
                self._settle_removal(kind, flag, cid, occ, ns0, ns)

    def _settle_fresh(
        self, cols: OpColumns, results: npt.NDArray[np.int64], nss: npt.NDArray[np.int64]
    ) -> None:
        """:meth:`_settle` of a batch whose every op added a new content with a new occupant
        and its inline claim, all in one namespace (an ingest batch of new chunks): no masks,
        no per-op pass."""
        n = len(results)
        self._new_contents(cols, results[:, 1], None)
        self.occupants += n
        self.namespaces.claims[int(nss[0])] += n
        self.claims += n

    def _settle_one(self, op: SingleOp, result: tuple[int, int, int, int], ns: int) -> None:
        """:meth:`_settle` of a single op, with scalars (the column-wise bookkeeping's fixed
        cost outweighs one op)."""
        flags, cid, occ, _ = result
        kind, arr, _chunk_hash, _offset, _namespace, owned = op  # SingleOp's fields, named
        if flags & F_NEW_CONTENT:
            put_one(self.tokens, cid, arr)
            self.anchors.note_one(cid)
            nbytes = token_nbytes(arr)
            self.token_bytes += nbytes
            self.contents += 1
            if owned:
                self.owned.add(cid)
                self.owned_bytes += nbytes
        if flags & F_NEW_OCCUPANT:
            self.occupants += 1
        if flags & F_NEW_CLAIM:
            self.namespaces.claims[ns] += 1
            self.claims += 1
        if flags & _OP_BY_OP or kind == REMOVE_CHUNK:
            self._settle_removal(kind, flags, cid, occ, result[3], ns)

    def _new_contents(
        self, cols: OpColumns, ids: npt.NDArray[np.int64], new: npt.NDArray[np.bool_] | None
    ) -> None:
        """Keep the arrays of the ops ``new`` selects (``None``: every op) as the contents
        ``ids``."""
        arrays = cols.tokens if new is None else chosen(cols.tokens, new)
        put(self.tokens, ids, arrays)
        self.anchors.note(ids)
        if new is None and cols.id_bytes is not None:  # (read with the addresses)
            self.token_bytes += cols.id_bytes
        elif cols.contents:  # (bytes: the length by a C-level map, less each plain header)
            widths = cols.token_bytes if new is None else cols.token_bytes[new]
            headers = int(widths.sum()) - int(np.count_nonzero(widths == 1))
            self.token_bytes += sum(map(len, arrays)) - headers
        else:
            self.token_bytes += sum(map(token_nbytes, arrays))
        self.contents += len(arrays)
        owned = cols.owned if new is None else cols.owned[new]
        if owned.any():
            for k in np.flatnonzero(owned).tolist():
                self.owned.add(int(ids[k]))
                self.owned_bytes += token_nbytes(arrays[k])

    def _settle_removal(self, kind: int, flags: int, cid: int, occ: int, ns0: int, ns: int) -> None:
        """What an op's extra-set claim, dropped claim, removed chunk, gone occupant or gone
        content changes (its kind, the kernel's result row and its namespace id)."""
        namespaces = self.namespaces
        if flags & F_NEW_CLAIM and flags & F_EXTRA_CLAIM:
            self.extra_claims.setdefault(occ, set()).add(ns)
            self.n_extra += 1
        if flags & F_CLAIM_DROPPED:
            namespaces.release(ns, 1)
            self.claims -= 1
            if flags & F_EXTRA_CLAIM:
                self._forget_extra(occ, ns)
        if kind == REMOVE_CHUNK:
            if ns0 >= 0:
                namespaces.release(ns0, 1)
                self.claims -= 1
            if occ in self.extra_claims:
                for other in self.extra_claims.pop(occ):
                    kernels.drop_extra_claim(occ, other, self.arrays.claims)
                    self.n_extra -= 1
                    namespaces.release(other, 1)
                    self.claims -= 1
        if flags & F_OCCUPANT_GONE:
            self.occupants -= 1
        if flags & F_CONTENT_GONE:
            live_tokens = self.tokens
            gone = live_tokens[cid]
            if gone is not None:
                nbytes = token_nbytes(gone)
                self.token_bytes -= nbytes
                if cid in self.owned:
                    self.owned.discard(cid)
                    self.owned_bytes -= nbytes
            live_tokens[cid] = None
            self.contents -= 1

    def _forget_extra(self, occ: int, ns: int) -> None:
        claims = self.extra_claims[occ]
        claims.discard(ns)
        if not claims:
            del self.extra_claims[occ]
        self.n_extra -= 1

    def _has_room(self, n_add: int) -> bool:
        """Room for ``n_add`` adds (a new content, occupant and extra claim each), free ids
        counted as :meth:`_make_room` counts them (an index built to its capacity, a
        restore's, has room for an add wherever a removal left an id free)."""
        contents, occupants, extra, live = self._room
        used, held = len(self.tokens), self._ids[IDS_OCCUPANTS]
        return (
            used + n_add - min(n_add, used - self.contents) <= contents
            and held + n_add - min(n_add, held - self.occupants) <= occupants
            and self.n_extra + n_add <= extra
            and self.contents + n_add <= live
        )

    def _make_room(self, n_add: int, n_extra: int | None = None) -> None:
        """Grow what ``n_add`` adds need (``n_extra`` of them at most an extra claim; default
        all), counting free ids (but not ids the batch frees: they are not reused within it)."""
        need = len(self.tokens) + n_add - min(n_add, len(self.tokens) - self.contents)
        if need > self.arrays.content_capacity:
            self.arrays = self.arrays.with_content_capacity(
                _grown(self.arrays.content_capacity, need)
            )
        held = self.occupant_ids
        need = held + n_add - min(n_add, held - self.occupants)
        if need > self.arrays.occupant_capacity:
            self.arrays = self.arrays.with_occupant_capacity(
                _grown(self.arrays.occupant_capacity, need)
            )
        while 2 * (self.n_extra + (n_add if n_extra is None else n_extra)) > len(
            self.arrays.claims
        ):
            self._grow_claims()
        slots = self.arrays.table_slots
        while 2 * (self.contents + n_add) > slots:  # load <= 1/2 (table.py)
            slots *= 2
        if slots != self.arrays.table_slots:
            self.rebuild(slots)

    def reserve(self, n_add: int, n_extra: int | None = None) -> None:
        """Room for ``n_add`` adds now, so that batches adding them grow nothing (``n_extra``:
        how many of them may make an extra claim at most; default all)."""
        if n_extra is not None or not self._has_room(n_add):
            self._make_room(n_add, n_extra)

    def trim_claims(self, room: int) -> None:
        """Shrink the extra-claim set to the smallest size (16, doubled) with room for
        ``room`` extra claims at load 1/2: what adding claims one by one grows it to, for
        ``room`` = the extra claims before the last add + 1 (a batch reserves room for one
        extra claim per add: after a bulk build of 10^6 contents that is 16 MB of empty
        slots)."""
        slots = 16
        while 2 * room > slots:
            slots *= 2
        if slots < self.arrays.claims.shape[0]:
            new = np.full(slots, -1, np.int64)
            kernels.claims_rehash(self.arrays.claims, new)
            self.arrays = self.arrays._replace(claims=new)

    def _grow_claims(self) -> None:
        new = np.full(2 * self.arrays.claims.shape[0], -1, np.int64)
        kernels.claims_rehash(self.arrays.claims, new)
        self.arrays = self.arrays._replace(claims=new)

    def rebuild(self, slots: int | None = None) -> None:
        """A fresh table (``slots`` slots; default: as many as now) holding exactly the live
        contents."""
        self.arrays = self.arrays.with_empty_table(slots)
        kernels.rebuild(self.kernel_arrays)


def _grown(capacity: int, need: int) -> int:
    return max(need, int(capacity * GROWTH) + 1)
