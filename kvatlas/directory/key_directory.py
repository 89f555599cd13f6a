"""KeyDirectory: which instance/tier holds every key, plus the token bindings behind blend lookup.

The directory is the single source of truth: events enter through the ingest gate, placements
and token bindings follow them, and the blend index (when enabled) follows the bindings — never
the other way round.

Locking: one directory lock covers the chunk table, the gate and capacity declarations; the
index has its own. The only order is directory → index (the directory calls the index while
holding its lock; the index never calls back), and :meth:`KeyDirectory.blend_match` takes only
the index lock, so a fragment query never waits behind event application. See
docs/directory.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from kvatlas.checks import is_plain_int
from kvatlas.directory import listing
from kvatlas.directory.blend import BlendIndex, MatchColumns
from kvatlas.directory.capture import Capture, DirectoryState, Restored
from kvatlas.directory.chunk_counts import L2_TIER
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.gate import Admission, EmitterCursor, IngestGate, Outcome
from kvatlas.directory.prefixes import prefix_summary
from kvatlas.directory.records import (
    CapacityDeclaration,
    KeyPage,
    KeyPlacements,
    Placement,
    TokenLookup,
)
from kvatlas.directory.salt_usage import SaltKey, bytes_by_salt, keys_of_salts, salt_bytes
from kvatlas.directory.store_runs import run_length
from kvatlas.directory.summaries import DirectoryStats, DirectoryUsage, module_usage
from kvatlas.errors import InvalidInput
from kvatlas.events import ACCESS, CONFIG, DELETE, RESYNC, STORE, EventBatch
from kvatlas.events.columns import ColumnBatch
from kvatlas.events.inventory import Digest
from kvatlas.keys import (
    DEFAULT_CHUNK_SIZE,
    BlendMatch,
    BlendNamespace,
    ObjectKey,
    as_token_array,
    chunk_hashes,
    expand_prefix_keys,
)

HashChunks = Callable[[Any, int], list[bytes]]
IndexFactory = Callable[[int, int], BlendIndex]  # (chunk_size, probe_stride) -> empty index


class PlacementObserver(Protocol):
    """Told, under the directory lock and so in apply order, about every applied batch and
    every fence (the vLLM KV-events publisher); must only queue, never block or raise (a
    batch's entries as objects, ``ColumnBatch.batch()``, are built later, off the lock)."""

    def applied(self, batch: ColumnBatch, fenced_first: bool) -> None: ...

    def fenced(self, instance_id: str) -> None: ...


class KeyDirectory:
    """ObjectKey → placements, chunk hash → token binding, fed by gated event batches."""

    def __init__(
        self,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        enable_blend_lookup: bool = False,
        blend_probe_stride: int = 1,
        hash_chunks: HashChunks = chunk_hashes,
        blend_index_factory: IndexFactory = BlendIndex,
    ) -> None:
        if not is_plain_int(chunk_size) or chunk_size < 1:
            raise InvalidInput(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self._hash_chunks = hash_chunks
        self._new_index = blend_index_factory
        self._lock = threading.Lock()
        self._gate = IngestGate()
        self._chunks = ChunkTable(chunk_size)
        self._capacities: dict[str, CapacityDeclaration] = {}
        self._shared_pools: set[tuple[str, str]] = set()  # (tier, backend) declared shared
        self._private: set[tuple[str, str, str]] = set()  # (instance, tier, backend) likewise
        self._index: BlendIndex | None = None
        self._probe_stride = 1
        self._outcomes: Counter[str] = Counter()
        self.observer: PlacementObserver | None = None
        if enable_blend_lookup:
            self.enable_blend_lookup(chunk_size, blend_probe_stride)

    def busy(self) -> bool:
        """Whether a change (a batch, a fence, a restore) holds the directory right now: a
        hint for a caller that must not wait (a read would wait for it), not a promise."""
        return self._lock.locked()

    # ------------------------------------------------------------------ configuration

    @property
    def blend_lookup_enabled(self) -> bool:
        """Whether :meth:`enable_blend_lookup` ran (``--enable-blend-lookup``)."""
        return self._index is not None

    @property
    def key_count(self) -> int:
        """Keys stored (``stats().keys`` without the pass over every record)."""
        with self._lock:
            return self._chunks.counts.keys

    @property
    def blend_index(self) -> BlendIndex | None:  # None while blend is off
        return self._index

    def new_blend_index(self) -> BlendIndex:
        """An empty blend index as :meth:`enable_blend_lookup` made this directory's, for a
        loader to build a :class:`Restored`'s on. Raises :class:`InvalidInput` while blend
        is off."""
        if self._index is None:
            raise InvalidInput("blend lookup is off: no index to build")
        return self._new_index(self.chunk_size, self._probe_stride)

    @property
    def blend_false_probes(self) -> int:
        """Blend index candidates that differed from their window (0 while blend is off)."""
        return 0 if self._index is None else self._index.false_probes

    def enable_blend_lookup(self, chunk_size: int | None = None, probe_stride: int = 1) -> None:
        """Start indexing content from now on (not retroactive: older chunks stay unindexed
        until a later token-bearing store, or a restore with blend on, binds them again)."""
        size = self.chunk_size if chunk_size is None else chunk_size
        if size != self.chunk_size:
            raise InvalidInput(f"blend chunk_size {size} != directory chunk_size {self.chunk_size}")
        with self._lock:
            if self._index is None:
                self._index = self._new_index(self.chunk_size, probe_stride)
                self._probe_stride = probe_stride
                self._chunks.indexing = True
                self._index.apply(self._chunks.tenant_claims())  # (claims follow bindings)

    # ------------------------------------------------------------------ ingestion

    def consume(self, batch: EventBatch) -> Outcome:
        """Apply one batch through the gate: entirely or not at all."""
        if not isinstance(batch, EventBatch):
            raise TypeError(f"expected EventBatch, got {type(batch).__name__}")
        return self.apply_columns([ColumnBatch.of(batch)])[0]

    def apply_columns(self, batches: Sequence[ColumnBatch]) -> list[Outcome]:
        """Apply batches in order through the gate, each entirely or not at all, under one
        lock hold and with one index write for all (see :meth:`_flush_index`); a run of one
        emitter's store batches in one bulk store (:mod:`~kvatlas.directory.store_runs`)."""
        outcomes: list[Outcome] = []
        with self._lock:
            try:
                i = 0
                while i < len(batches):
                    i += self._apply_from(batches, i, outcomes)
            finally:
                self._flush_index()
        return outcomes

    def _apply_from(self, batches: Sequence[ColumnBatch], i: int, outcomes: list[Outcome]) -> int:
        """Apply ``batches[i]``, or the run it starts stored at once; how many were applied."""
        admission = self._gate.admit(batches[i].header)
        run = batches[i : i + 1]
        if admission.outcome is Outcome.APPLIED and not admission.fence_first:
            run = batches[i : i + run_length(batches, i)]
        together = len(run) > 1 and self._chunks.store_run(run)
        for k, cb in enumerate(run):
            if k:  # (after the batch before it was committed)
                admission = self._gate.admit(cb.header)
            outcomes.append(admission.outcome)
            self._outcomes[admission.outcome] += 1
            if admission.outcome is Outcome.APPLIED:
                if together:
                    self._gate.commit(cb.header, admission)
                else:
                    self._apply_admitted(cb, admission)
                if self.observer is not None:
                    self.observer.applied(cb, admission.fence_first)
        return len(run)

    def fence_instance(self, instance_id: str) -> int:
        """Drop every L1 placement ``instance_id`` reported (its process memory is gone);
        L2 and shared placements survive. Returns the number of placements dropped."""
        with self._lock:
            try:
                return self._chunks.removals.fence(instance_id)
            finally:
                self._flush_index()
                if self.observer is not None:
                    self.observer.fenced(instance_id)

    def deregister(self, instance_id: str) -> int:
        """Fence the instance and forget its cursor and capacity declaration."""
        with self._lock:
            try:
                dropped = self._chunks.removals.fence(instance_id)
            finally:
                self._flush_index()
                if self.observer is not None:
                    self.observer.fenced(instance_id)
            self._gate.forget(instance_id)
            self._capacities.pop(instance_id, None)
            self._private = {m for m in self._private if m[0] != instance_id}
            return dropped

    def _apply_admitted(self, cb: ColumnBatch, admission: Admission) -> None:
        # A validated batch never fails halfway: shapes first, updates raise on no valid input.
        batch, kind, chunks = cb.header, cb.header.event_type, self._chunks
        cols = None if kind == CONFIG else cb.entry_columns()
        sids = (
            chunks.shapes.intern_columns(cols)
            if cols is not None and kind in (STORE, RESYNC)
            else []
        )
        if admission.fence_first:
            chunks.removals.fence(batch.instance_id)
        if cols is None:
            self._apply_config(batch)
        elif kind == DELETE:
            chunks.removals.delete(batch, cols)
        elif kind == ACCESS:
            chunks.access(batch, cols)
        else:
            (chunks.store if kind == STORE else chunks.resync)(batch, cols, sids)
        self._gate.commit(batch, admission)

    def _flush_index(self) -> None:
        """Apply the index writes queued by the batches (or fence) just applied, in order, as
        one index batch (one index lock hold, one compiled call), still under the directory
        lock: a concurrent ``blend_match`` sees the index before or after all of them, never
        in between (e.g. between a ``remove_chunk`` and its re-``add``s)."""
        self._chunks.flush_index(self._index)

    def _apply_config(self, batch: EventBatch) -> None:
        module = (batch.instance_id, batch.tier, batch.backend)
        if batch.shared:
            self._shared_pools.add(module[1:])
        declared = CapacityDeclaration.after(self._capacities.get(batch.instance_id), batch)
        if declared is not None:
            self._capacities[batch.instance_id] = declared
            (self._private.discard if batch.shared else self._private.add)(module)

    # ------------------------------------------------------------------ reads

    def lookup(self, keys: Sequence[ObjectKey], max_ids: int | None = None) -> list[KeyPlacements]:
        """Placements per key, sorted by (instance, tier, backend); absent keys get ``()``.
        ``PayloadTooLarge`` if the keys' contents hold more than ``max_ids`` token ids."""
        with self._lock:
            return self._chunks.lookup(keys, max_ids)

    def lookup_placements(
        self,
        hashes: Sequence[bytes],
        model_name: str,
        kv_ranks: Sequence[int],
        cache_salt: str = "",
        object_group_id: int = 0,
    ) -> list[tuple[Placement, ...]]:
        """The placements :meth:`lookup` gives for the keys of ``hashes`` × ``kv_ranks``
        (chunk-major, rank-minor, as :func:`~kvatlas.keys.expand_prefix_keys` lays them out),
        without building the keys or reading the chunks' tokens: the route scorer's lookup."""
        with self._lock:
            id_of = self._chunks.shapes.id_of_parts
            sids = [id_of((model_name, r, object_group_id, cache_salt)) for r in kv_ranks]
            return self._chunks.rank_placements(hashes, sids)

    def lookup_tokens(
        self,
        token_ids: Any,
        model_name: str,
        world_size: int = 1,
        cache_salt: str = "",
        object_group_id: int = 0,
        max_ids: int | None = None,
    ) -> TokenLookup:
        """Prefix lookup: hash the full chunks, expand to ``world_size`` ranks, and summarise
        per holder how many *leading* chunks it has on all ranks (what a router needs); the
        keys' contents at most ``max_ids`` token ids (:meth:`lookup`). Each key's result is
        followed by its chunk's keys in other object groups (as LMCache answers), which the
        summary does not count."""
        tokens = as_token_array(token_ids)
        hashes = self._hash_chunks(tokens, self.chunk_size)
        keys = expand_prefix_keys(hashes, model_name, world_size, cache_salt, object_group_id)
        with self._lock:
            results, every = self._chunks.lookup_groups(keys, max_ids)
        return TokenLookup(len(hashes), every, prefix_summary(results, world_size))

    def blend_match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """Fragment lookup; ``[]`` while blend is off. Takes only the index lock."""
        index = self._index
        return [] if index is None else self._chunks.tenants.matched(index.match(tokens, namespace))

    def chunk_matches(self, columns: MatchColumns) -> MatchColumns:
        """Matches the index gave as columns, each hash its chunk's (as :meth:`blend_match`:
        a chunk of several salts is indexed under an occupant hash per salt)."""
        return self._chunks.tenants.matched_columns(columns)

    def match_placements(
        self, matches: Sequence[BlendMatch], namespace: BlendNamespace
    ) -> list[list[tuple[int, tuple[Placement, ...]]]]:
        """For each blend match, ``(kv_rank, placements)`` of its keys in ``namespace``."""
        with self._lock:
            return self._chunks.chunk_placements([m.chunk_hash for m in matches], namespace)

    def list_keys(
        self,
        where: listing.KeyFilter = listing.ALL_KEYS,
        *,
        cursor: str | None = None,
        limit: int = 100,
        max_scan: int | None = None,
    ) -> KeyPage:
        """One page of the keys ``where`` admits in chunk-hash order, resumable from
        ``cursor``; see :func:`kvatlas.directory.listing.list_keys`."""
        return listing.list_keys(
            self._chunks, self._lock, where, cursor=cursor, limit=limit, max_scan=max_scan
        )

    def count_keys(self, where: listing.KeyFilter = listing.ALL_KEYS) -> int:
        """How many keys ``where`` admits."""
        return listing.count_keys(self._chunks, self._lock, where)

    def bytes_by_salt(self, tier: str = "l2") -> dict[str, int]:
        """Bytes of each cache salt's ``tier`` copies (quota usage): L2 from the counter kept
        per key shape, another tier by one pass, a partition per lock hold
        (:mod:`kvatlas.directory.salt_usage`)."""
        if tier == L2_TIER:
            return salt_bytes(self._chunks, self._lock)
        return bytes_by_salt(self._chunks, self._lock, tier)

    def keys_of_salts(self, salts: Collection[str], tier: str = "l2") -> dict[str, list[SaltKey]]:
        """The ``tier`` keys of ``salts`` with what fleet eviction plans with (one pass, a
        partition per lock hold: :mod:`kvatlas.directory.salt_usage`)."""
        return keys_of_salts(self._chunks, self._lock, salts, tier)

    def digest(self, instance_id: str, tier: str, prefix: bytes = b"") -> Digest:
        """The inventory digest of the instance's own placements on ``tier``: the root digest
        (kept up to date as placements change), or a one-byte prefix's (computed from one
        partition on demand). See :mod:`kvatlas.events.inventory`."""
        return self._chunks.digests.read(self._lock, instance_id, tier, prefix)

    def gap_state(self, instance_id: str) -> EmitterCursor | None:
        """The emitter's cursor with its gap counters (``None`` if unknown)."""
        with self._lock:
            return self._gate.cursor(instance_id)

    def emitters(self) -> dict[str, EmitterCursor]:
        with self._lock:
            return self._gate.cursors()

    def capacities(self) -> dict[str, CapacityDeclaration]:
        with self._lock:
            return dict(self._capacities)

    def stats(self) -> DirectoryStats:
        with self._lock:
            cursors = self._gate.cursors()
            chunks = self._chunks
            counts = chunks.counts
            by_tier = counts.placements_by_tier()
            stats = DirectoryStats(
                chunk_size=self.chunk_size,
                keys=counts.keys,
                chunks=sum(len(p) for p in chunks.parts),
                bound_chunks=chunks.bound_chunks(),
                placements=counts.placements,
                l1_placements_by_instance=dict(+counts.l1_placements),
                bytes_by_tier={t: n for t, n in counts.bytes_by_tier.items() if t in by_tier},
                placements_by_tier=by_tier,
                batches={o.value: self._outcomes[o] for o in Outcome},
                emitters=len(cursors),
                gaps=sum(c.gaps for c in cursors.values()),
                capacity_bytes_by_instance={
                    inst: sum(d.capacities.values()) for inst, d in self._capacities.items()
                },
                blend=None,
                content_conflicts=counts.content_conflicts,
            )
            index = self._index
        if index is None:
            return stats
        return dataclasses.replace(stats, blend=index.stats())

    def usage(self) -> DirectoryUsage:
        """Used bytes per module (from placements) beside declared capacities (from config
        batches); a (tier, backend) declared shared, or holding shared copies, is a pool."""
        with self._lock:
            counts = self._chunks.counts
            placements = +counts.module_placements
            used = counts.module_bytes
            declarations = {i: d.capacities for i, d in self._capacities.items()}
            pools = self._shared_pools | {(t, b) for i, t, b in placements if i is None}
            private = set(self._private)
        modules = module_usage(placements, used, declarations, pools, private)
        return DirectoryUsage(modules, frozenset(declarations))

    # ------------------------------------------------------------------ capture and install

    def capture(self) -> Capture:
        """Start a copy-on-write capture of the whole directory (for a snapshot); use the
        result as a context manager. Raises :class:`~kvatlas.errors.Conflict` (a
        ``RuntimeError``) while another capture is open."""
        with self._lock:
            index, cursors, capacities = self._index, self._gate.cursors(), dict(self._capacities)
            fp, anchors = (
                (None, None) if index is None else (index.fingerprint_key, index.anchor_key)
            )
            tenants = self._chunks.tenants.copy()
            state = DirectoryState(self.chunk_size, cursors, capacities, fp, anchors, tenants)
            return Capture(self._lock, self._chunks, state)

    def install(self, restored: Restored) -> None:
        """Replace all state with ``restored``; the blend index (if on) is ``restored``'s or
        rebuilt from the bindings. Raises :class:`~kvatlas.errors.InvalidInput` on a
        chunk-size mismatch and :class:`~kvatlas.errors.Conflict` while a capture is open;
        then nothing changed."""
        state = restored.state
        if state.chunk_size != self.chunk_size:
            raise InvalidInput(
                f"snapshot chunk_size {state.chunk_size} != directory chunk_size {self.chunk_size}"
            )
        counts = restored.counts_or_scan()
        with self._lock:
            self._chunks.restore(restored.shapes, restored.parts, counts)
            ops = self._chunks.adopt_tenants(state.tenants)
            self._gate.restore(state.cursors)
            self._capacities = dict(state.capacities)
            self._shared_pools, self._private = set(), set()
            if self._index is not None:  # built whole, then published: blend_match sees
                index = restored.index  # the old one or all the new one
                if index is None:  # built from the restored records
                    index = self._new_index(self.chunk_size, self._probe_stride)
                    self._chunks.reindex(index)
                if ops:
                    index.apply(ops)
                self._index = index


__all__ = ["KeyDirectory", "PlacementObserver"]
