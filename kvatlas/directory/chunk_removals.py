"""Removal rules of the chunk table: ``delete`` batches, fencing an instance's L1, the
removal half of a ``resync``, and the bookkeeping every removal shares (counts, digests,
namespace claims, the capture's change journal; the chunks' L1 owners follow from their
records, :mod:`~kvatlas.directory.l1_owners`). See
:mod:`kvatlas.directory.chunk_table`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_not

import numpy as np

from kvatlas.directory.blend import RemoveClaimColumns, RemoveClaimOp
from kvatlas.directory.blend.kernels.objects import object_handles
from kvatlas.directory.chunk_counts import L2_TIER
from kvatlas.directory.chunk_digests import InventoryDigests
from kvatlas.directory.chunk_parts import l1_rows, remove_chunks
from kvatlas.directory.chunk_state import ChunkState
from kvatlas.directory.key_groups import key_groups
from kvatlas.directory.records import (
    KeyPair,
    PlacementRow,
    Placements,
    Record,
    group_placements,
    l1_owner,
    make_record,
    pack_placements,
    placements_at,
    placements_of,
    record_indexed,
    record_keys,
    record_offset,
    record_stored_tokens,
    row_backend,
    row_ident,
    row_instance,
    row_module,
    row_shared,
    row_size,
    row_tier,
)
from kvatlas.directory.tenant_bindings import Bindings, claim_ops, claims, salt_namespaces
from kvatlas.directory.token_store import StoredTokens
from kvatlas.events import UNKNOWN_OFFSET, VOLATILE_TIERS, EventBatch
from kvatlas.events.columns import EntryColumns, shape_index


class RemovalRules:
    """The removal rules of a chunk table (its collaborator: they change the table's
    records, counts and queued index writes, and the digests). No state of their own."""

    def __init__(self, table: ChunkState, digests: InventoryDigests) -> None:
        self._table = table
        self._digests = digests

    def delete(self, batch: EventBatch, cols: EntryColumns) -> None:
        """Apply a ``delete`` batch (its header; the entries are ``cols``): the chunks held
        under one key by columns (:meth:`_delete_plain`), the others entry by entry."""
        ident = (batch.tier, batch.backend, None if batch.shared else batch.instance_id)
        table = self._table
        hashes, sids = cols.chunk_hashes, table.shapes.ids_of_columns(cols)
        left: Sequence[int] = range(len(hashes))
        if table.journal is None:  # (a capture saves each record before it changes)
            left = self._delete_plain(batch, ident, hashes, sids)
        for i in left:
            self._delete_key(batch, ident, hashes[i], sids[i])

    def _delete_key(
        self, batch: EventBatch, ident: tuple[str, str, str | None], h: bytes, sid: int | None
    ) -> None:
        """Delete one entry: the copy ``ident`` of key (``h``, shape ``sid``), if held."""
        table = self._table
        found = table.locate(h, sid)
        if found is None or sid is None:
            return
        rec, k = found
        old = placements_of(placements_at(rec, k))
        kept = [q for q in old if row_ident(q) != ident]
        if len(kept) == len(old):
            return
        table.preserve(h, rec)
        for q in old:
            if row_ident(q) == ident:
                self._count(q, -1, sid)
        if not batch.shared:
            self._digests.xor(batch.instance_id, batch.tier, h, sid, batch.backend)
        keys: list[tuple[int, Placements | None]] = list(record_keys(rec))
        keys[k] = (keys[k][0], pack_placements(kept))
        self._rewrite(h, rec, keys)

    def _delete_plain(
        self,
        batch: EventBatch,
        ident: tuple[str, str, str | None],
        hashes: list[bytes],
        sids: list[int | None],
    ) -> list[int]:
        """Delete, by columns (no record built), the entries whose chunk is held under one
        key: grouped by that key's placements and shape (a stored batch's chunks share
        them), each group's kept placements computed and counted once; the chunks left
        without placements removed in bulk (:meth:`_remove_plain`). Entries of an absent
        chunk or key, and repeats of a chunk so deleted, change nothing. Returns the entries
        left to delete one by one (chunks under several keys), in order."""
        table = self._table
        kg = key_groups(table.parts, hashes, sids)
        if kg is None:
            return []
        held, rows = kg.held, kg.rows
        emptied: list[int] = []
        pending: dict[int, list[bytes]] = {}
        for (_, sid), group in kg.groups.items():
            old = placements_of(kg.placements(group))
            kept = [q for q in old if row_ident(q) != ident]
            if len(kept) == len(old):
                continue
            for q in old:
                if row_ident(q) == ident:
                    self._count(q, -len(group), sid)
            if not batch.shared:
                tag = self._digests.tag(sid, batch.tier, batch.backend)
                pending.setdefault(tag, []).extend(hashes[held[j]] for j in group)
            if kept:
                table.parts[0].cols.put_placements([rows[j] for j in group], group_placements(kept))
            else:
                emptied += group
        if pending:
            self._digests.xor_own(batch.instance_id, batch.tier, pending.items())
        if emptied:
            emptied.sort()
            tokens, flagged = kg.fields[:2]
            self._remove_plain(emptied, [hashes[i] for i in held], tokens, flagged)
        return kg.left

    def fence(self, inst: str) -> int:
        """Drop every own L1 placement of ``inst`` (its copies in process memory: any of the
        volatile tiers); returns how many were dropped."""
        dropped = 0
        table = self._table
        counts = table.counts
        if counts.l1_placements.get(inst):  # (else it has no chunks to visit)
            hashes, rows = l1_rows(table.parts, inst)
            if table.journal is None:  # (a capture saves each record before it changes)
                dropped, hashes = self._fence_plain(inst, hashes, rows)
            for h in hashes:
                dropped += self._fence_chunk(inst, h)
        counts.l1_placements.pop(inst, None)
        for tier in VOLATILE_TIERS:  # (its own copies on each: gone)
            counts.digests.pop((inst, tier), None)
        table.parts[0].cols.l1.release(inst)
        return dropped

    def _fence_chunk(self, inst: str, h: bytes) -> int:
        """Fence one chunk (any record): returns the placements dropped (the digests they
        were in go whole after the fence)."""
        rec = self._table.parts[h[0]][h]
        return self._drop_where(h, rec, lambda _h, _sid, p: l1_owner(p) == inst, digests=False)

    def _fence_plain(
        self, inst: str, hashes: list[bytes], rows: list[int]
    ) -> tuple[int, list[bytes]]:
        """Fence, by columns (no record built), the chunks of ``hashes`` (at ``rows``) with
        one key and no other L1 owner: grouped by their placements (a batch's chunks share
        them), each group counted once; the chunks left without placements removed in bulk,
        their index claims dropped as one :class:`RemoveClaimColumns`. Returns the
        placements dropped and the chunks left to fence one by one, in order."""
        cols = self._table.parts[0].cols
        owner = cols.l1.ids.get(inst)
        if owner is None or not rows:
            return 0, hashes
        n = len(rows)
        at = np.array(rows, np.intp)
        tokens, flagged, placements, rests = cols.fields(rows)
        plain = np.frombuffer(cols.l1.owner, np.int32)[at] == owner
        plain &= np.fromiter(map(len, rests), np.intp, n) == 0
        chosen = np.flatnonzero(plain)
        if not len(chosen):
            return 0, hashes
        group_of = object_handles(placements)[chosen]
        order = np.argsort(group_of, kind="stable")
        dropped = 0
        gone = []
        for group in np.split(chosen[order], np.flatnonzero(np.diff(group_of[order])) + 1):
            m = len(group)
            kept = []
            for p in placements_of(placements[group[0]]):
                if l1_owner(p) == inst:
                    self._count(p, -m, -1)  # (an L1 copy: no shape's L2 bytes change)
                    dropped += m
                else:
                    kept.append(p)
            if kept:
                cols.put_placements(at[group].tolist(), group_placements(kept))
            else:
                gone.append(group)
        if gone:
            emptied = np.sort(np.concatenate(gone)).tolist()
            self._remove_plain(emptied, hashes, tokens, flagged)
        return dropped, list(compress(hashes, (~plain).tolist()))

    def _remove_plain(
        self,
        emptied: list[int],
        hashes: list[bytes],
        tokens: Sequence[StoredTokens | None],
        flagged: Sequence[int],
    ) -> None:
        """Remove chunks ``hashes[i]`` (one key each, now without placements; their
        content ``tokens[i]``, ``2 * shape id + indexed`` ``flagged[i]``)
        for each ``i`` of ``emptied``."""
        table = self._table
        gone = [hashes[i] for i in emptied]
        table.counts.keys -= len(emptied)
        if table.indexing:
            contents = [tokens[i] for i in emptied]
            flags = np.array([flagged[i] for i in emptied], np.int64)
            known = np.fromiter(map(is_not, contents, repeat(None)), np.bool_, len(contents))
            claimed = np.flatnonzero(known & (flags & 1 == 1)).tolist()
            if claimed:
                sids, which = shape_index((flags[claimed] >> 1).tolist())
                table.queue([RemoveClaimColumns(
                    [contents[i] for i in claimed],
                    claimed_hashes := [gone[i] for i in claimed],
                    [table.shapes[s].namespace for s in sids],
                    which,
                    vouched=set(map(type, claimed_hashes)) == {bytes},
                )])  # fmt: skip
        remove_chunks(table.parts, gone)

    def drop_unlisted(self, batch: EventBatch, cols: EntryColumns, sids: list[int]) -> int:
        """The removal half of a ``resync`` batch: remove the reporter's own placements on
        the batch's tier under its prefixes that the batch does not list (whatever their
        backend) or lists under another backend. Returns how many were removed."""
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
            part = self._table.parts[b]
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
        return removed

    def _drop_where(
        self,
        h: bytes,
        rec: Record,
        doomed: Callable[[bytes, int, PlacementRow], bool],
        digests: bool = True,
    ) -> int:
        """Remove the chunk's placements ``doomed(h, shape id, row)`` selects (from their
        digests too, unless ``digests`` is false); returns how many."""
        self._table.preserve(h, rec)
        keys: list[tuple[int, Placements | None]] = []
        dropped = 0
        for sid, pls in record_keys(rec):
            kept = []
            for p in placements_of(pls):
                if doomed(h, sid, p):
                    self._count(p, -1, sid)
                    if digests:
                        self._digests.xor(row_instance(p), row_tier(p), h, sid, row_backend(p))
                    dropped += 1
                else:
                    kept.append(p)
            keys.append((sid, pack_placements(kept)))
        self._rewrite(h, rec, keys)
        return dropped

    def _count(self, p: PlacementRow, sign: int, sid: int) -> None:
        counts = self._table.counts
        counts.placements += sign
        counts.bytes_by_tier[row_tier(p)] += sign * row_size(p)
        if row_tier(p) == L2_TIER:
            counts.l2_bytes_by_shape[sid] += sign * row_size(p)
        module = row_module(p)
        counts.module_placements[module] += sign
        counts.module_bytes[module] += sign * row_size(p)
        owner = l1_owner(p)
        if owner is not None:
            counts.l1_placements[owner] += sign

    def _rewrite(self, h: bytes, rec: Record, keys: list[tuple[int, Placements | None]]) -> None:
        """Set a chunk's keys (``None`` placements = key gone), keeping key counts, namespace
        claims and the chunk's existence in line. The caller has already preserved the chunk."""
        table = self._table
        kept: list[KeyPair] = [(sid, pls) for sid, pls in keys if pls is not None]
        table.counts.keys -= len(keys) - len(kept)
        bindings = table.tenants.rows.get(h)
        if bindings is not None:
            _rewrite_tenant(table, h, rec, kept, bindings)
            return
        tokens, indexed = record_stored_tokens(rec), record_indexed(rec)
        if indexed and table.indexing and tokens is not None:
            left = table.shapes.namespaces([sid for sid, _ in kept])
            table.queue([RemoveClaimOp(tokens, h, ns) for ns in table.namespaces(rec) - left])
        part = table.parts[h[0]]
        if kept:
            part[h] = make_record(tokens, record_offset(rec), indexed, kept)
        else:
            del part[h]


def _rewrite_tenant(
    table: ChunkState, h: bytes, rec: Record, kept: list[KeyPair], bindings: Bindings
) -> None:
    """:meth:`RemovalRules._rewrite` of a chunk of several salts (its keys ``rec``'s, then
    ``kept``): a salt without keys left loses its binding, and a chunk back to one salt gets
    that salt's binding into its record (directory/tenant_bindings.py)."""
    shapes, part, tenants, size = table.shapes, table.parts[h[0]], table.tenants, table.chunk_size
    before = tenants.claims(h, shapes, rec, bindings, size) if table.indexing else set()
    new = make_record(None, UNKNOWN_OFFSET, False, kept)
    salts = salt_namespaces(shapes, new)
    left = {salt: b for salt, b in bindings.items() if salt in salts}
    if len(salts) > 1:
        after = tenants.claims(h, shapes, new, left, size) if table.indexing else set()
        table.queue(claim_ops(before, after))
        tenants.leave(h, [salt for salt in bindings if salt not in left])
        tenants.rows[h] = left
        part[h] = new
        return
    # back to one salt (or none): its binding indexed under the chunk hash itself again
    after = claims(shapes, new, left, lambda _: h, size) if table.indexing and kept else set()
    table.queue(claim_ops(before, after))
    tenants.leave(h, list(bindings))
    del tenants.rows[h]
    if not kept:
        del part[h]
        return
    own = left.get(next(iter(salts)))
    part[h] = new if own is None else make_record(*own, bool(after), kept)
