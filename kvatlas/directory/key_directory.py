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
from dataclasses import dataclass
from typing import Any

from kvatlas.directory.blend_index import BlendIndex, BlendMatch, BlendOp
from kvatlas.directory.gate import Admission, EmitterCursor, IngestGate, Outcome
from kvatlas.directory.records import (
    CapacityDeclaration,
    Chunk,
    KeyPage,
    KeyPlacements,
    KeyShape,
    Placement,
    Placements,
    PrefixHolder,
    TokenLookup,
    pack_placements,
    placements_of,
)
from kvatlas.events import ACCESS, CONFIG, DELETE, STORE, UNKNOWN_OFFSET, EventBatch
from kvatlas.events.model import tokens_equal
from kvatlas.keys import (
    DEFAULT_CHUNK_SIZE,
    BlendNamespace,
    ObjectKey,
    as_token_array,
    chunk_hashes,
    expand_prefix_keys,
)
from kvatlas.keys.tokens import TokenArray

log = logging.getLogger(__name__)

PARTS = 256
KeyTuple = tuple[Any, ...]  # flat (KeyShape, Placements, KeyShape, Placements, ...)
SavedChunk = tuple[TokenArray | None, int, KeyTuple]
HashChunks = Callable[[Any, int], list[bytes]]


@dataclass(frozen=True, slots=True)
class IngestCounts:
    """The ``POST /events`` reply."""

    applied: int = 0
    duplicates: int = 0
    stale: int = 0


class _CowJournal:
    """Copy-on-write record of a snapshot in progress.

    Before the first change to a chunk whose partition has not been captured yet, its state at
    snapshot start is saved here (``None`` = it did not exist). Capturing a partition therefore
    yields exactly the snapshot-start state, however long the capture of the others takes.
    """

    __slots__ = ("done", "saved")

    def __init__(self) -> None:
        self.done = [False] * PARTS
        self.saved: list[dict[bytes, SavedChunk | None]] = [{} for _ in range(PARTS)]

    def save(self, h: bytes, chunk: Chunk | None) -> None:
        p = h[0]
        if not self.done[p]:
            saved = self.saved[p]
            if h not in saved:
                saved[h] = None if chunk is None else (chunk.tokens, chunk.token_offset, chunk.keys)


@dataclass(slots=True)
class RestoredCounts:
    """Derived state of restored chunks: counters and per-instance L1 chunk sets."""

    keys: int
    placements: int
    l1_placements: Counter[str]
    bytes_by_tier: Counter[str]
    l1_chunks: dict[str, set[bytes]]

    @classmethod
    def scan(cls, parts: list[dict[bytes, Chunk]]) -> RestoredCounts:
        out = cls(0, 0, Counter(), Counter(), {})
        for part in parts:
            for h, chunk in part.items():
                keys = chunk.keys
                out.keys += len(keys) >> 1
                for pls in keys[1::2]:
                    for p in placements_of(pls):
                        out.placements += 1
                        out.bytes_by_tier[p.tier] += p.size_bytes
                        if p.tier == "l1" and not p.shared:
                            out.l1_placements[p.instance_id] += 1
                            out.l1_chunks.setdefault(p.instance_id, set()).add(h)
        return out


@dataclass(frozen=True, slots=True)
class DirectoryState:
    """Everything a snapshot holds besides the chunks (small, copied under the lock)."""

    chunk_size: int
    cursors: dict[str, EmitterCursor]
    capacities: dict[str, CapacityDeclaration]


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
        self._parts: list[dict[bytes, Chunk]] = [{} for _ in range(PARTS)]
        self._shapes: dict[tuple[str, int, int, str], KeyShape] = {}
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
        shapes = [self._shape(e.key) for e in batch.entries]
        if admission.fence_first:
            self._fence_locked(batch.instance_id)
        kind = batch.event_type
        if kind == STORE:
            self._apply_store(batch, shapes)
        elif kind == DELETE:
            self._apply_delete(batch, shapes)
        elif kind == ACCESS:
            self._apply_access(batch, shapes)
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

    def _shape(self, key: ObjectKey) -> KeyShape:
        parts = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        shape = self._shapes.get(parts)
        if shape is None:
            ns = BlendNamespace(key.model_name, key.cache_salt, key.world_size)
            shape = self._shapes[parts] = KeyShape(*parts, ns)
        return shape

    def _touch(self, h: bytes, chunk: Chunk | None) -> None:
        cow = self._cow
        if cow is not None:
            cow.save(h, chunk)

    def _count(self, p: Placement, sign: int) -> None:
        self._n_placements += sign
        self._bytes_by_tier[p.tier] += sign * p.size_bytes
        if p.tier == "l1" and not p.shared:
            self._l1_placements[p.instance_id] += sign

    def _apply_store(self, batch: EventBatch, shapes: list[KeyShape]) -> None:
        inst, tier, backend, shared = batch.instance_id, batch.tier, batch.backend, batch.shared
        ident = (tier, backend, None if shared else inst)
        own_l1 = tier == "l1" and not shared
        by_size: dict[int, Placement] = {}
        index = self._index
        ops = self._index_ops
        for entry, shape in zip(batch.entries, shapes, strict=True):
            p = by_size.get(entry.size_bytes)
            if p is None:
                p = by_size[entry.size_bytes] = Placement(
                    inst, batch.incarnation, tier, backend, entry.size_bytes, shared, batch.ts
                )
            h = entry.key.chunk_hash
            part = self._parts[h[0]]
            chunk = part.get(h)
            if self._cow is not None:
                self._cow.save(h, chunk)
            new_claim = False
            if chunk is None:
                chunk = part[h] = Chunk(None, UNKNOWN_OFFSET, (shape, p))
                keys = chunk.keys
                i = -2  # a new key, already inserted
            else:
                keys = chunk.keys
                i = _find(keys, shape)
            if i < 0:
                if i == -1:
                    new_claim = chunk.indexed and shape.namespace not in chunk.namespaces()
                    chunk.keys = (*keys, shape, p)
                self._n_keys += 1
                self._count(p, 1)
            else:
                old = placements_of(keys[i + 1])
                kept = [q for q in old if q.ident != ident]
                for q in old:
                    if q.ident == ident:
                        self._count(q, -1)
                kept.append(p)
                self._count(p, 1)
                chunk.keys = (*keys[: i + 1], pack_placements(kept), *keys[i + 2 :])
            if own_l1:
                self._l1_chunks.setdefault(inst, set()).add(h)
            reindexed = False
            if entry.token_ids is not None:
                reindexed = self._bind(h, chunk, entry.token_ids, entry.token_offset)
            elif chunk.tokens is None:
                log.debug("store without tokens for unbound chunk %s: not indexed", h.hex())
            if new_claim and not reindexed and chunk.indexed and index is not None:
                assert chunk.tokens is not None
                ops.append(("add", chunk.tokens, h, chunk.token_offset, shape.namespace))

    def _indexable(self, tokens: TokenArray | None, offset: int) -> bool:
        # offset -1 is never indexed: a match without its stored position would be re-RoPEd
        # from the wrong place, i.e. wrong KV, which is worse than a miss.
        return tokens is not None and offset != UNKNOWN_OFFSET and len(tokens) == self.chunk_size

    def _bind(self, h: bytes, chunk: Chunk, tokens: TokenArray, offset: int) -> bool:
        """Bind ``tokens`` to the chunk and bring the index in line; True if it (re)added
        every namespace of the chunk."""
        index = self._index
        old = chunk.tokens
        if old is not None and tokens_equal(old, tokens):
            if offset == UNKNOWN_OFFSET or offset == chunk.token_offset:
                if chunk.indexed or index is None:
                    return False
                # bound before blend was on: this fresh report of the content indexes it
            else:
                chunk.token_offset = offset
        else:
            if chunk.indexed and index is not None and old is not None:
                # Retire the old content before the new one appears: no window in which a match
                # returns new content at the old position (both go in one index batch).
                self._index_ops.append(("remove_chunk", old, h))
            chunk.indexed = False
            chunk.tokens, chunk.token_offset = tokens, offset
            if len(tokens) != self.chunk_size:
                log.info("chunk %s bound with %d tokens (not indexed)", h.hex(), len(tokens))
        if index is None or not self._indexable(chunk.tokens, chunk.token_offset):
            return False
        bound, offset = chunk.tokens, chunk.token_offset
        self._index_ops += [("add", bound, h, offset, ns) for ns in chunk.namespaces()]
        chunk.indexed = True
        return True

    def _apply_delete(self, batch: EventBatch, shapes: list[KeyShape]) -> None:
        ident = (batch.tier, batch.backend, None if batch.shared else batch.instance_id)
        own_l1 = batch.tier == "l1" and not batch.shared
        for entry, shape in zip(batch.entries, shapes, strict=True):
            h = entry.key.chunk_hash
            chunk = self._parts[h[0]].get(h)
            if chunk is None:
                continue
            i = _find(chunk.keys, shape)
            if i < 0:
                continue
            old = placements_of(chunk.keys[i + 1])
            kept = [q for q in old if q.ident != ident]
            if len(kept) == len(old):
                continue
            self._touch(h, chunk)
            for q in old:
                if q.ident == ident:
                    self._count(q, -1)
            new = list(chunk.keys)
            new[i + 1] = pack_placements(kept)
            self._rewrite(h, chunk, new)
            if own_l1:
                self._forget_l1_if_gone(batch.instance_id, h)

    def _apply_access(self, batch: EventBatch, shapes: list[KeyShape]) -> None:
        tier, backend, ts = batch.tier, batch.backend, batch.ts

        def hit(p: Placement) -> bool:
            if p.tier != tier or (backend and p.backend != backend) or p.last_access >= ts:
                return False
            return (
                p.shared if batch.shared else (not p.shared and p.instance_id == batch.instance_id)
            )

        for entry, shape in zip(batch.entries, shapes, strict=True):
            h = entry.key.chunk_hash
            chunk = self._parts[h[0]].get(h)
            i = -1 if chunk is None else _find(chunk.keys, shape)
            if chunk is None or i < 0:
                continue
            old = placements_of(chunk.keys[i + 1])
            if not any(hit(p) for p in old):
                continue
            self._touch(h, chunk)
            new = [_with_access(p, ts) if hit(p) else p for p in old]
            keys = chunk.keys
            chunk.keys = (*keys[: i + 1], pack_placements(new), *keys[i + 2 :])

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

    def _rewrite(self, h: bytes, chunk: Chunk, new: list[Any]) -> None:
        """Set a chunk's keys (``None`` placements = key gone), keeping key counts, namespace
        claims and the chunk's existence in line. The caller has already touched the chunk."""
        kept: list[Any] = []
        for j in range(0, len(new), 2):
            if new[j + 1] is None:
                self._n_keys -= 1
            else:
                kept += (new[j], new[j + 1])
        index = self._index
        if chunk.indexed and index is not None and chunk.tokens is not None:
            before = chunk.namespaces()
            chunk.keys = tuple(kept)
            for ns in before - chunk.namespaces():
                self._index_ops.append(("remove_claim", chunk.tokens, h, ns))
        chunk.keys = tuple(kept)
        if not kept:
            chunk.indexed = False
            del self._parts[h[0]][h]

    def _forget_l1_if_gone(self, inst: str, h: bytes) -> None:
        chunk = self._parts[h[0]].get(h)
        if chunk is not None:
            for pls in chunk.keys[1::2]:
                for p in placements_of(pls):
                    if p.tier == "l1" and not p.shared and p.instance_id == inst:
                        return
        hs = self._l1_chunks.get(inst)
        if hs is not None:
            hs.discard(h)
            if not hs:
                del self._l1_chunks[inst]

    def _fence_locked(self, inst: str) -> int:
        dropped = 0
        for h in self._l1_chunks.pop(inst, ()):
            chunk = self._parts[h[0]].get(h)
            if chunk is None:
                continue
            self._touch(h, chunk)
            new: list[Any] = []
            for j in range(0, len(chunk.keys), 2):
                old = placements_of(chunk.keys[j + 1])
                kept = []
                for p in old:
                    if p.tier == "l1" and not p.shared and p.instance_id == inst:
                        self._count(p, -1)
                        dropped += 1
                    else:
                        kept.append(p)
                new += (chunk.keys[j], pack_placements(kept))
            self._rewrite(h, chunk, new)
        self._l1_placements.pop(inst, None)
        return dropped

    # ------------------------------------------------------------------ reads

    def _placements_locked(self, key: ObjectKey) -> tuple[Placement, ...]:
        h = key.chunk_hash
        chunk = self._parts[h[0]].get(h)
        if chunk is None:
            return ()
        shape = self._shapes.get((key.model_name, key.kv_rank, key.object_group_id, key.cache_salt))
        i = -1 if shape is None else _find(chunk.keys, shape)
        if i < 0:
            return ()
        return tuple(sorted(placements_of(chunk.keys[i + 1]), key=Placement.sort_key))

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
        prefix: dict[tuple[str | None, str, str, bool], int] = {}
        alive: set[tuple[str | None, str, str, bool]] | None = None
        for c in range(len(hashes)):
            held: set[tuple[str | None, str, str, bool]] | None = None
            for r in results[c * world_size : (c + 1) * world_size]:
                here = {
                    (None if p.shared else p.instance_id, p.tier, p.backend, p.shared)
                    for p in r.placements
                }
                held = here if held is None else held & here
            alive = (held or set()) if alive is None else alive & (held or set())
            if not alive:
                break
            for holder in alive:
                prefix[holder] = prefix.get(holder, 0) + 1
        summary = [PrefixHolder(*holder, chunks=n) for holder, n in prefix.items()]
        summary.sort(key=lambda s: (-s.chunks, s.instance_id or "", s.tier, s.backend))
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
                for h in order:
                    chunk = part[h]
                    pairs = sorted(
                        zip(chunk.keys[0::2], chunk.keys[1::2], strict=True),
                        key=lambda kv: kv[0].parts,
                    )
                    first = skip if h == start else 0
                    for n in range(first, len(pairs)):
                        if len(items) == limit or scanned >= budget:
                            return KeyPage(items, f"{h.hex()}:{n}")
                        scanned += 1
                        shape, pls = pairs[n]
                        found = placements_of(pls)
                        if any(wanted(p) for p in found):
                            ordered = tuple(sorted(found, key=Placement.sort_key))
                            items.append(KeyPlacements(shape.key(h), ordered))
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
                    1 for p in self._parts for c in p.values() if c.tokens is not None
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
        out["blend"] = {"enabled": False} if index is None else {"enabled": True, **index.stats()}
        return out

    # ------------------------------------------------------------------ snapshot support

    def _snapshot_begin(self) -> DirectoryState:
        """Start copy-on-write capture; returns the small state at snapshot start."""
        with self._lock:
            if self._cow is not None:
                raise RuntimeError("a snapshot is already being taken")
            self._cow = _CowJournal()
            return DirectoryState(self.chunk_size, self._gate.cursors(), dict(self._capacities))

    def _snapshot_part(
        self, part_no: int
    ) -> tuple[list[tuple[bytes, TokenArray | None, int, KeyTuple]], float]:
        """The snapshot-start state of one partition and how long the lock was held for it."""
        with self._lock:
            held_from = time.perf_counter()
            cow = self._cow
            assert cow is not None
            saved = cow.saved[part_no]
            part = self._parts[part_no]
            rows = []
            for h, c in part.items():
                if h in saved:
                    st = saved[h]
                    if st is not None:
                        rows.append((h, *st))
                else:
                    rows.append((h, c.tokens, c.token_offset, c.keys))
            for h, st in saved.items():
                if st is not None and h not in part:
                    rows.append((h, *st))
            cow.done[part_no] = True
            saved.clear()
            return rows, time.perf_counter() - held_from

    def _snapshot_end(self) -> None:
        with self._lock:
            self._cow = None

    def _install(
        self,
        parts: list[dict[bytes, Chunk]],
        shapes: dict[tuple[str, int, int, str], KeyShape],
        state: DirectoryState,
        derived: RestoredCounts | None = None,
    ) -> None:
        """Replace all state with restored chunks; the index is rebuilt from the bindings.
        ``derived`` (counters and L1 sets computed column-wise by the loader) saves a pass."""
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
            for h, chunk in part.items():
                if self._indexable(chunk.tokens, chunk.token_offset):
                    ops += [
                        ("add", chunk.tokens, h, chunk.token_offset, ns)
                        for ns in chunk.namespaces()
                    ]
                    chunk.indexed = True
            index.apply(ops)


def _find(keys: KeyTuple, shape: KeyShape) -> int:
    """Position of ``shape`` in a flat key tuple (shapes are interned: identity suffices)."""
    for i in range(0, len(keys), 2):
        if keys[i] is shape:
            return i
    return -1


def _with_access(p: Placement, ts: float) -> Placement:
    return Placement(p.instance_id, p.incarnation, p.tier, p.backend, p.size_bytes, p.shared, ts)


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
