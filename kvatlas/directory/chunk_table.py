"""Chunk table: every chunk's record, the rules that change them, and what follows from them.

This module holds the table, its reads and its store/access rules. Its collaborators are
given the table (:mod:`~kvatlas.directory.chunk_state`) and own only their own state: the
removal rules (:mod:`~kvatlas.directory.chunk_removals`), the inventory digests
(:mod:`~kvatlas.directory.chunk_digests`), the freeing of restored token slabs
(:mod:`~kvatlas.directory.chunk_slabs`). Counts, partitions, change journal: :mod:`~kvatlas.directory.chunk_counts`.

Invariant: the counters and per-instance L1 chunk sets in :class:`~kvatlas.directory.chunk_counts.ChunkCounts`
always equal what a pass over the records would compute, and every blend-index write a change implies is
queued (:meth:`ChunkTable.flush_index`) in the order the changes happened, so the directory
applies a batch's index writes as one. Changes are made under the directory's lock; a change
either completes or raises before touching anything (the batch was validated when built).

State is partitioned into :data:`~kvatlas.directory.chunk_counts.PARTS` dicts by the first byte of the chunk hash: a listing
page sorts one small partition instead of the whole directory, and a capture copies one
partition at a time. While a capture is in progress, the first change to a chunk whose
partition was not captured yet preserves its record (copy-on-write, see
:mod:`kvatlas.directory.capture` and docs/directory.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence

from kvatlas.directory.blend import AddColumns, AddOp, BlendIndex, BlendOp, RemoveChunkOp
from kvatlas.directory.chunk_counts import (
    L2_TIER,
    PARTS,
    ChangeJournal,
    ChunkCounts,
    DigestArray,
    Partition,
)
from kvatlas.directory.chunk_digests import InventoryDigests
from kvatlas.directory.chunk_removals import RemovalRules
from kvatlas.directory.chunk_slabs import Reclaim, SlabReclaim
from kvatlas.directory.fresh_chunks import store_adds, store_fresh
from kvatlas.directory.records import (
    KeyPlacements,
    Placement,
    PlacementRow,
    Record,
    accessed_at,
    find_key,
    group_placements,
    placement_row,
    placements_at,
    placements_of,
    public_placements,
    rebound,
    record_indexed,
    record_keys,
    record_offset,
    record_stored_tokens,
    record_tokens,
    row_backend,
    row_ident,
    row_instance,
    row_last_access,
    row_shared,
    row_size,
    row_tier,
    shape_ids,
    with_key,
    with_placements_at,
)
from kvatlas.directory.reindex import reindex_records
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.token_store import (
    StoredTokens,
    TokenSlab,
    stored_columns,
    stored_equal,
    token_count,
)
from kvatlas.errors import Conflict
from kvatlas.events import UNKNOWN_OFFSET, VOLATILE_TIERS, EventBatch
from kvatlas.events.columns import EntryColumns
from kvatlas.keys import BlendNamespace, ObjectKey

log = logging.getLogger(__name__)


class ChunkTable:
    """Chunk hash → record, with the counts and queued index writes that follow them (the
    :class:`~kvatlas.directory.chunk_state.ChunkState` of its collaborators)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.shapes = ShapeTable()
        self.parts: list[Partition] = [{} for _ in range(PARTS)]
        self.counts = ChunkCounts()
        self.indexing = False  # whether changes queue blend-index writes
        self.journal: ChangeJournal | None = None  # set while a capture is in progress
        self._ops: list[BlendOp] = []
        self.digests = InventoryDigests(self)
        self.removals = RemovalRules(self, self.digests)
        self.reclaim = SlabReclaim(self)

    # ------------------------------------------------------------------ the collaborators' view

    def preserve(self, h: bytes, rec: Record | None) -> None:
        """Keep the capture-start record of a chunk about to change (if capturing)."""
        if self.journal is not None:
            self.journal.save(h, rec)

    def namespaces(self, rec: Record) -> set[BlendNamespace]:
        return self.shapes.namespaces(shape_ids(rec))

    def queue(self, ops: Iterable[BlendOp]) -> None:
        self._ops += ops

    @property
    def slabs(self) -> list[TokenSlab]:  # restored contents' slabs, not being copied out
        return self.reclaim.slabs

    @property
    def _reclaim(self) -> Reclaim | None:  # (what the slab tests watch)
        return self.reclaim.progress

    # ------------------------------------------------------------------ index writes

    def flush_index(self, index: BlendIndex | None) -> None:
        """Apply the queued index writes to ``index`` (if on), in order, as one batch; then a
        step of freeing mostly dead token slabs (after the writes, so the views the index let
        go of count), whose writes (a remove + re-add per content copied) are one more."""
        self._apply_ops(index)
        reclaim = self.reclaim
        if reclaim.active:
            reclaim.step()
            self._apply_ops(index)
            reclaim.release(index)

    def _apply_ops(self, index: BlendIndex | None) -> None:
        ops = self._ops
        if ops:
            self._ops = []
            if index is not None:
                index.apply(ops)

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        shapes: ShapeTable,
        parts: list[Partition],
        counts: ChunkCounts,
        slabs: Sequence[TokenSlab] = (),
    ) -> None:
        """Adopt restored records (unindexed; see :meth:`reindex`); their shape ids index
        ``shapes``, ``counts`` are theirs, ``slabs`` hold their contents that are views."""
        if self.journal is not None:
            raise Conflict("cannot restore while a snapshot is being taken")
        self.shapes, self.parts, self.counts = shapes, parts, counts
        self.reclaim.restart(slabs)
        self.counts.digests = {}
        self.digests.restart(False)  # digests are built partition by partition, later

    def reindex(self, index: BlendIndex, adds: AddColumns | None = None) -> None:
        """Add every indexable chunk to ``index`` (fresh: one columnar build, see
        :mod:`kvatlas.directory.reindex`) and mark its record indexed. ``adds``: those adds
        from a snapshot reader that built the records marked (``Restored.adds``, vouched)."""
        if adds is None:
            reindex_records(self.parts, self.shapes, self.chunk_size, index)
        else:
            index.build(adds)

    # ------------------------------------------------------------------ reads

    def locate(self, key: ObjectKey) -> tuple[Record, int] | None:
        """The key's chunk record and the key's position in it (if stored)."""
        h = key.chunk_hash
        rec = self.parts[h[0]].get(h)
        if rec is None:
            return None
        sid = self.shapes.id_of(key)
        k = -1 if sid is None else find_key(rec, sid)
        return None if k < 0 else (rec, k)

    def key_placements(self, key: ObjectKey) -> KeyPlacements:
        """The key's placements and its chunk's bound content."""
        found = self.locate(key)
        if found is None:
            return KeyPlacements(key, ())
        return KeyPlacements(key, public_placements(placements_at(*found)), record_tokens(found[0]))

    def chunk_placements(
        self, h: bytes, namespace: BlendNamespace
    ) -> list[tuple[int, tuple[Placement, ...]]]:
        """``(kv_rank, placements)`` of each key of chunk ``h`` in ``namespace`` (any rank or
        group): who holds a blend match."""
        rec = self.parts[h[0]].get(h)
        if rec is None:
            return []
        shapes = self.shapes.shapes
        return [
            (shapes[sid].kv_rank, public_placements(pls))
            for sid, pls in record_keys(rec)
            if shapes[sid].namespace == namespace
        ]

    # ------------------------------------------------------------------ changes

    def store(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> None:
        """Apply a ``store`` batch (its header; the entries are ``cols``); ``sids`` are the
        entries' interned shape ids."""
        if not len(cols):
            return
        inst, tier, backend, shared = batch.instance_id, batch.tier, batch.backend, batch.shared
        counts = self.counts
        own_l1 = tier in VOLATILE_TIERS and not shared
        l1set: set[bytes] | None = None
        if own_l1:
            l1set = counts.l1_chunks.get(inst)
            if l1set is None:
                l1set = counts.l1_chunks[inst] = set()
        # New own copies, by tag multiplier: their elements go into the digest after the loop,
        # in one vectorised step per multiplier (a batch is mostly one shape).
        dig = None if shared else counts.digest_for(inst, tier)
        pending: dict[int, list[bytes]] = {}
        stored, allocated = stored_columns(cols)  # compact, one pass per batch
        fresh = None
        if self.journal is None:  # (a capture saves each record before its first change)
            fresh = store_fresh(
                self.parts, batch, cols, sids, stored, self.chunk_size, self.indexing
            )
        # L2 bytes per shape: a batch of one shape (the usual) adds its total once; a mixed one
        # is counted entry by entry
        one_shape = tier == L2_TIER and sids.count(sids[0]) == len(sids)
        mixed = counts.l2_bytes_by_shape if tier == L2_TIER and not one_shape else None
        if fresh is not None:  # every entry a new chunk: stored in bulk
            n_keys, n_pl, (n_bytes, added) = len(cols), len(cols), fresh
            if added:
                shapes = self.shapes.shapes
                self._ops.append(store_adds(added, cols, stored, sids, shapes, allocated))
            if dig is not None:
                pending[self.digests.tag(sids[0], tier, backend)] = cols.chunk_hashes
            if l1set is not None:
                l1set.update(cols.chunk_hashes)
        else:
            n_keys, n_pl, n_bytes = self._store_each(
                batch, cols, sids, stored, allocated, l1set, dig, pending, mixed
            )
        if one_shape:
            counts.l2_bytes_by_shape[sids[0]] += n_bytes
        if dig is not None:
            self.digests.xor_many(dig, pending.items())
        counts.keys += n_keys
        counts.placements += n_pl
        counts.bytes_by_tier[tier] += n_bytes
        module = (None if shared else inst, tier, backend)
        counts.module_placements[module] += n_pl
        counts.module_bytes[module] += n_bytes
        if own_l1:
            counts.l1_placements[inst] += n_pl

    def _store_each(
        self,
        batch: EventBatch,
        cols: EntryColumns,
        sids: list[int],
        stored: list[StoredTokens | None],
        allocated: bool,
        l1set: set[bytes] | None,
        dig: DigestArray | None,
        pending: dict[int, list[bytes]],
        l2_by_shape: Counter[int] | None,
    ) -> tuple[int, int, int]:
        """:meth:`store`, entry by entry (any batch); returns the (keys, placements, bytes)
        added. New own copies' hashes go to ``pending`` by tag multiplier (if ``dig``); the
        bytes added per shape to ``l2_by_shape`` (an L2 batch of several shapes)."""
        inst, inc, tier, backend = batch.instance_id, batch.incarnation, batch.tier, batch.backend
        shared, ts = batch.shared, batch.ts
        by_size: dict[int, PlacementRow] = {}
        parts = self.parts
        journal = self.journal
        indexing = self.indexing
        ops = self._ops
        shapes = self.shapes.shapes
        chunk_size = self.chunk_size
        debug = log.isEnabledFor(logging.DEBUG)
        new_own: list[bytes] | None = None
        tag_sid = -1
        tag = self.digests.tag
        # Every placement added or replaced here has this batch's tier and (for own copies)
        # instance: the counters move by one sum per batch instead of per entry.
        n_keys = n_pl = n_bytes = 0
        added: list[int] = []  # entries whose new chunk is indexed: one AddColumns for all
        for j, h, sid, size, tokens, offset in zip(
            range(len(cols)),
            cols.chunk_hashes,
            sids,
            cols.size_bytes.tolist(),
            stored,
            cols.token_offsets.tolist(),
            strict=True,
        ):
            p = by_size.get(size)
            if p is None:
                p = by_size[size] = placement_row(inst, inc, tier, backend, size, shared, ts)
            part = parts[h[0]]
            rec = part.get(h)
            if journal is not None:
                journal.save(h, rec)
            if dig is not None and sid != tag_sid:
                new_own = pending.setdefault(tag(sid, tier, backend), [])
                tag_sid = sid
            if rec is None:  # a new chunk: the common case, without the general bookkeeping
                # (records are built inline here, as records.new_record builds them: the call
                # would be a measurable share of consuming a new chunk)
                n_keys += 1
                n_pl += 1
                n_bytes += size
                if l2_by_shape is not None:
                    l2_by_shape[sid] += size
                if tokens is None:
                    part[h] = (None, UNKNOWN_OFFSET, False, sid, p)
                    if debug:
                        log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
                elif token_count(tokens) != chunk_size:
                    n = token_count(tokens)
                    log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), n)
                    part[h] = (tokens, offset, False, sid, p)
                elif not indexing or offset == UNKNOWN_OFFSET:
                    part[h] = (tokens, offset, False, sid, p)
                else:
                    part[h] = (tokens, offset, True, sid, p)
                    added.append(j)
                if new_own is not None:
                    new_own.append(h)
            else:
                queued = len(ops)
                dk, dp, db = self._store_existing(h, part, rec, sid, p, tokens, offset, debug)
                if added and len(ops) > queued:  # the adds so far go first, as they happened
                    ops.insert(queued, store_adds(added, cols, stored, sids, shapes, allocated))
                    added = []
                n_keys += dk
                n_pl += dp
                n_bytes += db
                if l2_by_shape is not None:
                    l2_by_shape[sid] += db
                if new_own is not None and dp:  # a new own copy (a replaced one has the
                    new_own.append(h)  # same element)
            if l1set is not None:
                l1set.add(h)
        if added:
            ops.append(store_adds(added, cols, stored, sids, shapes, allocated))
        return n_keys, n_pl, n_bytes

    def _store_existing(
        self,
        h: bytes,
        part: Partition,
        rec: Record,
        sid: int,
        p: PlacementRow,
        new_tokens: StoredTokens | None,
        new_offset: int,
        debug: bool,
    ) -> tuple[int, int, int]:
        """Store into a known chunk (``new_tokens``: the entry's tokens, stored); returns the
        (keys, placements, bytes) deltas."""
        k = find_key(rec, sid)
        tokens = record_stored_tokens(rec)
        offset, indexed = record_offset(rec), record_indexed(rec)
        new_claim = False
        size = row_size(p)
        if k < 0:
            new_claim = indexed and self.shapes[sid].namespace not in self.namespaces(rec)
            rec = with_key(rec, sid, p)
            dk, dp, db = 1, 1, size
        else:
            ident = row_ident(p)
            kept = []
            dk, dp, db = 0, 1, size
            for q in placements_of(placements_at(rec, k)):
                if row_ident(q) == ident:
                    dp -= 1
                    db -= row_size(q)
                else:
                    kept.append(q)
            kept.append(p)
            rec = with_placements_at(rec, k, group_placements(kept))
        reindexed = False
        if new_tokens is not None:
            tokens, offset, indexed, reindexed = self._bind(
                h, tokens, offset, indexed, rec, new_tokens, new_offset
            )
        elif tokens is None and debug:
            log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
        if new_claim and not reindexed and indexed and self.indexing:
            assert tokens is not None
            self._ops.append(AddOp(tokens, h, offset, self.shapes[sid].namespace))
        part[h] = rebound(rec, tokens, offset, indexed)
        return dk, dp, db

    def _bind(
        self,
        h: bytes,
        old: StoredTokens | None,
        old_offset: int,
        indexed: bool,
        rec: Record,
        tokens: StoredTokens,
        offset: int,
    ) -> tuple[StoredTokens | None, int, bool, bool]:
        """Bind ``tokens`` to the chunk (whose keys are ``rec``'s) and queue the index writes
        that follow. Returns the chunk's new ``(tokens, token_offset, indexed)`` and whether
        it (re)added every namespace."""
        if old is not None and stored_equal(old, tokens):
            if offset in (UNKNOWN_OFFSET, old_offset):
                if indexed or not self.indexing:
                    return old, old_offset, indexed, False
                # bound before blend was on: this fresh report of the content indexes it
                offset = old_offset
            bound = old
        else:
            if indexed and self.indexing and old is not None:
                # Retire the old content before the new one appears: no window in which a match
                # returns new content at the old position (both go in one index batch).
                self._ops.append(RemoveChunkOp(old, h))
            indexed = False
            bound = tokens
            if token_count(tokens) != self.chunk_size:
                n = token_count(tokens)
                log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), n)
        # offset -1 is never indexed: a match without its stored position would be re-RoPEd
        # from the wrong place, i.e. wrong KV, which is worse than a miss.
        if not self.indexing or offset == UNKNOWN_OFFSET or token_count(bound) != self.chunk_size:
            return bound, offset, indexed, False
        self._ops += [AddOp(bound, h, offset, ns) for ns in self.namespaces(rec)]
        return bound, offset, True, True

    def resync(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> int:
        """Apply a ``resync`` batch: the reporter's own placements on the batch's tier under
        its prefixes become exactly the listed ones (the others are removed, whatever their
        backend; the listed ones are stored). Returns how many placements were removed."""
        removed = self.removals.drop_unlisted(batch, cols, sids)
        self.store(batch, cols, sids)
        return removed

    def access(self, batch: EventBatch) -> None:
        """Apply an ``access`` batch: newer ``last_access`` on the reporter's copies."""
        tier, backend, ts, shared, inst = (
            batch.tier, batch.backend, batch.ts, batch.shared, batch.instance_id
        )  # fmt: skip

        def hit(p: PlacementRow) -> bool:
            if row_tier(p) != tier or (backend and row_backend(p) != backend):
                return False
            if row_last_access(p) >= ts:
                return False
            return row_shared(p) if shared else (not row_shared(p) and row_instance(p) == inst)

        for entry in batch.entries:
            found = self.locate(entry.key)
            if found is None:
                continue
            rec, k = found
            old = placements_of(placements_at(rec, k))
            if not any(hit(p) for p in old):
                continue
            h = entry.key.chunk_hash
            self.preserve(h, rec)
            new = [accessed_at(p, ts) if hit(p) else p for p in old]
            self.parts[h[0]][h] = with_placements_at(rec, k, group_placements(new))
