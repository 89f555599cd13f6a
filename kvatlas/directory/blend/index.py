"""BlendIndex: the fragment (CacheBlend) index — which cached chunks occur anywhere in a query.

A derived view of the directory's token bindings (docs/blend-index.md). Guarantees:

- Complete recall: every live content is in the anchor table (``anchors.py``), and a
  content equal to a probed window has its anchor at one of that window's minima; every live
  claimed chunk whose content occurs at a probed position is returned.
- No wrong KV: entries are identified by (fingerprint, content); tokens are compared before
  an occupant is attached and before any match is returned. Hashes are for discovery only.
- No constructible collisions: the fingerprint is keyed (a per-process secret base mod
  2^61-1, see ``kernels/modhash.py``) and never leaves the process.
- Namespace pruning first: a candidate's claims are checked before its tokens are compared.
- One write path: every write is a batch of typed ops (``ops.py``) applied by :meth:`apply`,
  atomically; ``add``, ``remove_claim``, ``remove_chunk``, ``add_many`` and ``remove_claims``
  are batches of one kind. A batch of one op (what a node writes, one chunk at a time) is
  validated and applied with scalars (``op_columns.single_op``, ``kernels.apply_op``):
  the same checks, errors and state as its column form.

Memory: tokens are not copied when the caller hands in a content as the directory keeps it (one
``bytes`` object, its ids inline in the form they need: ``kernels/contents.py``,
``directory/token_store.py``) or a read-only, self-owned ``uint32`` or ``uint16`` array, or one
in the planes form: the index keeps a reference and its ids' address, so the directory binding
and the index share one object per content. Any other array is copied once (``uint16`` stays
``uint16``, the rest becomes ``uint32``). Chunk hashes are kept by value, in the occupants'
rows (``kernels/layout.py``): the index keeps no reference to a caller's hash ``bytes``.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.c_heap import fault_in
from kvatlas.checks import is_plain_int
from kvatlas.directory.blend import kernels
from kvatlas.directory.blend.anchors import AnchorKey, SavedAnchors
from kvatlas.directory.blend.bulk import build_empty, is_empty
from kvatlas.directory.blend.fingerprints import FingerprintKey, Fingerprints
from kvatlas.directory.blend.kernels import ADD, REMOVE_CHUNK, REMOVE_CLAIM
from kvatlas.directory.blend.kernels.anchors import new_keys
from kvatlas.directory.blend.kernels.modhash import SCHEME
from kvatlas.directory.blend.match_columns import MatchColumns, first_of_each_hash
from kvatlas.directory.blend.op_columns import (
    SingleOp,
    checked_op,
    op_columns,
    single_op,
    vouched_singles,
)
from kvatlas.directory.blend.ops import (
    AddColumns,
    AddOp,
    BlendOp,
    RemoveClaimColumns,
    RemoveClaimOp,
)
from kvatlas.directory.blend.state import IndexState
from kvatlas.keys import BlendMatch, BlendNamespace, as_token_array

BUILD_SLICE = 1 << 17
"""Adds per batch in :meth:`BlendIndex.build`: ≈90 bytes of op arrays each while applied."""

_SEGMENT_WINDOWS = 65536
"""Window starts probed per lock acquisition in ``match``: bounds how long one query holds
the lock, so a 1M-token query never stalls ingestion behind it."""


@dataclass(frozen=True, slots=True)
class BlendStats:
    """Counts, capacities and bytes of a :class:`BlendIndex`.

    ``index_bytes`` excludes token arrays (``token_bytes``: ``token_bytes_owned`` = copies the
    index made, ``token_bytes_shared`` = the callers' arrays it references) but includes the
    chunk_hashes' column (every occupant row has ``HASH_WIDTH`` bytes for its hash)."""

    contents: int
    occupants: int
    claims: int
    namespaces: int
    content_capacity: int
    occupant_capacity: int
    table_slots: int
    extra_claim_slots: int
    index_bytes: int
    token_bytes: int
    token_bytes_owned: int
    token_bytes_shared: int


class BlendIndex:
    """Fragment index over chunk contents; see the module docstring for its guarantees.

    Concurrency: one lock guards all state. ``match`` takes it once per segment of
    ``_SEGMENT_WINDOWS`` window starts rather than for the whole query: each segment is probed
    against a consistent state, and writers get the lock between segments, so a long query
    delays a write by at most one segment. A chunk removed while a query runs may or may not
    be returned, exactly as if the removal happened before or after it.
    """

    def __init__(
        self,
        chunk_size: int = 256,
        probe_stride: int = 1,
        *,
        _fingerprint_bits: int = 61,
        _fingerprint_base: int | None = None,
        _anchor_keys: Sequence[int] | None = None,
    ) -> None:
        for name, value in (("chunk_size", chunk_size), ("probe_stride", probe_stride)):
            if not is_plain_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 1 <= _fingerprint_bits <= 61:
            raise ValueError("_fingerprint_bits must be in [1, 61]")
        self.chunk_size = chunk_size
        self.probe_stride = probe_stride
        p = kernels.MERSENNE61
        base = secrets.randbelow(p - 3) + 2 if _fingerprint_base is None else _fingerprint_base
        if not 1 <= base < p:
            raise ValueError("_fingerprint_base must be in [1, 2^61-1)")
        # The base is secret and per process: fingerprints are internal, never on the wire.
        self._base = base
        self._base_pow = pow(base, chunk_size, p)
        self._fmask = (1 << _fingerprint_bits) - 1
        self._lock = threading.Lock()
        self.false_probes = 0
        """Candidates (anchor agreed) that differed from their window (a counter: ``/metrics``)."""
        keys = new_keys() if _anchor_keys is None else np.array(_anchor_keys, np.uint32)
        self._state = IndexState(chunk_size, base, self._fmask, keys)

    # ------------------------------------------------------------------ writes

    def add(
        self, tokens: Any, chunk_hash: bytes, token_offset: int, namespace: BlendNamespace
    ) -> None:
        """Index ``chunk_hash`` (stored at ``token_offset``) as matchable for ``namespace``.

        Idempotent; re-adding updates the offset. Offset -1 (unknown) is rejected: a match
        without a stored position would re-RoPE from the wrong source (wrong KV). Content
        that is not ``chunk_size`` tokens long is not indexed (logged)."""
        self._apply_one(
            single_op(ADD, tokens, chunk_hash, token_offset, namespace, self.chunk_size)
        )

    def remove_claim(self, tokens: Any, chunk_hash: bytes, namespace: BlendNamespace) -> None:
        """Drop ``namespace``'s claim; the occupant goes with its last claim. Unknown: no-op."""
        self._apply_one(single_op(REMOVE_CLAIM, tokens, chunk_hash, 0, namespace, self.chunk_size))

    def remove_chunk(self, tokens: Any, chunk_hash: bytes) -> None:
        """Drop the occupant and all its claims at once (chunk_hash re-stored with new content)."""
        self._apply_one(single_op(REMOVE_CHUNK, tokens, chunk_hash, 0, None, self.chunk_size))

    def add_many(self, items: Iterable[tuple[Any, bytes, int, BlendNamespace]]) -> None:
        """``add`` for each ``(tokens, chunk_hash, token_offset, namespace)``, as one batch."""
        self.apply([AddOp(*item) for item in items])

    def remove_claims(self, items: Iterable[tuple[Any, bytes, BlendNamespace]]) -> None:
        """``remove_claim`` for each ``(tokens, chunk_hash, namespace)``, as one batch."""
        self.apply([RemoveClaimOp(*item) for item in items])

    def apply(self, ops: Iterable[BlendOp]) -> None:
        """Apply writes in order, atomically: one lock hold and one compiled call for all.

        Each op has the effect of the method it names (see :data:`BlendOp`), in sequence; a
        concurrent ``match`` sees the state before the batch or after it, never in between (so a
        ``remove_chunk`` followed by re-``add``s of a re-stored chunk has no window). Every op
        is validated before anything changes: an invalid op raises and applies none. An
        :class:`AddColumns` (many adds, as columns) is prepared without Python per entry when
        its arrays are the kind the index keeps as they are (``op_columns.py``), a vouched
        :class:`RemoveClaimColumns` (many claims dropped) as it is; a list or tuple of one other
        op, or of one vouched batch of a few ops (``op_columns.SMALL_BATCH``), is applied with
        scalars (``IndexState.apply_one``).
        """
        if type(ops) in (tuple, list) and len(ops) == 1:  # type: ignore[arg-type]
            (op,) = ops
            if type(op) is not AddColumns and type(op) is not RemoveClaimColumns:
                self._apply_one(checked_op(op, self.chunk_size))
                return
            singles = vouched_singles(op)
            if singles is not None:  # a few of the directory's own: with scalars
                with self._lock:
                    for one in singles:
                        self._state.apply_one(one)
                return
        cols = op_columns(ops, self.chunk_size)
        if cols is not None and len(cols):
            with self._lock:
                self._state.apply(cols)

    def _apply_one(self, op: SingleOp | None) -> None:
        """A batch of one op, validated (``None``: nothing to apply), applied with scalars."""
        if op is not None:
            with self._lock:
                self._state.apply_one(op)

    @property
    def fingerprint_key(self) -> FingerprintKey:
        """What this index's fingerprints depend on besides the ids (a snapshot saves it with
        its fingerprint column; never on the wire)."""
        return FingerprintKey(SCHEME, self.chunk_size, self._fmask.bit_length(), self._base)

    @property
    def anchor_key(self) -> AnchorKey:
        """What this index's anchors depend on besides the ids (a snapshot saves it with its
        anchor column; never on the wire)."""
        return self._state.anchors.key

    def build(
        self,
        adds: AddColumns,
        fingerprints: Fingerprints | None = None,
        ready: Callable[[int], None] | None = None,
        anchors: SavedAnchors | None = None,
    ) -> None:
        """``apply([adds])`` to a fresh index nobody queries yet (a restore's rebuild): its
        arrays and table sized once for all the adds (see :meth:`reserve`), applied in
        slices of :data:`BUILD_SLICE`, the last add on its own, then the extra-claim set
        shrunk to the size adding them one by one would have grown it to (that size depends
        on the extra claims before the last add). ``adds.vouched`` holds for every slice.

        ``fingerprints``: each add's content fingerprint, computed before (a snapshot's
        column, checked by its reader: ``blend/fingerprints.py``). Taken only under this
        index's function, chunk size and bits, and only while the index is empty: it then
        adopts their base (its answers are the same under any base); otherwise ignored.
        Vouched adds of ``bytes`` contents to an empty index take ``bulk.build_empty`` (the
        same kernel calls and state, the Python around them column-wise). ``ready(k)``:
        called before the ids of the first ``k`` adds' contents are read, it blocks until
        they may be (``snapshot/token_section.py``); ``None``: they all may be.

        ``anchors``: each add's content anchor (a snapshot's column, checked by its reader),
        adopted with its secret on the bulk path when its key is usable at this chunk size
        (the first lookup then anchors nothing); otherwise ignored."""
        n = len(adds.tokens)
        if not n:
            return
        fps = None
        with self._lock:
            if fingerprints is not None and self._adopts(fingerprints.key):
                if len(fingerprints.values) != n:
                    raise ValueError("build: one fingerprint per add")
                self._rekey(fingerprints.key.base)
                fps = np.ascontiguousarray(fingerprints.values, np.uint64)
            if anchors is not None and len(anchors.values) != n:
                raise ValueError("build: one anchor per add")
            if adds.vouched and is_empty(self._state):
                try:
                    saved = anchors if anchors is not None and self._takes(anchors) else None
                    built = build_empty(self._state, adds, fps, BUILD_SLICE, ready, saved)
                except BaseException:  # the kernel wrote part of it: empty again (exact: it was)
                    self._state = self._new_state()
                    raise
                if built:
                    return
            self._state.reserve(n)
        if ready is not None:
            ready(n)
        which = adds.namespace_of
        bounds = [*range(0, n - 1, BUILD_SLICE), n - 1, n]  # (the last add on its own)
        before_last = 0  # extra claims before the last add
        for lo, hi in pairwise(bounds):
            if lo == n - 1:
                with self._lock:
                    before_last = self._state.n_extra
            part = AddColumns(
                adds.tokens[lo:hi],
                adds.chunk_hashes[lo:hi],
                adds.token_offsets[lo:hi],
                adds.namespaces,
                None if which is None else which[lo:hi],
                adds.vouched,
            )
            if fps is None:
                self.apply((part,))
                continue
            cols = op_columns((part,), self.chunk_size)
            if cols is not None and len(cols):
                # (adds taken op by op drop the wrong-length ones: then computed)
                given = fps[lo:hi] if len(cols) == hi - lo else None
                with self._lock:
                    self._state.apply(cols, given)
        with self._lock:
            self._state.trim_claims(before_last + 1)

    def _adopts(self, key: FingerprintKey) -> bool:
        """Whether :meth:`build` takes fingerprints under ``key`` (see there)."""
        own = self.fingerprint_key
        return (
            key.usable()
            and (key.scheme, key.chunk_size, key.bits) == (own.scheme, own.chunk_size, own.bits)
            and not (self._state.tokens or self._state.occupant_ids)
        )

    def _takes(self, anchors: SavedAnchors) -> bool:
        """Whether :meth:`build` adopts ``anchors`` (see there)."""
        key = anchors.key
        return key.usable() and key.chunk_size == self.chunk_size

    def reserve(self, n: int) -> None:
        """Room for a :meth:`build` of ``n`` adds in one namespace, faulted in now (a restore's
        thread, while it builds the records: ≈60 MB at 10^6 adds, faults off its main thread)."""
        with self._lock:
            self._state.reserve(n, 0)
            fault_in(self._state.arrays)

    def _new_state(self) -> IndexState:
        """A fresh, empty state under this index's base and anchor secret."""
        keys = self._state.anchors.keys
        return IndexState(self.chunk_size, self._base, self._fmask, keys)

    def _rekey(self, base: int) -> None:
        """A fresh state under base ``base`` (the index is empty; a :meth:`reserve`'s arrays kept)."""
        self._base = base
        self._base_pow = pow(base, self.chunk_size, kernels.MERSENNE61)
        room = self._state.arrays
        self._state = self._new_state()
        self._state.arrays = room

    # ------------------------------------------------------------------ reads

    def match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """Chunks of ``namespace`` whose content occurs in ``tokens`` at a probed position.

        Ascending by ``cur_st``, at most one per chunk_hash (its first verified, claimed
        occurrence); matches may overlap."""
        return self.match_columns(tokens, namespace).matches()

    def match_columns(self, tokens: Any, namespace: BlendNamespace) -> MatchColumns:
        """:meth:`match` as columns, without an object per hit (what a server encodes into
        its reply: docs/performance.md)."""
        q = np.ascontiguousarray(_tokens(tokens))
        chunk, stride = self.chunk_size, self.probe_stride
        n_starts = q.shape[0] - chunk + 1
        if n_starts <= 0:
            return MatchColumns.empty()
        state = self._state
        anchors = state.anchors
        query = anchors.query(q)  # (the query's own k-grams and minima: no lock)
        seg = max(1, _SEGMENT_WINDOWS // stride) * stride
        parts: list[MatchColumns] = []
        for start in range(0, n_starts, seg):
            stop = min(start + seg, n_starts)
            with self._lock:
                ns = state.namespaces.get(namespace)
                if ns is None:
                    continue
                anchors.sync(state.arrays, state.contents)
                pos, off, hash_bytes, hash_lengths, false_probes = anchors.scan(
                    q, query, start, stop, stride, ns, state.kernel_arrays
                )
                self.false_probes += false_probes
            if pos.shape[0]:
                parts.append(MatchColumns(hash_bytes, hash_lengths, off, pos))
        if len(parts) == 1:  # (the scan kept the first hit of each chunk_hash)
            return parts[0]
        if not parts:
            return MatchColumns.empty()
        return first_of_each_hash(parts)

    def stats(self) -> BlendStats:
        """Counts, table sizes and bytes (see :class:`BlendStats`)."""
        with self._lock:
            state = self._state
            arrays = state.arrays
            state.anchors.sync(arrays, state.contents)  # (what a lookup would find)
            index_bytes = sum(a.nbytes for a in arrays) + 8 * len(state.tokens)
            index_bytes += state.anchors.nbytes
            index_bytes += sum(
                100 + sys.getsizeof(s) for s in state.extra_claims.values()
            )  # dict entry + set: multi-namespace occupants only
            token_bytes = state.token_bytes
            return BlendStats(
                contents=state.contents,
                occupants=state.occupants,
                claims=state.claims,
                namespaces=len(state.namespaces),
                content_capacity=arrays.content_capacity,
                occupant_capacity=arrays.occupant_capacity,
                table_slots=int(arrays.table.shape[0]),
                extra_claim_slots=int(arrays.claims.shape[0]),
                index_bytes=int(index_bytes),
                token_bytes=token_bytes,
                token_bytes_owned=state.owned_bytes,
                token_bytes_shared=token_bytes - state.owned_bytes,
            )

    # ------------------------------------------------------------------ internals


def _tokens(tokens: Any) -> npt.NDArray[np.uint32]:
    if type(tokens) is np.ndarray and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return tokens  # a caller's array: skip re-validation on the serving path
    return as_token_array(tokens)
