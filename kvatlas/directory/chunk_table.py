"""Chunk table: every chunk's record, the rules that change them, and what follows from them.

Invariant: the counters and per-instance L1 chunk sets in :class:`ChunkCounts` always equal
what a pass over the records would compute, and every blend-index write a change implies is
queued (:meth:`ChunkTable.take_index_ops`) in the order the changes happened, so the directory
applies a batch's index writes as one. Changes are made under the directory's lock; a change
either completes or raises before touching anything (the batch was validated when built).

State is partitioned into :data:`PARTS` dicts by the first byte of the chunk hash: a listing
page sorts one small partition instead of the whole directory, and a capture copies one
partition at a time. While a capture is in progress, the first change to a chunk whose
partition was not captured yet preserves its record (copy-on-write, see
:mod:`kvatlas.directory.capture` and docs/directory.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvatlas.directory.blend import AddOp, BlendOp, RemoveChunkOp, RemoveClaimOp, new_add_op
from kvatlas.directory.records import (
    KeyPair,
    KeyPlacements,
    Module,
    Placement,
    PlacementRow,
    Placements,
    Record,
    accessed_at,
    find_key,
    group_placements,
    key_count,
    l1_owner,
    make_record,
    pack_placements,
    placement_groups,
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
    row_module,
    row_shared,
    row_size,
    row_tier,
    shape_ids,
    with_key,
    with_placements_at,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.token_store import StoredTokens, stored_columns
from kvatlas.errors import Conflict
from kvatlas.events import UNKNOWN_OFFSET, VOLATILE_TIERS, EventBatch
from kvatlas.events.columns import EntryColumns
from kvatlas.events.inventory import element, shape_tag, tag_multiplier, xor_elements
from kvatlas.events.model import tokens_equal
from kvatlas.keys import BlendNamespace, ObjectKey

log = logging.getLogger(__name__)

PARTS = 256
Partition = dict[bytes, Record]  # chunk hash -> record; a chunk lives in partition hash[0]
DigestArray = np.ndarray[Any, Any]  # 256 uint64 buckets (kvatlas.events.inventory)


@dataclass(slots=True)
class ChunkCounts:
    """What follows from the records: key and placement counts, bytes per tier, per
    instance its own L1 placements and the chunks holding them (what fencing visits), and
    placements and bytes per :data:`~kvatlas.directory.records.Module` (usage), and the inventory digest of every (instance, tier)'s own placements (see
    :mod:`kvatlas.events.inventory`; after a restore, built by
    :meth:`ChunkTable.digest_partition`)."""

    keys: int = 0
    placements: int = 0
    l1_placements: Counter[str] = field(default_factory=Counter)
    bytes_by_tier: Counter[str] = field(default_factory=Counter)
    l1_chunks: dict[str, set[bytes]] = field(default_factory=dict)
    module_placements: Counter[Module] = field(default_factory=Counter)
    module_bytes: Counter[Module] = field(default_factory=Counter)
    digests: dict[tuple[str, str], DigestArray] = field(default_factory=dict)

    def digest_for(self, inst: str, tier: str) -> DigestArray:
        """The (mutable) root digest of ``inst``'s own placements on ``tier``."""
        d = self.digests.get((inst, tier))
        if d is None:
            d = self.digests[(inst, tier)] = np.zeros(PARTS, dtype=np.uint64)
        return d

    @classmethod
    def scan(cls, parts: list[Partition]) -> ChunkCounts:
        """The counts of ``parts``, by one pass over every record."""
        out = cls()
        for part in parts:
            for h, rec in part.items():
                out.keys += key_count(rec)
                for pls in placement_groups(rec):
                    for p in placements_of(pls):
                        out.placements += 1
                        out.bytes_by_tier[row_tier(p)] += row_size(p)
                        out.module_placements[row_module(p)] += 1
                        out.module_bytes[row_module(p)] += row_size(p)
                        owner = l1_owner(p)
                        if owner is not None:
                            out.l1_placements[owner] += 1
                            out.l1_chunks.setdefault(owner, set()).add(h)
        return out


class ChangeJournal(Protocol):
    """Told about every chunk about to change, with its record (``None``: absent) before the
    change; see :class:`kvatlas.directory.capture.CowJournal`."""

    def save(self, h: bytes, rec: Record | None) -> None: ...


class ChunkTable:
    """Chunk hash → record, with the counts and queued index writes that follow them."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.shapes = ShapeTable()
        self.parts: list[Partition] = [{} for _ in range(PARTS)]
        self.counts = ChunkCounts()
        self.indexing = False  # whether changes queue blend-index writes
        self.journal: ChangeJournal | None = None  # set while a capture is in progress
        self._ops: list[BlendOp] = []
        # (shape id, tier, backend) -> the inventory element's multiplier
        self._tags: dict[tuple[int, str, str], int] = {}
        self.digested = bytearray(b"\x01" * PARTS)  # partitions counted in counts.digests
        self._all_digested = True

    # ------------------------------------------------------------------ restore

    def restore(self, shapes: ShapeTable, parts: list[Partition], counts: ChunkCounts) -> None:
        """Adopt restored records (unindexed; see :meth:`reindex`); their shape ids index
        ``shapes``, ``counts`` are theirs."""
        if self.journal is not None:
            raise Conflict("cannot restore while a snapshot is being taken")
        self.shapes, self.parts, self.counts = shapes, parts, counts
        self._tags = {}
        self.counts.digests = {}
        self.digested = bytearray(PARTS)  # digests are built partition by partition, later
        self._all_digested = False

    def digest_partition(self, b: int) -> None:
        """Add partition ``b``'s own placements to the digests (once, after a restore: the
        restore itself stays one pass over columns, and building the digests holds the lock
        one partition at a time)."""
        if self.digested[b]:
            return
        acc: dict[tuple[str, str], int] = {}
        tag = self._tag
        for h, rec in self.parts[b].items():
            for sid, pls in record_keys(rec):
                for p in placements_of(pls):
                    if not row_shared(p):
                        where = (row_instance(p), row_tier(p))
                        e = element(h, tag(sid, row_tier(p), row_backend(p)))
                        acc[where] = acc.get(where, 0) ^ e
        for (inst, tier), value in acc.items():
            self.counts.digest_for(inst, tier)[b] ^= np.uint64(value)
        self.digested[b] = 1
        self._all_digested = all(self.digested)

    def _tag(self, sid: int, tier: str, backend: str) -> int:
        t = self._tags.get((sid, tier, backend))
        if t is None:
            tag = shape_tag(*self.shapes[sid].parts, tier, backend)
            t = self._tags[(sid, tier, backend)] = tag_multiplier(tag)
        return t

    def _xor(self, inst: str, tier: str, h: bytes, sid: int, backend: str) -> None:
        """Add or remove (the same thing) one own placement in its digest."""
        if self.digested[h[0]]:
            e = np.uint64(element(h, self._tag(sid, tier, backend)))
            self.counts.digest_for(inst, tier)[h[0]] ^= e

    def reindex(self, apply: Callable[[list[BlendOp]], None]) -> None:
        """Add every indexable chunk to the index (``apply``, one call per partition)."""
        for part in self.parts:
            ops: list[BlendOp] = []
            for h, rec in part.items():
                tokens, offset = record_stored_tokens(rec), record_offset(rec)
                if tokens is not None and self._indexable(tokens, offset):
                    ops += [AddOp(tokens, h, offset, ns) for ns in self._namespaces(rec)]
                    part[h] = rebound(rec, tokens, offset, True)  # same key: no resize
            apply(ops)

    def take_index_ops(self) -> list[BlendOp]:
        """The index writes queued since the last call, in order."""
        ops = self._ops
        if ops:
            self._ops = []
        return ops

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

    def placements(self, key: ObjectKey) -> tuple[Placement, ...]:
        found = self.locate(key)
        return () if found is None else public_placements(placements_at(*found))

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
        inst, inc, tier, backend = batch.instance_id, batch.incarnation, batch.tier, batch.backend
        shared, ts = batch.shared, batch.ts
        counts = self.counts
        own_l1 = tier in VOLATILE_TIERS and not shared
        l1set: set[bytes] | None = None
        if own_l1:
            l1set = counts.l1_chunks.get(inst)
            if l1set is None:
                l1set = counts.l1_chunks[inst] = set()
        by_size: dict[int, PlacementRow] = {}
        parts = self.parts
        journal = self.journal
        indexing = self.indexing
        ops = self._ops
        shapes = self.shapes.shapes
        chunk_size = self.chunk_size
        debug = log.isEnabledFor(logging.DEBUG)
        # New own copies, by tag multiplier: their elements go into the digest after the loop,
        # in one vectorised step per multiplier (a batch is mostly one shape).
        dig = None if shared else counts.digest_for(inst, tier)
        pending: dict[int, list[bytes]] = {}
        new_own: list[bytes] | None = None
        tag_sid = -1
        # Every placement added or replaced here has this batch's tier and (for own copies)
        # instance: the counters move by one sum per batch instead of per entry.
        n_keys = n_pl = n_bytes = 0
        for h, sid, size, tokens, offset in zip(
            cols.chunk_hashes,
            sids,
            cols.size_bytes.tolist(),
            stored_columns(cols),  # compact, one pass per batch
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
                new_own = pending.setdefault(self._tag(sid, tier, backend), [])
                tag_sid = sid
            if rec is None:  # a new chunk: the common case, without the general bookkeeping
                # (records are built inline here, as records.new_record builds them: the call
                # would be a measurable share of consuming a new chunk)
                n_keys += 1
                n_pl += 1
                n_bytes += size
                if tokens is None:
                    part[h] = (None, UNKNOWN_OFFSET, False, sid, p)
                    if debug:
                        log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
                elif len(tokens) != chunk_size:
                    log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), len(tokens))
                    part[h] = (tokens, offset, False, sid, p)
                elif not indexing or offset == UNKNOWN_OFFSET:
                    part[h] = (tokens, offset, False, sid, p)
                else:
                    part[h] = (tokens, offset, True, sid, p)
                    ops.append(new_add_op((tokens, h, offset, shapes[sid].namespace)))
                if new_own is not None:
                    new_own.append(h)
            else:
                dk, dp, db = self._store_existing(h, part, rec, sid, p, tokens, offset, debug)
                n_keys += dk
                n_pl += dp
                n_bytes += db
                if new_own is not None and dp:  # a new own copy (a replaced one has the
                    new_own.append(h)  # same element)
            if l1set is not None:
                l1set.add(h)
        if dig is not None:
            kept = None if self._all_digested else np.frombuffer(self.digested, dtype=np.uint8)
            for multiplier, hs in pending.items():
                if hs:
                    xor_elements(dig, hs, multiplier, kept)
        counts.keys += n_keys
        counts.placements += n_pl
        counts.bytes_by_tier[tier] += n_bytes
        module = (None if shared else inst, tier, backend)
        counts.module_placements[module] += n_pl
        counts.module_bytes[module] += n_bytes
        if own_l1:
            counts.l1_placements[inst] += n_pl

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
            new_claim = indexed and self.shapes[sid].namespace not in self._namespaces(rec)
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

    def _indexable(self, tokens: StoredTokens, offset: int) -> bool:
        # offset -1 is never indexed: a match without its stored position would be re-RoPEd
        # from the wrong place, i.e. wrong KV, which is worse than a miss.
        return offset != UNKNOWN_OFFSET and len(tokens) == self.chunk_size

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
        if old is not None and tokens_equal(old, tokens):
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
            if len(tokens) != self.chunk_size:
                log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), len(tokens))
        if not self.indexing or not self._indexable(bound, offset):
            return bound, offset, indexed, False
        self._ops += [AddOp(bound, h, offset, ns) for ns in self._namespaces(rec)]
        return bound, offset, True, True

    def delete(self, batch: EventBatch) -> None:
        """Apply a ``delete`` batch."""
        ident = (batch.tier, batch.backend, None if batch.shared else batch.instance_id)
        own_l1 = batch.tier in VOLATILE_TIERS and not batch.shared
        for entry in batch.entries:
            found = self.locate(entry.key)
            if found is None:
                continue
            rec, k = found
            h = entry.key.chunk_hash
            old = placements_of(placements_at(rec, k))
            kept = [q for q in old if row_ident(q) != ident]
            if len(kept) == len(old):
                continue
            self._preserve(h, rec)
            for q in old:
                if row_ident(q) == ident:
                    self._count(q, -1)
            if not batch.shared:
                self._xor(batch.instance_id, batch.tier, h, record_keys(rec)[k][0], batch.backend)
            keys: list[tuple[int, Placements | None]] = list(record_keys(rec))
            keys[k] = (keys[k][0], pack_placements(kept))
            self._rewrite(h, rec, keys)
            if own_l1:
                self._forget_l1_if_gone(batch.instance_id, h)

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
            self._preserve(h, rec)
            new = [accessed_at(p, ts) if hit(p) else p for p in old]
            self.parts[h[0]][h] = with_placements_at(rec, k, group_placements(new))

    def fence(self, inst: str) -> int:
        """Drop every own L1 placement of ``inst``; returns how many were dropped."""
        dropped = 0
        counts = self.counts
        for h in counts.l1_chunks.pop(inst, ()):
            rec = self.parts[h[0]].get(h)
            if rec is None:
                continue
            self._preserve(h, rec)
            keys: list[tuple[int, Placements | None]] = []
            for sid, pls in record_keys(rec):
                kept = []
                for p in placements_of(pls):
                    if l1_owner(p) == inst:
                        self._count(p, -1)
                        dropped += 1
                    else:
                        kept.append(p)
                keys.append((sid, pack_placements(kept)))
            self._rewrite(h, rec, keys)
        counts.l1_placements.pop(inst, None)
        counts.digests.pop((inst, "l1"), None)
        return dropped

    def resync(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> int:
        """Apply a ``resync`` batch: the reporter's own placements on the batch's tier under
        its prefixes become exactly the listed ones (the others are removed, whatever their
        backend; the listed ones are stored). Returns how many placements were removed."""
        inst, tier, backend = batch.instance_id, batch.tier, batch.backend
        prefixes = batch.prefix_bytes
        listed: dict[bytes, set[int]] = {}
        for h, sid in zip(cols.chunk_hashes, sids, strict=True):
            listed.setdefault(h, set()).add(sid)

        def doomed(h: bytes, sid: int, p: PlacementRow) -> bool:
            if row_instance(p) != inst or row_tier(p) != tier or row_shared(p):
                return False
            return row_backend(p) != backend or sid not in listed.get(h, ())

        removed = 0
        for b in sorted({p[0] for p in prefixes}):
            part = self.parts[b]
            stale = [
                h
                for h, rec in part.items()
                if (h[:1] in prefixes or h[:2] in prefixes)
                and any(
                    doomed(h, sid, p) for sid, pls in record_keys(rec) for p in placements_of(pls)
                )
            ]
            for h in stale:
                removed += self._drop_where(h, part[h], doomed)
        self.store(batch, cols, sids)
        return removed

    def _drop_where(
        self, h: bytes, rec: Record, doomed: Callable[[bytes, int, PlacementRow], bool]
    ) -> int:
        """Remove the chunk's placements ``doomed(h, shape id, row)`` selects."""
        self._preserve(h, rec)
        keys: list[tuple[int, Placements | None]] = []
        owners: set[str] = set()
        dropped = 0
        for sid, pls in record_keys(rec):
            kept = []
            for p in placements_of(pls):
                if doomed(h, sid, p):
                    self._count(p, -1)
                    self._xor(row_instance(p), row_tier(p), h, sid, row_backend(p))
                    owner = l1_owner(p)
                    if owner is not None:
                        owners.add(owner)
                    dropped += 1
                else:
                    kept.append(p)
            keys.append((sid, pack_placements(kept)))
        self._rewrite(h, rec, keys)
        for owner in owners:
            self._forget_l1_if_gone(owner, h)
        return dropped

    def digest_of_prefix(self, inst: str, tier: str, prefix: bytes) -> list[int]:
        """The digest of ``inst``'s own placements on ``tier`` under a one-byte ``prefix``
        (computed from that partition: 1/256 of the directory)."""
        out = [0] * PARTS
        for h, rec in self.parts[prefix[0]].items():
            if not h.startswith(prefix):
                continue
            for sid, pls in record_keys(rec):
                for p in placements_of(pls):
                    if row_instance(p) == inst and row_tier(p) == tier and not row_shared(p):
                        out[h[1]] ^= element(h, self._tag(sid, tier, row_backend(p)))
        return out

    # ------------------------------------------------------------------ bookkeeping

    def _preserve(self, h: bytes, rec: Record | None) -> None:
        """Keep the capture-start record of a chunk about to change (if capturing)."""
        journal = self.journal
        if journal is not None:
            journal.save(h, rec)

    def _namespaces(self, rec: Record) -> set[BlendNamespace]:
        return self.shapes.namespaces(shape_ids(rec))

    def _count(self, p: PlacementRow, sign: int) -> None:
        counts = self.counts
        counts.placements += sign
        counts.bytes_by_tier[row_tier(p)] += sign * row_size(p)
        module = row_module(p)
        counts.module_placements[module] += sign
        counts.module_bytes[module] += sign * row_size(p)
        owner = l1_owner(p)
        if owner is not None:
            counts.l1_placements[owner] += sign

    def _rewrite(self, h: bytes, rec: Record, keys: list[tuple[int, Placements | None]]) -> None:
        """Set a chunk's keys (``None`` placements = key gone), keeping key counts, namespace
        claims and the chunk's existence in line. The caller has already preserved the chunk."""
        kept: list[KeyPair] = [(sid, pls) for sid, pls in keys if pls is not None]
        self.counts.keys -= len(keys) - len(kept)
        tokens, indexed = record_stored_tokens(rec), record_indexed(rec)
        if indexed and self.indexing and tokens is not None:
            left = self.shapes.namespaces([sid for sid, _ in kept])
            for ns in self._namespaces(rec) - left:
                self._ops.append(RemoveClaimOp(tokens, h, ns))
        part = self.parts[h[0]]
        if kept:
            part[h] = make_record(tokens, record_offset(rec), indexed, kept)
        else:
            del part[h]

    def _forget_l1_if_gone(self, inst: str, h: bytes) -> None:
        rec = self.parts[h[0]].get(h)
        if rec is not None:
            for pls in placement_groups(rec):
                for p in placements_of(pls):
                    if l1_owner(p) == inst:
                        return
        l1_chunks = self.counts.l1_chunks
        hs = l1_chunks.get(inst)
        if hs is not None:
            hs.discard(h)
            if not hs:
                del l1_chunks[inst]
