"""Store rules of the chunk table: a ``store`` batch (and the store half of a ``resync``),
in bulk when every entry is a new chunk (:mod:`~kvatlas.directory.fresh_chunks`), else entry
by entry (storing into a known chunk and binding its content:
:mod:`~kvatlas.directory.chunk_binding`), with the blend-index writes that follow, queued in
the order the changes happened. See :mod:`kvatlas.directory.chunk_table`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from kvatlas.directory.chunk_binding import keeps_binding, store_existing
from kvatlas.directory.chunk_counts import L2_TIER, DigestArray
from kvatlas.directory.chunk_digests import InventoryDigests
from kvatlas.directory.chunk_state import ChunkState
from kvatlas.directory.fresh_chunks import fresh_kind, store_adds, store_fresh
from kvatlas.directory.key_groups import key_groups
from kvatlas.directory.records import (
    PlacementRow,
    group_placements,
    placement_row,
    placements_of,
    row_ident,
    row_size,
)
from kvatlas.directory.token_store import StoredTokens, stored_columns, stored_equal, token_count
from kvatlas.events import UNKNOWN_OFFSET, VOLATILE_TIERS, EventBatch
from kvatlas.events.columns import EntryColumns

log = logging.getLogger(__name__)


class StoreRules:
    """The store rules of a chunk table (its collaborator: they change the table's records,
    counts and queued index writes, and the digests). No state of their own."""

    def __init__(self, table: ChunkState, digests: InventoryDigests) -> None:
        self._table = table
        self._digests = digests

    def store(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> None:
        """Apply a ``store`` batch (its header; the entries are ``cols``); ``sids`` are the
        entries' interned shape ids."""
        if not len(cols):
            return
        table = self._table
        inst, tier, shared = batch.instance_id, batch.tier, batch.shared
        counts = table.counts
        # New own copies, by tag multiplier: their elements go into the digest after the loop,
        # in one vectorised step per multiplier (a batch is mostly one shape).
        dig = None if shared else counts.digest_for(inst, tier)
        pending: dict[int, list[bytes]] = {}
        stored = stored_columns(cols)  # compact, one pass per batch
        fresh = None
        if table.journal is None:  # (a capture saves each record before its first change)
            fresh = store_fresh(
                table.parts, [(batch, len(cols))], cols, sids, stored, table.chunk_size,
                table.indexing,
            )  # fmt: skip
        if fresh is not None:  # every entry a new chunk: stored in bulk
            n_keys = n_pl = len(cols)
            n_bytes = self._fresh_stored(batch, cols, sids, stored, fresh, dig, pending)
        else:  # re-stores of chunks held under one key by columns, the rest entry by entry
            # (L2 bytes per shape: a batch of one shape, the usual, adds its total once in
            # ``_count``; a mixed one is counted entry by entry)
            one_shape = sids.count(sids[0]) == len(sids)
            mixed = counts.l2_bytes_by_shape if tier == L2_TIER and not one_shape else None
            left: Sequence[int] = range(len(cols))
            plain_pl = plain_bytes = 0
            made: dict[int, PlacementRow] = {}  # the batch's placement rows, one a size
            if table.journal is None:
                own = None if dig is None else pending
                left, plain_pl, plain_bytes = self._store_plain(
                    batch, cols, sids, stored, own, mixed, made
                )
            n_keys, n_pl, n_bytes = self._store_each(
                batch, cols, sids, stored, dig, pending, mixed, left, made
            )
            n_pl += plain_pl
            n_bytes += plain_bytes
        self._count(batch, sids, n_keys, n_pl, n_bytes, dig, pending)

    def store_run(
        self, batches: Sequence[tuple[EventBatch, int]], cols: EntryColumns, sids: list[int]
    ) -> bool:
        """Store a run of ``store`` batches (:mod:`~kvatlas.directory.store_runs`: one
        emitter's, one after another, of one tier and backend; each with its count of
        entries, ``cols`` their entries end to end, ``sids`` their shape ids) in one bulk
        store when every entry is a new chunk, exactly as :meth:`store` of each in turn
        would; ``False``, having changed nothing, when not (the caller then stores them one
        by one)."""
        table = self._table
        if table.journal is not None or not fresh_kind(table.parts, cols, sids, table.chunk_size):
            return False
        stored = stored_columns(cols)
        fresh = store_fresh(
            table.parts, batches, cols, sids, stored, table.chunk_size, table.indexing
        )
        if fresh is None:
            return False
        first = batches[0][0]
        dig = None if first.shared else table.counts.digest_for(first.instance_id, first.tier)
        pending: dict[int, list[bytes]] = {}
        n_bytes = self._fresh_stored(first, cols, sids, stored, fresh, dig, pending)
        self._count(first, sids, len(cols), len(cols), n_bytes, dig, pending)
        return True

    def _fresh_stored(
        self,
        batch: EventBatch,
        cols: EntryColumns,
        sids: list[int],
        stored: list[StoredTokens | None],
        fresh: tuple[int, list[int]],
        dig: DigestArray | None,
        pending: dict[int, list[bytes]],
    ) -> int:
        """After a bulk store (``fresh``: its bytes and the entries to index): the index adds
        queued, the new own copies' hashes in ``pending`` (if ``dig``); returns the bytes."""
        n_bytes, added = fresh
        table = self._table
        if added:
            table.ops.append(store_adds(added, cols, stored, sids, table.shapes.shapes))
        if dig is not None:
            pending[self._digests.tag(sids[0], batch.tier, batch.backend)] = cols.chunk_hashes
        return n_bytes

    def _count(
        self,
        batch: EventBatch,
        sids: list[int],
        n_keys: int,
        n_pl: int,
        n_bytes: int,
        dig: DigestArray | None,
        pending: dict[int, list[bytes]],
    ) -> None:
        """The counters and digests after a store in ``batch``'s place (its instance, tier,
        backend, sharing) added ``n_keys`` keys, ``n_pl`` placements and ``n_bytes``."""
        counts = self._table.counts
        inst, tier, backend, shared = batch.instance_id, batch.tier, batch.backend, batch.shared
        if tier == L2_TIER and sids.count(sids[0]) == len(sids):
            counts.l2_bytes_by_shape[sids[0]] += n_bytes
        if dig is not None:
            self._digests.xor_many(dig, pending.items())
        counts.keys += n_keys
        counts.placements += n_pl
        counts.bytes_by_tier[tier] += n_bytes
        module = (None if shared else inst, tier, backend)
        counts.module_placements[module] += n_pl
        counts.module_bytes[module] += n_bytes
        if tier in VOLATILE_TIERS and not shared:  # own L1 copies
            counts.l1_placements[inst] += n_pl

    def _store_each(
        self,
        batch: EventBatch,
        cols: EntryColumns,
        sids: list[int],
        stored: list[StoredTokens | None],
        dig: DigestArray | None,
        pending: dict[int, list[bytes]],
        l2_by_shape: Counter[int] | None,
        which: Sequence[int],
        by_size: dict[int, PlacementRow],
    ) -> tuple[int, int, int]:
        """:meth:`store`, entry by entry (any entries ``which`` of the batch, in order);
        returns the (keys, placements, bytes) added. New own copies' hashes go to ``pending``
        by tag multiplier (if ``dig``); the bytes added per shape to ``l2_by_shape`` (an L2
        batch of several shapes); the batch's placement rows by size to ``by_size``."""
        inst, inc, tier, backend = batch.instance_id, batch.incarnation, batch.tier, batch.backend
        shared, ts = batch.shared, batch.ts
        table = self._table
        parts = table.parts
        journal = table.journal
        indexing = table.indexing
        ops = table.ops
        shapes = table.shapes.shapes
        chunk_size = table.chunk_size
        debug = log.isEnabledFor(logging.DEBUG)
        new_own: list[bytes] | None = None
        tag_sid = -1
        tag = self._digests.tag
        # Every placement added or replaced here has this batch's tier and (for own copies)
        # instance: the counters move by one sum per batch instead of per entry.
        n_keys = n_pl = n_bytes = 0
        added: list[int] = []  # entries whose new chunk is indexed: one AddColumns for all
        hashes, sizes, offsets = (
            cols.chunk_hashes,
            cols.size_bytes.tolist(),
            cols.token_offsets.tolist(),
        )
        for j in which:
            h, sid, size, tokens, offset = hashes[j], sids[j], sizes[j], stored[j], offsets[j]
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
                dk, dp, db = store_existing(table, h, part, rec, sid, p, tokens, offset, debug)
                if added and len(ops) > queued:  # the adds so far go first, as they happened
                    ops.insert(queued, store_adds(added, cols, stored, sids, shapes))
                    added = []
                n_keys += dk
                n_pl += dp
                n_bytes += db
                if l2_by_shape is not None:
                    l2_by_shape[sid] += db
                if new_own is not None and dp:  # a new own copy (a replaced one has the
                    new_own.append(h)  # same element)
        if added:
            ops.append(store_adds(added, cols, stored, sids, shapes))
        return n_keys, n_pl, n_bytes

    def _store_plain(
        self,
        batch: EventBatch,
        cols: EntryColumns,
        sids: list[int],
        stored: list[StoredTokens | None],
        pending: dict[int, list[bytes]] | None,
        l2_by_shape: Counter[int] | None,
        by_size: dict[int, PlacementRow],
    ) -> tuple[Sequence[int], int, int]:
        """Store, by columns, the entries that add or replace a copy of the one key their
        chunk is held under, its content unchanged (the usual re-store: a copy on another
        tier, another instance's, a report repeated): grouped by that key's placements value
        and the entry's size, each group's placements made once and set on its rows, no
        record built. Returns the entries left to :meth:`_store_each` (in order) and the
        (placements, bytes) added; new own copies' hashes go to ``pending`` (if given). The
        batch's placement row of each size is taken from ``by_size`` (or made into it): the
        entry-by-entry path shares them, as a snapshot stores each row once."""
        table = self._table
        kg = key_groups(table.parts, cols.chunk_hashes, sids, keep_rest=True)
        if kg is None or not kg.groups:
            return range(len(cols)), 0, 0
        b = batch
        held, rows, (contents, flagged, _, _) = kg.held, kg.rows, kg.fields
        sizes, offsets = cols.size_bytes.tolist(), cols.token_offsets.tolist()
        at, indexing = table.parts[0].cols.offsets, table.indexing
        sized: dict[tuple[tuple[int, int], int], list[int]] = {}
        rebinding: list[int] = []  # entries that would (re)bind content: left
        for g, group in kg.groups.items():
            for j in group:
                i, new = held[j], stored[held[j]]
                old = contents[j]
                if new is not None and not (
                    old is not None
                    and stored_equal(old, new)
                    and keeps_binding(offsets[i], at[rows[j]], flagged[j] & 1 == 1, indexing)
                ):
                    rebinding.append(i)
                else:
                    sized.setdefault((g, sizes[i]), []).append(j)
        n_pl = n_bytes = 0
        for ((_, sid), size), group in sized.items():
            p = by_size.get(size)
            if p is None:
                p = by_size[size] = placement_row(
                    b.instance_id, b.incarnation, b.tier, b.backend, size, b.shared, b.ts
                )
            ident = row_ident(p)
            old = placements_of(kg.placements(group))
            kept = [q for q in old if row_ident(q) != ident]
            table.parts[0].cols.put_placements(
                [rows[j] for j in group], group_placements([*kept, p])
            )
            dp = 1 - (len(old) - len(kept))  # 0: a copy replaced (the same digest element)
            db = size - sum(row_size(q) for q in old if row_ident(q) == ident)
            n_pl += dp * len(group)
            n_bytes += db * len(group)
            if l2_by_shape is not None:
                l2_by_shape[sid] += db * len(group)
            if pending is not None and dp:
                tag = self._digests.tag(sid, b.tier, b.backend)
                pending.setdefault(tag, []).extend(cols.chunk_hashes[held[j]] for j in group)
        return sorted(kg.left + rebinding) if rebinding else kg.left, n_pl, n_bytes
