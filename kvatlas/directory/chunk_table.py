"""Chunk table: every chunk's record, the rules that change them, and what follows from them.

This module holds the table, its reads and its access rule. Its collaborators are given the
table (:mod:`~kvatlas.directory.chunk_state`) and own only their own state: the store rules
(:mod:`~kvatlas.directory.chunk_stores`), the removal rules
(:mod:`~kvatlas.directory.chunk_removals`), the inventory digests
(:mod:`~kvatlas.directory.chunk_digests`). Counts, partitions, change journal: :mod:`~kvatlas.directory.chunk_counts`.

Invariant: the counters in :class:`~kvatlas.directory.chunk_counts.ChunkCounts` and each row's
L1 owners (:mod:`~kvatlas.directory.l1_owners`) always equal what a pass over the records would
compute, and every blend-index write a change implies is
queued (:meth:`ChunkTable.flush_index`) in the order the changes happened, so the directory
applies a batch's index writes as one. Changes are made under the directory's lock; a change
either completes or raises before touching anything (the batch was validated when built).

State is partitioned into :data:`~kvatlas.directory.chunk_counts.PARTS` partitions by the first byte of the chunk hash, each
read and written as a ``dict`` of records and kept as rows of columns the partitions share
(:mod:`~kvatlas.directory.chunk_parts`): a listing
page sorts one small partition instead of the whole directory, and a capture copies one
partition at a time. While a capture is in progress, the first change to a chunk whose
partition was not captured yet preserves its record (copy-on-write, see
:mod:`kvatlas.directory.capture` and docs/directory.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from operator import attrgetter

from kvatlas.directory.blend import BlendIndex, BlendOp, RemoveClaimOp
from kvatlas.directory.chunk_counts import PARTS, ChangeJournal, ChunkCounts, Partition
from kvatlas.directory.chunk_digests import InventoryDigests
from kvatlas.directory.chunk_parts import ChunkPart, new_parts, rows_of
from kvatlas.directory.chunk_removals import RemovalRules
from kvatlas.directory.chunk_stores import StoreRules
from kvatlas.directory.fresh_chunks import first_held
from kvatlas.directory.key_groups import KeyGroups, key_groups
from kvatlas.directory.records import (
    KeyPlacements,
    Placement,
    PlacementRow,
    Placements,
    Record,
    accessed_at,
    find_key,
    group_placements,
    key_placements_of,
    placements_at,
    placements_of,
    public_groups,
    public_placements,
    rebound,
    record_indexed,
    record_keys,
    record_stored_tokens,
    row_backend,
    row_instance,
    row_last_access,
    row_shared,
    row_tier,
    shape_ids,
    with_placements_at,
)
from kvatlas.directory.reindex import reindex_records
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.tenant_bindings import Bindings, TenantBindings, claim_ops
from kvatlas.directory.token_store import widened_many
from kvatlas.errors import Conflict
from kvatlas.events import UNKNOWN_OFFSET, EventBatch
from kvatlas.events.columns import ColumnBatch, EntryColumns
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hash_of
from kvatlas.keys.object_key import shape_parts
from kvatlas.keys.tokens import TokenArray

_GROUP = attrgetter("object_group_id")
_KEY_GROUP = attrgetter("key.object_group_id")


class ChunkTable:
    """Chunk hash → record, with the counts and queued index writes that follow them (the
    :class:`~kvatlas.directory.chunk_state.ChunkState` of its collaborators)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.shapes = ShapeTable()
        self.parts = new_parts(PARTS)
        self.counts = ChunkCounts()
        self.tenants = TenantBindings()
        self.indexing = False  # whether changes queue blend-index writes
        self.journal: ChangeJournal | None = None  # set while a capture is in progress
        self.ops: list[BlendOp] = []  # the queued index writes, in order
        self.digests = InventoryDigests(self)
        self.removals = RemovalRules(self, self.digests)
        self.stores = StoreRules(self, self.digests)

    # ------------------------------------------------------------------ the collaborators' view

    def preserve(self, h: bytes, rec: Record | None) -> None:
        """Keep the capture-start record of a chunk about to change (if capturing)."""
        if self.journal is not None:
            self.journal.save(h, rec)

    def namespaces(self, rec: Record) -> set[BlendNamespace]:
        return self.shapes.namespaces(shape_ids(rec))

    def queue(self, ops: Iterable[BlendOp]) -> None:
        self.ops += ops

    # ------------------------------------------------------------------ index writes

    def flush_index(self, index: BlendIndex | None) -> None:
        """Apply the queued index writes to ``index`` (if on), in order, as one batch."""
        ops = self.ops
        if ops:
            self.ops = []
            if index is not None:
                index.apply(ops)
        self.tenants.applied()

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        shapes: ShapeTable,
        parts: Sequence[Partition | ChunkPart],
        counts: ChunkCounts,
    ) -> None:
        """Adopt restored records (unindexed; see :meth:`reindex`); their shape ids index
        ``shapes``, ``counts`` are theirs."""
        if self.journal is not None:
            raise Conflict("cannot restore while a snapshot is being taken")
        self.shapes, self.counts = shapes, counts
        self.parts = new_parts(PARTS, parts)
        self.counts.digests = {}
        self.digests.restart(False)  # digests are built partition by partition, later

    def adopt_tenants(self, tenants: dict[bytes, Bindings]) -> list[BlendOp]:
        """Take restored per-salt bindings (:mod:`~kvatlas.directory.tenant_bindings`, an
        entry for each chunk held under keys of several salts): such a chunk's record loses
        the binding it carries (one for all its salts, from a snapshot written before
        bindings were per salt: nobody can tell whose it was). Returns the index writes that
        follow, for an index built from the records."""
        self.tenants = TenantBindings(tenants)
        ops: list[BlendOp] = []
        for h in tenants:
            part = self.parts[h[0]]
            rec = part[h]
            held = record_stored_tokens(rec)
            if held is not None:
                if record_indexed(rec):
                    ops += [RemoveClaimOp(held, h, ns) for ns in self.namespaces(rec)]
                part[h] = rebound(rec, None, UNKNOWN_OFFSET, False)
        return ops + self.tenant_claims()

    def tenant_claims(self) -> list[BlendOp]:
        """The index adds of every chunk of several salts' claims (none while not indexing):
        a restore's, or a new index's."""
        if not self.indexing:
            return []
        tenants, parts, shapes, size = self.tenants, self.parts, self.shapes, self.chunk_size
        return claim_ops(
            set(),
            {
                claim
                for h, bindings in tenants.rows.items()
                for claim in tenants.claims(h, shapes, parts[h[0]][h], bindings, size)
            },
        )

    def reindex(self, index: BlendIndex) -> None:
        """Add every indexable chunk to ``index`` (fresh: one columnar build, see
        :mod:`kvatlas.directory.reindex`) and mark its record indexed."""
        reindex_records(self.parts, self.shapes, self.chunk_size, index)

    # ------------------------------------------------------------------ reads

    def bound_chunks(self) -> int:
        """How many chunks have known content (a count the columns keep, and the chunks of
        several salts some salt bound)."""
        return self.parts[0].cols.bound + self.tenants.bound()

    def locate(self, h: bytes, sid: int | None) -> tuple[Record, int] | None:
        """Chunk ``h``'s record and the position in it of its key of shape ``sid`` (``None``:
        the chunk or that key is not held, or the shape was never interned)."""
        rec = None if sid is None else self.parts[h[0]].get(h)
        if rec is None or sid is None:
            return None
        k = find_key(rec, sid)
        return None if k < 0 else (rec, k)

    def lookup(self, keys: Sequence[ObjectKey], max_ids: int | None = None) -> list[KeyPlacements]:
        """Each key's placements and its chunk's bound content, read as one batch: the keys'
        rows, their fields gathered from the columns (no record built), the contents widened
        by one compiled call (at most ``max_ids`` ids: ``widened_many``), each distinct
        placements group made public once."""
        hashes = list(map(chunk_hash_of, keys))
        rows = rows_of(self.parts, hashes)
        sids = self.shapes.ids_of(keys)
        held: Sequence[int] = range(len(keys))
        if None in rows:
            held = [i for i, r in enumerate(rows) if r is not None]
            rows, sids = [rows[i] for i in held], [sids[i] for i in held]
        found, contents = self.parts[0].cols.key_placements(rows, sids)  # type: ignore[arg-type]
        if self.tenants.rows:  # chunks of several salts: each key its salt's content
            at = [hashes[i] for i in held]
            contents = self.tenants.contents(at, [keys[i].cache_salt for i in held], contents)
        if len(held) == len(keys) and None not in found:  # every key held: a prompt's lookup
            widened = widened_many(contents, max_ids)
            return key_placements_of(keys, public_groups(found), widened)
        hits = [j for j, pls in enumerate(found) if pls is not None]
        at = [held[j] for j in hits]
        placements: list[tuple[Placement, ...]] = [()] * len(keys)
        some = widened_many([contents[j] for j in hits], max_ids)
        bound: list[TokenArray | None] = [None] * len(keys)
        deque(map(placements.__setitem__, at, public_groups([found[j] for j in hits])), maxlen=0)
        deque(map(bound.__setitem__, at, some), maxlen=0)
        return key_placements_of(keys, placements, bound)

    def lookup_groups(
        self, keys: Sequence[ObjectKey], max_ids: int | None = None
    ) -> tuple[list[KeyPlacements], list[KeyPlacements]]:
        """:meth:`lookup` of ``keys`` (of one object group: a token lookup's), and of
        ``keys`` each followed by its chunk's keys in other object groups, in ascending group
        order (the list itself when there are none): what a token lookup answers, as LMCache
        does."""
        results = self.lookup(keys, max_ids)
        if not keys or self.shapes.groups <= {keys[0].object_group_id}:  # (most fleets)
            return results, results
        others = self.in_other_groups(keys)
        extra = [k for more in others for k in more]
        if not extra:
            return results, results
        if max_ids is not None:  # (each key of a chunk carries the same ids)
            max_ids = max_ids * len(extra) // len(keys)
        found = iter(self.lookup(extra, max_ids))
        every: list[KeyPlacements] = []
        for own, more in zip(results, others, strict=True):
            every += sorted([own, *islice(found, len(more))], key=_KEY_GROUP)
        return results, every

    def in_other_groups(self, keys: Sequence[ObjectKey]) -> list[list[ObjectKey]]:
        """Per key, the keys its chunk is stored under that differ from it only in the
        object group, in ascending group order (LMCache's ``get_keys_across_object_groups``):
        a token lookup's keys are group 0's. Only chunks with another key than the one asked
        are read as records."""
        out: list[list[ObjectKey]] = [[] for _ in keys]
        rows = rows_of(self.parts, list(map(chunk_hash_of, keys)))
        held = [i for i, r in enumerate(rows) if r is not None]
        if not held:
            return out
        cols, shapes = self.parts[0].cols, self.shapes.shapes
        _, flagged, _, rests = cols.fields([rows[i] for i in held])  # type: ignore[misc]
        sids = self.shapes.ids_of([keys[i] for i in held])
        for i, first, rest, sid in zip(held, flagged, rests, sids, strict=True):
            if not rest and first >> 1 == sid:  # one key, the one asked: most chunks
                continue
            key = keys[i]
            model, rank, group, salt = shape_parts(key)
            for other, _ in record_keys(cols.record(rows[i])):  # type: ignore[arg-type]
                m, k, g, s = shapes[other].parts
                if g != group and k == rank and m == model and s == salt:
                    out[i].append(shapes[other].key(key.chunk_hash))
            out[i].sort(key=_GROUP)
        return out

    def rank_placements(
        self, hashes: Sequence[bytes], shape_ids: Sequence[int | None]
    ) -> list[tuple[Placement, ...]]:
        """The placements of the keys of ``hashes`` × ``shape_ids`` (chunk-major; ``()``:
        not held), read as :meth:`lookup` reads them (no content)."""
        rows = rows_of(self.parts, hashes)
        held = [r for r in rows if r is not None]
        w = len(shape_ids)
        found, _ = self.parts[0].cols.key_placements(
            [r for r in held for _ in range(w)], list(shape_ids) * len(held)
        )
        public = iter(public_groups(found))
        out: list[tuple[Placement, ...]] = []
        for r in rows:
            out += [()] * w if r is None else islice(public, w)
        return out

    def chunk_placements(
        self, hashes: Sequence[bytes], namespace: BlendNamespace
    ) -> list[list[tuple[int, tuple[Placement, ...]]]]:
        """For each chunk of ``hashes``, ``(kv_rank, placements)`` of each of its keys in
        ``namespace`` (any rank or group): who holds a blend match. The rows read as one batch,
        the records built by C-level maps."""
        rows = rows_of(self.parts, hashes)
        held = [r for r in rows if r is not None]
        records = iter(self.parts[0].cols.records(held))  # type: ignore[arg-type]
        shapes = self.shapes.shapes
        return [
            []
            if r is None
            else [
                (shapes[sid].kv_rank, public_placements(pls))
                for sid, pls in record_keys(next(records))
                if shapes[sid].namespace == namespace
            ]
            for r in rows
        ]

    # ------------------------------------------------------------------ changes

    def store(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> None:
        """Apply a ``store`` batch (its header; the entries are ``cols``); ``sids`` are the
        entries' interned shape ids (see :class:`~kvatlas.directory.chunk_stores.StoreRules`)."""
        self.stores.store(batch, cols, sids)

    def store_run(self, run: Sequence[ColumnBatch]) -> bool:
        """Store a run of store batches (:mod:`~kvatlas.directory.store_runs`) in one bulk
        store, as storing each in turn would; ``False``, having changed nothing but the
        shapes interned, when it cannot (then store them one by one)."""
        parts = [cb.entry_columns() for cb in run]
        if first_held(self.parts, parts[0].chunk_hashes):  # re-stores: before any joining
            return False
        cols = EntryColumns.joined(parts)
        if cols is None or not len(cols):
            return False
        sids = self.shapes.intern_columns(cols)
        return self.stores.store_run([(cb.header, cb.n_entries) for cb in run], cols, sids)

    def resync(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> int:
        """Apply a ``resync`` batch: the reporter's own placements on the batch's tier under
        its prefixes become exactly the listed ones (the others are removed, whatever their
        backend; the listed ones are stored). Returns how many placements were removed."""
        removed = self.removals.drop_unlisted(batch, cols, sids)
        self.store(batch, cols, sids)
        return removed

    def access(self, batch: EventBatch, cols: EntryColumns) -> None:
        """Apply an ``access`` batch (its header; the entries are ``cols``): newer
        ``last_access`` on the reporter's copies. Chunks held under one key are read as
        columns and changed by groups sharing one placements value (each group's new
        placements made once, no record built); the others entry by entry."""
        tier, backend, ts, shared, inst = (
            batch.tier, batch.backend, batch.ts, batch.shared, batch.instance_id
        )  # fmt: skip

        def hit(p: PlacementRow) -> bool:
            if row_tier(p) != tier or (backend and row_backend(p) != backend):
                return False
            if row_last_access(p) >= ts:
                return False
            return row_shared(p) if shared else (not row_shared(p) and row_instance(p) == inst)

        def accessed(pls: Placements) -> Placements | None:
            """A key's placements with the reporter's copies accessed (``None``: none)."""
            old = placements_of(pls)
            if not any(map(hit, old)):
                return None
            return group_placements([accessed_at(p, ts) if hit(p) else p for p in old])

        hashes, sids = cols.chunk_hashes, self.shapes.ids_of_columns(cols)
        left: Sequence[int] = range(len(hashes))
        if self.journal is None:  # (a capture saves each record before it changes)
            kg = key_groups(self.parts, hashes, sids)
            left = [] if kg is None else self._access_groups(kg, accessed)
        for i in left:
            found = self.locate(hashes[i], sids[i])
            if found is not None:
                rec, k = found
                new = accessed(placements_at(rec, k))
                if new is not None:
                    h = hashes[i]
                    self.preserve(h, rec)
                    self.parts[h[0]][h] = with_placements_at(rec, k, new)

    def _access_groups(
        self, kg: KeyGroups, accessed: Callable[[Placements], Placements | None]
    ) -> list[int]:
        """:meth:`access` of the chunks ``kg`` groups: a group's new placements made once,
        set on each of its rows; returns the entries left (chunks under several keys)."""
        for group in kg.groups.values():
            new = accessed(kg.placements(group))
            if new is not None:
                self.parts[0].cols.put_placements([kg.rows[j] for j in group], new)
        return kg.left
