"""KeyDirectory: which instance/tier holds every key, plus the token bindings behind blend lookup.

The directory is the single source of truth: events enter through the ingest gate, placements
and token bindings follow them, and the blend index (when enabled) follows the bindings — never
the other way round.

Locking: one directory lock covers placements, bindings and the gate; the index has its own.
The only order is directory → index (the directory calls the index while holding its lock; the
index never calls back), and :meth:`KeyDirectory.blend_match` takes only the index lock, so a
fragment query never waits behind event application.

State is partitioned into 256 dicts by the first byte of the chunk hash: a listing page sorts
one small partition instead of the whole directory, and a snapshot copies one partition at a
time (see :mod:`kvatlas.directory.snapshot`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvatlas.directory.blend import (
    AddOp,
    BlendIndex,
    BlendOp,
    RemoveChunkOp,
    RemoveClaimOp,
)
from kvatlas.directory.gate import Admission, EmitterCursor, IngestGate, Outcome
from kvatlas.directory.records import (
    INDEXED,
    KEYS,
    OFFSET,
    TOKENS,
    CapacityDeclaration,
    KeyPage,
    KeyPlacements,
    KeyShape,
    Placement,
    PlacementRow,
    Placements,
    Record,
    TokenLookup,
    pack_placements,
    placements_of,
    prefix_summary,
    row_ident,
)
from kvatlas.events import ACCESS, CONFIG, DELETE, STORE, UNKNOWN_OFFSET, CacheEntry, EventBatch
from kvatlas.events.model import tokens_equal
from kvatlas.keys import (
    DEFAULT_CHUNK_SIZE,
    BlendMatch,
    BlendNamespace,
    ObjectKey,
    as_token_array,
    chunk_hashes,
    expand_prefix_keys,
)
from kvatlas.keys.tokens import TokenArray

log = logging.getLogger(__name__)

PARTS = 256
KeyTuple = tuple[Any, ...]  # flat (shape id, Placements, shape id, Placements, ...)
SavedChunk = Record  # a record is immutable: the saved state is the record itself
HashChunks = Callable[[Any, int], list[bytes]]
ShapeParts = tuple[str, int, int, str]


@dataclass(frozen=True, slots=True)
class IngestCounts:
    """The ``POST /events`` reply."""

    applied: int = 0
    duplicates: int = 0
    stale: int = 0


class _CowJournal:
    """Copy-on-write record of a snapshot in progress.

    Before the first change to a chunk whose partition has not been captured yet, its record at
    snapshot start is saved here (``None`` = it did not exist). Capturing a partition therefore
    yields exactly the snapshot-start state, however long the capture of the others takes.
    """

    __slots__ = ("done", "saved")

    def __init__(self) -> None:
        self.done = [False] * PARTS
        self.saved: list[dict[bytes, SavedChunk | None]] = [{} for _ in range(PARTS)]

    def save(self, h: bytes, rec: Record | None) -> None:
        p = h[0]
        if not self.done[p]:
            saved = self.saved[p]
            if h not in saved:
                saved[h] = rec


@dataclass(slots=True)
class RestoredCounts:
    """Derived state of restored chunks: counters and per-instance L1 chunk sets."""

    keys: int
    placements: int
    l1_placements: Counter[str]
    bytes_by_tier: Counter[str]
    l1_chunks: dict[str, set[bytes]]

    @classmethod
    def scan(cls, parts: list[dict[bytes, Record]]) -> RestoredCounts:
        out = cls(0, 0, Counter(), Counter(), {})
        for part in parts:
            for h, rec in part.items():
                out.keys += (len(rec) - KEYS) >> 1
                for pls in rec[KEYS + 1 :: 2]:
                    for p in placements_of(pls):
                        out.placements += 1
                        out.bytes_by_tier[p[2]] += p[4]
                        if p[2] == "l1" and not p[5]:
                            out.l1_placements[p[0]] += 1
                            out.l1_chunks.setdefault(p[0], set()).add(h)
        return out


@dataclass(frozen=True, slots=True)
class DirectoryState:
    """Everything a snapshot holds besides the chunks (small, copied under the lock).

    ``shapes`` is the directory's shape table (append-only: every shape id a captured record
    holds indexes it, also when read after the lock is released)."""

    chunk_size: int
    cursors: dict[str, EmitterCursor]
    capacities: dict[str, CapacityDeclaration]
    shapes: list[KeyShape] = field(default_factory=list)


class KeyDirectory:
    """ObjectKey → placements, chunk hash → token binding, fed by gated event batches."""

    def __init__(
        self,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        enable_blend_lookup: bool = False,
        blend_probe_stride: int = 1,
        hash_chunks: HashChunks = chunk_hashes,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self._hash_chunks = hash_chunks
        self._lock = threading.Lock()
        self._gate = IngestGate()
        self._parts: list[dict[bytes, Record]] = [{} for _ in range(PARTS)]
        self._shapes: dict[ShapeParts, int] = {}  # interned shapes: parts -> shape id
        self._shape_list: list[KeyShape] = []  # shape id -> shape (append-only)
        self._l1_chunks: dict[str, set[bytes]] = {}  # instance -> chunks with its own L1 copies
        self._capacities: dict[str, CapacityDeclaration] = {}
        self._index: BlendIndex | None = None
        self._index_ops: list[BlendOp] = []  # index writes of the operation in progress
        self._probe_stride = 1
        self._cow: _CowJournal | None = None
        self._n_keys = 0
        self._n_placements = 0
        self._l1_placements: Counter[str] = Counter()
        self._bytes_by_tier: Counter[str] = Counter()
        self._outcomes: Counter[str] = Counter()
        if enable_blend_lookup:
            self.enable_blend_lookup(chunk_size, blend_probe_stride)

    # ------------------------------------------------------------------ configuration

    @property
    def blend_enabled(self) -> bool:
        return self._index is not None

    def enable_blend_lookup(self, chunk_size: int | None = None, probe_stride: int = 1) -> None:
        """Start indexing content from now on (not retroactive: older chunks stay unindexed
        until a later token-bearing store, or a restore with blend on, binds them again)."""
        size = self.chunk_size if chunk_size is None else chunk_size
        if size != self.chunk_size:
            raise ValueError(f"blend chunk_size {size} != directory chunk_size {self.chunk_size}")
        with self._lock:
            if self._index is None:
                self._index = BlendIndex(self.chunk_size, probe_stride)
                self._probe_stride = probe_stride

    # ------------------------------------------------------------------ ingestion

    def consume(self, batch: EventBatch) -> Outcome:
        """Apply one batch through the gate: entirely or not at all."""
        if not isinstance(batch, EventBatch):
            raise TypeError(f"expected EventBatch, got {type(batch).__name__}")
        with self._lock:
            admission = self._gate.admit(batch)
            self._outcomes[admission.outcome] += 1
            if admission.outcome is Outcome.APPLIED:
                try:
                    self._apply_admitted(batch, admission)
                finally:
                    self._flush_index()
            return admission.outcome

    def consume_many(self, batches: Iterable[EventBatch]) -> IngestCounts:
        counts: Counter[Outcome] = Counter(self.consume(b) for b in batches)
        return IngestCounts(
            counts[Outcome.APPLIED], counts[Outcome.DUPLICATE], counts[Outcome.STALE]
        )

    def fence_instance(self, instance_id: str) -> int:
        """Drop every L1 placement ``instance_id`` reported (its process memory is gone);
        L2 and shared placements survive. Returns the number of placements dropped."""
        with self._lock:
            try:
                return self._fence_locked(instance_id)
            finally:
                self._flush_index()

    def deregister(self, instance_id: str) -> int:
        """Fence the instance and forget its cursor and capacity declaration."""
        with self._lock:
            try:
                dropped = self._fence_locked(instance_id)
            finally:
                self._flush_index()
            self._gate.forget(instance_id)
            self._capacities.pop(instance_id, None)
            return dropped

    def _apply_admitted(self, batch: EventBatch, admission: Admission) -> None:
        # Everything below operates on a validated batch and cannot fail halfway: shapes are
        # resolved first, and placement/binding updates raise on nothing valid input can hold.
        kind = batch.event_type
        sids = self._sids(batch) if kind == STORE else None
        if admission.fence_first:
            self._fence_locked(batch.instance_id)
        if kind == STORE:
            assert sids is not None
            self._apply_store(batch, sids)
        elif kind == DELETE:
            self._apply_delete(batch)
        elif kind == ACCESS:
            self._apply_access(batch)
        elif kind == CONFIG:
            self._apply_config(batch)
        self._gate.commit(batch, admission)

    def _flush_index(self) -> None:
        """Apply the index writes collected while applying one batch (or fence), in order, as
        one index batch: one index lock hold and one compiled call instead of one per write.
        Still under the directory lock, so the order directory → index is unchanged; a
        concurrent ``blend_match`` sees the index before or after the whole batch, never
        half of it (in particular never between a ``remove_chunk`` and its re-``add``s)."""
        ops = self._index_ops
        if ops:
            self._index_ops = []
            index = self._index
            if index is not None:
                index.apply(ops)

    def _sids(self, batch: EventBatch) -> list[int]:
        """Interned shape id of every entry's key (new shapes are interned)."""
        get = self._shapes.get
        sids = []
        last: ShapeParts | None = None
        sid: int | None = -1
        for entry in batch.entries:
            k = entry.key
            parts = (k.model_name, k.kv_rank, k.object_group_id, k.cache_salt)
            if parts != last:  # a batch is mostly one shape: skip the lookup for repeats
                sid = get(parts)
                if sid is None:
                    sid = self._intern(k)
                last = parts
            sids.append(sid)
        return sids  # type: ignore[return-value]

    def _intern(self, key: ObjectKey) -> int:
        parts = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        sid = self._shapes.get(parts)
        if sid is None:
            ns = BlendNamespace(key.model_name, key.cache_salt, key.world_size)
            sid = self._shapes[parts] = len(self._shape_list)
            self._shape_list.append(KeyShape(*parts, ns))
        return sid

    def _sid_of(self, key: ObjectKey) -> int | None:
        """The key's shape id, ``None`` if no key of that shape was ever stored."""
        return self._shapes.get((key.model_name, key.kv_rank, key.object_group_id, key.cache_salt))

    def _locate(self, key: ObjectKey) -> tuple[Record, int] | None:
        """The key's chunk record and the index of the key's placements in it (if stored)."""
        h = key.chunk_hash
        rec = self._parts[h[0]].get(h)
        if rec is None:
            return None
        sid = self._sid_of(key)
        i = -1 if sid is None else _find(rec[KEYS:], sid)
        return None if i < 0 else (rec, KEYS + i + 1)

    def _namespaces(self, keys: KeyTuple) -> set[BlendNamespace]:
        shapes = self._shape_list
        if len(keys) == 2:
            return {shapes[keys[0]].namespace}
        return {shapes[s].namespace for s in keys[0::2]}

    def _touch(self, h: bytes, rec: Record | None) -> None:
        cow = self._cow
        if cow is not None:
            cow.save(h, rec)

    def _count(self, p: PlacementRow, sign: int) -> None:
        self._n_placements += sign
        self._bytes_by_tier[p[2]] += sign * p[4]
        if p[2] == "l1" and not p[5]:
            self._l1_placements[p[0]] += sign

    def _apply_store(self, batch: EventBatch, sids: list[int]) -> None:
        entries = batch.entries
        if not entries:
            return
        inst, inc, tier, backend = batch.instance_id, batch.incarnation, batch.tier, batch.backend
        shared, ts = batch.shared, batch.ts
        own_l1 = tier == "l1" and not shared
        l1set: set[bytes] | None = None
        if own_l1:
            l1set = self._l1_chunks.get(inst)
            if l1set is None:
                l1set = self._l1_chunks[inst] = set()
        by_size: dict[int, PlacementRow] = {}
        parts = self._parts
        cow = self._cow
        index = self._index
        ops = self._index_ops
        shapes = self._shape_list
        chunk_size = self.chunk_size
        debug = log.isEnabledFor(logging.DEBUG)
        # Every placement added or replaced here has this batch's tier and (for own copies)
        # instance: the counters move by one sum per batch instead of per entry.
        n_keys = n_pl = n_bytes = 0
        for entry, sid in zip(entries, sids, strict=True):
            size = entry.size_bytes
            p = by_size.get(size)
            if p is None:
                p = by_size[size] = (inst, inc, tier, backend, size, shared, ts)
            h = entry.key.chunk_hash
            part = parts[h[0]]
            rec = part.get(h)
            if cow is not None:
                cow.save(h, rec)
            if rec is None:  # a new chunk: the common case, without the general bookkeeping
                n_keys += 1
                n_pl += 1
                n_bytes += size
                tokens = entry.token_ids
                offset = entry.token_offset
                if tokens is None:
                    part[h] = (None, UNKNOWN_OFFSET, False, sid, p)
                    if debug:
                        log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
                elif len(tokens) != chunk_size:
                    log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), len(tokens))
                    part[h] = (tokens, offset, False, sid, p)
                elif index is None or offset == UNKNOWN_OFFSET:
                    part[h] = (tokens, offset, False, sid, p)
                else:
                    part[h] = (tokens, offset, True, sid, p)
                    ops.append(AddOp(tokens, h, offset, shapes[sid].namespace))
            else:
                dk, dp, db = self._store_existing(h, part, rec, sid, p, entry, debug)
                n_keys += dk
                n_pl += dp
                n_bytes += db
            if l1set is not None:
                l1set.add(h)
        self._n_keys += n_keys
        self._n_placements += n_pl
        self._bytes_by_tier[tier] += n_bytes
        if own_l1:
            self._l1_placements[inst] += n_pl

    def _store_existing(
        self,
        h: bytes,
        part: dict[bytes, Record],
        rec: Record,
        sid: int,
        p: PlacementRow,
        entry: CacheEntry,
        debug: bool,
    ) -> tuple[int, int, int]:
        """Store into a known chunk; returns the (keys, placements, bytes) deltas."""
        ident = row_ident(p)
        keys = rec[KEYS:]
        i = _find(keys, sid)
        tokens, offset, indexed = rec[TOKENS], rec[OFFSET], rec[INDEXED]
        new_claim = False
        if i < 0:
            new_claim = indexed and self._shape_list[sid].namespace not in self._namespaces(keys)
            keys = (*keys, sid, p)
            dk, dp, db = 1, 1, p[4]
        else:
            old = placements_of(keys[i + 1])
            kept = []
            dk, dp, db = 0, 1, p[4]
            for q in old:
                if row_ident(q) == ident:
                    dp -= 1
                    db -= q[4]
                else:
                    kept.append(q)
            kept.append(p)
            keys = (*keys[: i + 1], pack_placements(kept), *keys[i + 2 :])
        reindexed = False
        if entry.token_ids is not None:
            tokens, offset, indexed, reindexed = self._bind(
                h, tokens, offset, indexed, keys, entry.token_ids, entry.token_offset
            )
        elif tokens is None and debug:
            log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
        if new_claim and not reindexed and indexed and self._index is not None:
            assert tokens is not None
            ns = self._shape_list[sid].namespace
            self._index_ops.append(AddOp(tokens, h, offset, ns))
        part[h] = (tokens, offset, indexed, *keys)
        return dk, dp, db

    def _indexable(self, tokens: TokenArray | None, offset: int) -> bool:
        # offset -1 is never indexed: a match without its stored position would be re-RoPEd
        # from the wrong place, i.e. wrong KV, which is worse than a miss.
        return tokens is not None and offset != UNKNOWN_OFFSET and len(tokens) == self.chunk_size

    def _bind(
        self,
        h: bytes,
        old: TokenArray | None,
        old_offset: int,
        indexed: bool,
        keys: KeyTuple,
        tokens: TokenArray,
        offset: int,
    ) -> tuple[TokenArray | None, int, bool, bool]:
        """Bind ``tokens`` to the chunk and bring the index in line. Returns the chunk's new
        ``(tokens, token_offset, indexed)`` and whether it (re)added every namespace."""
        index = self._index
        if old is not None and tokens_equal(old, tokens):
            if offset in (UNKNOWN_OFFSET, old_offset):
                if indexed or index is None:
                    return old, old_offset, indexed, False
                # bound before blend was on: this fresh report of the content indexes it
                offset = old_offset
            bound = old
        else:
            if indexed and index is not None and old is not None:
                # Retire the old content before the new one appears: no window in which a match
                # returns new content at the old position (both go in one index batch).
                self._index_ops.append(RemoveChunkOp(old, h))
            indexed = False
            bound = tokens
            if len(tokens) != self.chunk_size:
                log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), len(tokens))
        if index is None or not self._indexable(bound, offset):
            return bound, offset, indexed, False
        self._index_ops += [AddOp(bound, h, offset, ns) for ns in self._namespaces(keys)]
        return bound, offset, True, True

    def _apply_delete(self, batch: EventBatch) -> None:
        ident = (batch.tier, batch.backend, None if batch.shared else batch.instance_id)
        own_l1 = batch.tier == "l1" and not batch.shared
        for entry in batch.entries:
            found = self._locate(entry.key)
            if found is None:
                continue
            rec, j = found
            h = entry.key.chunk_hash
            old = placements_of(rec[j])
            kept = [q for q in old if row_ident(q) != ident]
            if len(kept) == len(old):
                continue
            self._touch(h, rec)
            for q in old:
                if row_ident(q) == ident:
                    self._count(q, -1)
            new = list(rec[KEYS:])
            new[j - KEYS] = pack_placements(kept)
            self._rewrite(h, rec, new)
            if own_l1:
                self._forget_l1_if_gone(batch.instance_id, h)

    def _apply_access(self, batch: EventBatch) -> None:
        tier, backend, ts = batch.tier, batch.backend, batch.ts

        def hit(p: PlacementRow) -> bool:
            if p[2] != tier or (backend and p[3] != backend) or p[6] >= ts:
                return False
            return p[5] if batch.shared else (not p[5] and p[0] == batch.instance_id)

        for entry in batch.entries:
            found = self._locate(entry.key)
            if found is None:
                continue
            rec, j = found
            h = entry.key.chunk_hash
            part = self._parts[h[0]]
            old = placements_of(rec[j])
            if not any(hit(p) for p in old):
                continue
            self._touch(h, rec)
            new = [(*p[:6], ts) if hit(p) else p for p in old]
            part[h] = (*rec[:j], pack_placements(new), *rec[j + 1 :])  # type: ignore[arg-type]

    def _apply_config(self, batch: EventBatch) -> None:
        assert batch.capacity_bytes is not None and batch.capacity_revision is not None
        version = (batch.incarnation, batch.capacity_revision)
        cur = self._capacities.get(batch.instance_id)
        where = (batch.tier, batch.backend)
        if cur is None or version > (cur.incarnation, cur.revision):
            caps = {where: batch.capacity_bytes}
        elif version == (cur.incarnation, cur.revision):
            caps = {**cur.capacities, where: batch.capacity_bytes}
        else:
            return
        self._capacities[batch.instance_id] = CapacityDeclaration(*version, caps)

    def _rewrite(self, h: bytes, rec: Record, new: list[Any]) -> None:
        """Set a chunk's keys (``None`` placements = key gone), keeping key counts, namespace
        claims and the chunk's existence in line. The caller has already touched the chunk."""
        kept: list[Any] = []
        for j in range(0, len(new), 2):
            if new[j + 1] is None:
                self._n_keys -= 1
            else:
                kept += (new[j], new[j + 1])
        tokens = rec[TOKENS]
        if rec[INDEXED] and self._index is not None and tokens is not None:
            gone = self._namespaces(rec[KEYS:]) - self._namespaces(tuple(kept))
            for ns in gone:
                self._index_ops.append(RemoveClaimOp(tokens, h, ns))
        if kept:
            self._parts[h[0]][h] = (tokens, rec[OFFSET], rec[INDEXED], *kept)
        else:
            del self._parts[h[0]][h]

    def _forget_l1_if_gone(self, inst: str, h: bytes) -> None:
        rec = self._parts[h[0]].get(h)
        if rec is not None:
            for pls in rec[KEYS + 1 :: 2]:
                for p in placements_of(pls):
                    if p[2] == "l1" and not p[5] and p[0] == inst:
                        return
        hs = self._l1_chunks.get(inst)
        if hs is not None:
            hs.discard(h)
            if not hs:
                del self._l1_chunks[inst]

    def _fence_locked(self, inst: str) -> int:
        dropped = 0
        for h in self._l1_chunks.pop(inst, ()):
            rec = self._parts[h[0]].get(h)
            if rec is None:
                continue
            self._touch(h, rec)
            new: list[Any] = []
            for j in range(KEYS, len(rec), 2):
                old = placements_of(rec[j + 1])
                kept = []
                for p in old:
                    if p[2] == "l1" and not p[5] and p[0] == inst:
                        self._count(p, -1)
                        dropped += 1
                    else:
                        kept.append(p)
                new += (rec[j], pack_placements(kept))
            self._rewrite(h, rec, new)
        self._l1_placements.pop(inst, None)
        return dropped

    # ------------------------------------------------------------------ reads

    def _placements_locked(self, key: ObjectKey) -> tuple[Placement, ...]:
        found = self._locate(key)
        return () if found is None else _public(found[0][found[1]])

    def lookup(self, keys: Sequence[ObjectKey]) -> list[KeyPlacements]:
        """Placements per key, sorted by (instance, tier, backend); absent keys get ``()``."""
        with self._lock:
            return [KeyPlacements(k, self._placements_locked(k)) for k in keys]

    def lookup_tokens(
        self,
        token_ids: Any,
        model_name: str,
        world_size: int = 1,
        cache_salt: str = "",
        object_group_id: int = 0,
    ) -> TokenLookup:
        """Prefix lookup: hash the full chunks, expand to ``world_size`` ranks, and summarise
        per holder how many *leading* chunks it has on all ranks (what a router needs)."""
        tokens = as_token_array(token_ids)
        hashes = self._hash_chunks(tokens, self.chunk_size)
        keys = expand_prefix_keys(hashes, model_name, world_size, cache_salt, object_group_id)
        with self._lock:
            results = [KeyPlacements(k, self._placements_locked(k)) for k in keys]
        summary = prefix_summary(results, world_size)
        return TokenLookup(len(hashes), results, summary)

    def blend_match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """Fragment lookup; ``[]`` while blend is off. Takes only the index lock."""
        index = self._index
        return [] if index is None else index.match(tokens, namespace)

    def list_keys(
        self,
        *,
        tier: str | None = None,
        instance_id: str | None = None,
        backend: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        max_scan: int | None = None,
    ) -> KeyPage:
        """One page of keys in chunk-hash order, resumable from ``cursor``.

        A page sorts only the partitions it visits (no full scan per page); at most
        ``max_scan`` keys are examined, so a selective filter may return a short page with a
        cursor (as Redis SCAN does). Keys present throughout a listing are returned once.
        """
        if limit < 1:
            raise ValueError("limit must be >= 1")
        start, skip = _parse_cursor(cursor)
        budget = max_scan if max_scan is not None else max(4096, 64 * limit)

        def wanted(p: Placement) -> bool:
            return (
                (tier is None or p.tier == tier)
                and (backend is None or p.backend == backend)
                and (instance_id is None or p.instance_id == instance_id)
            )

        items: list[KeyPlacements] = []
        scanned = 0
        with self._lock:
            for part_no in range(start[0] if start else 0, PARTS):
                part = self._parts[part_no]
                order = sorted(h for h in part if start is None or h >= start)
                shapes = self._shape_list
                for h in order:
                    rec = part[h]
                    pairs = sorted(
                        zip([shapes[s] for s in rec[KEYS::2]], rec[KEYS + 1 :: 2], strict=True),
                        key=lambda kv: kv[0].parts,
                    )
                    first = skip if h == start else 0
                    for n in range(first, len(pairs)):
                        if len(items) == limit or scanned >= budget:
                            return KeyPage(items, f"{h.hex()}:{n}")
                        scanned += 1
                        shape, pls = pairs[n]
                        found = _public(pls)
                        if any(wanted(p) for p in found):
                            items.append(KeyPlacements(shape.key(h), found))
                start = None
        return KeyPage(items, None)

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

    def stats(self) -> dict[str, Any]:
        with self._lock:
            cursors = self._gate.cursors()
            out: dict[str, Any] = {
                "chunk_size": self.chunk_size,
                "keys": self._n_keys,
                "chunks": sum(len(p) for p in self._parts),
                "bound_chunks": sum(
                    1 for p in self._parts for r in p.values() if r[TOKENS] is not None
                ),
                "placements": self._n_placements,
                "l1_placements_by_instance": dict(+self._l1_placements),
                "bytes_by_tier": dict(self._bytes_by_tier),
                "batches": {o.value: self._outcomes[o] for o in Outcome},
                "emitters": len(cursors),
                "gaps": sum(c.gaps for c in cursors.values()),
                "capacity_bytes_by_instance": {
                    inst: sum(d.capacities.values()) for inst, d in self._capacities.items()
                },
            }
            index = self._index
        out["blend"] = (
            {"enabled": False} if index is None else {"enabled": True, **asdict(index.stats())}
        )
        return out

    # ------------------------------------------------------------------ snapshot support

    def _snapshot_begin(self) -> DirectoryState:
        """Start copy-on-write capture; returns the small state at snapshot start."""
        with self._lock:
            if self._cow is not None:
                raise RuntimeError("a snapshot is already being taken")
            self._cow = _CowJournal()
            return DirectoryState(
                self.chunk_size, self._gate.cursors(), dict(self._capacities), self._shape_list
            )

    def _snapshot_part(self, part_no: int) -> tuple[list[tuple[bytes, Record]], float]:
        """The snapshot-start records of one partition and how long the lock was held for it
        (shape ids index :attr:`DirectoryState.shapes` of the snapshot)."""
        with self._lock:
            held_from = time.perf_counter()
            cow = self._cow
            assert cow is not None
            saved = cow.saved[part_no]
            part = self._parts[part_no]
            if saved:
                rows = []
                for h, rec in part.items():
                    if h in saved:
                        st = saved[h]
                        if st is not None:
                            rows.append((h, st))
                    else:
                        rows.append((h, rec))
                for h, st in saved.items():
                    if st is not None and h not in part:
                        rows.append((h, st))
            else:
                rows = list(part.items())  # records are immutable: no copy of their contents
            cow.done[part_no] = True
            saved.clear()
            return rows, time.perf_counter() - held_from

    def _snapshot_end(self) -> None:
        with self._lock:
            self._cow = None

    def _install(
        self,
        parts: list[dict[bytes, Record]],
        shapes: dict[ShapeParts, int],
        state: DirectoryState,
        derived: RestoredCounts | None = None,
    ) -> None:
        """Replace all state with restored chunks; the index is rebuilt from the bindings.
        Records' shape ids index ``state.shapes`` (interned by ``shapes``). ``derived``
        (counters and L1 sets computed column-wise by the loader) saves a pass."""
        if state.chunk_size != self.chunk_size:
            raise ValueError(
                f"snapshot chunk_size {state.chunk_size} != directory chunk_size {self.chunk_size}"
            )
        if derived is None:
            derived = RestoredCounts.scan(parts)
        l1, n_keys, n_pl = derived.l1_chunks, derived.keys, derived.placements
        l1_count, by_tier = derived.l1_placements, derived.bytes_by_tier
        with self._lock:
            if self._cow is not None:
                raise RuntimeError("cannot restore while a snapshot is being taken")
            self._parts, self._shapes, self._l1_chunks = parts, shapes, l1
            self._shape_list = state.shapes
            self._n_keys, self._n_placements = n_keys, n_pl
            self._l1_placements, self._bytes_by_tier = l1_count, by_tier
            self._gate.restore(state.cursors)
            self._capacities = dict(state.capacities)
            if self._index is not None:
                self._index = BlendIndex(self.chunk_size, self._probe_stride)
                self._reindex_all_locked()

    def _reindex_all_locked(self) -> None:
        index = self._index
        assert index is not None
        for part in self._parts:
            ops: list[BlendOp] = []
            for h, rec in part.items():
                tokens, offset = rec[TOKENS], rec[OFFSET]
                if self._indexable(tokens, offset):
                    ops += [AddOp(tokens, h, offset, ns) for ns in self._namespaces(rec[KEYS:])]
                    part[h] = (tokens, offset, True, *rec[KEYS:])  # same key: no resize
            index.apply(ops)


def page_keys(
    directory: KeyDirectory,
    *,
    tier: str | None = None,
    instance_id: str | None = None,
    backend: str | None = None,
    offset: int = 0,
    limit: int = 100,
    cursor: str | None = None,
) -> KeyPage:
    """A page of ``limit`` keys from ``cursor``, or (without a cursor) after skipping ``offset``
    keys: LMCache's offset pagination over the cursor listing. ``next_offset`` is set only for
    an offset listing that goes on. Raises ``ValueError`` on a malformed cursor."""
    next_cursor = cursor
    skip = 0 if cursor else offset
    items: list[KeyPlacements] = []
    while True:
        want = min(10_000, skip) if skip else limit - len(items)
        got = directory.list_keys(
            tier=tier, instance_id=instance_id, backend=backend, cursor=next_cursor, limit=want
        )
        next_cursor = got.next_cursor
        if skip:
            taken = min(skip, len(got.items))
            skip -= taken
            items.extend(got.items[taken:])
        else:
            items.extend(got.items)
        if next_cursor is None or (not skip and len(items) >= limit):
            break
    next_offset = offset + len(items) if next_cursor is not None and not cursor else None
    return KeyPage(items[:limit], next_cursor, next_offset)


def _find(keys: KeyTuple, sid: int) -> int:
    """Position of shape id ``sid`` in a flat key tuple (``-1`` if absent)."""
    if keys[0] == sid:
        return 0
    for i in range(2, len(keys), 2):
        if keys[i] == sid:
            return i
    return -1


def _public(pls: Placements) -> tuple[Placement, ...]:
    """One key's placement rows as :class:`Placement` values, sorted by (instance, tier,
    backend)."""
    if type(pls[0]) is not tuple:
        return (Placement(*pls),)  # type: ignore[arg-type]
    rows = sorted(pls, key=_row_order)  # type: ignore[arg-type]
    return tuple(Placement(*row) for row in rows)


def _row_order(row: PlacementRow) -> tuple[str, str, str]:
    return (row[0], row[2], row[3])


def _parse_cursor(cursor: str | None) -> tuple[bytes | None, int]:
    if not cursor:
        return None, 0
    try:
        text, _, n = cursor.partition(":")
        h = bytes.fromhex(text)
        skip = int(n or 0)
    except ValueError:
        raise ValueError(f"invalid cursor {cursor!r:.80}") from None
    if len(h) != 32 or skip < 0:
        raise ValueError(f"invalid cursor {cursor!r:.80}")
    return h, skip


__all__ = ["IngestCounts", "KeyDirectory", "Placements"]
