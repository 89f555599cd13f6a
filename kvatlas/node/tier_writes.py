"""A node's tier writes and their events: every change of what L1 and L2 hold (a store, an
eviction, a chunk L2 lost on its own, a delete) goes with its event, under one lock, so a
re-report of the inventory (:meth:`TierWrites.report_inventory`, after a late registration) can
never re-announce a chunk whose delete was already sent; the node's own inventory (its digests,
resync) changes before the event is recorded. What :class:`~kvatlas.node.cache_node.CacheNode`
stores, deletes and reports goes through here; its reads do not."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Final

from kvatlas.events import ACCESS, CONFIG, DELETE, STORE, CacheEntry
from kvatlas.keys import ObjectKey
from kvatlas.node.config import NodeConfig
from kvatlas.node.emitter import BatchSink, EventEmitter
from kvatlas.node.inventory import DigestExchange, NodeInventory, ResyncDriver, resync_sender
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import (
    CORRUPT_DELETED,
    UNREADABLE,
    FsL2,
    L2Backend,
    L2FullOfPins,
    L2Unavailable,
)
from kvatlas.node.pins import PinnedKeys
from kvatlas.node.pool_journal import PoolJournal
from kvatlas.node.presence import L1, L2, Presence, Tier
from kvatlas.node.results import Deleted, HeldPlacement
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.token_cache import TokenCache

log = logging.getLogger(__name__)

L1_BACKEND: Final = "dram"


class TierWrites:
    """The write side of one node's tiers: ``l1``, ``l2`` (``None``: none), the ``presence``
    map and its local index, the ``token_cache`` events borrow tokens from, the node's ``own``
    inventory and its ``emitter`` (``None``: no events); ``counters`` are the node's."""

    def __init__(
        self,
        config: NodeConfig,
        l1: L1Cache,
        l2: L2Backend | None,
        presence: Presence,
        token_cache: TokenCache,
        own: NodeInventory,
        emitter: EventEmitter | None,
        counters: Counter[str],
        pins: PinnedKeys | None = None,
    ) -> None:
        self.config = config
        self.pins = pins if pins is not None else PinnedKeys()  # the operator's
        if isinstance(l2, FsL2):  # a capped private L2 never evicts them either
            l2.pinned = self.pins
        self.layout = config.layout
        self.l1 = l1
        self.l2 = l2
        self.presence = presence
        self.token_cache = token_cache
        self.own = own
        self.emitter = emitter
        self.counters = counters
        self.report_lock = threading.RLock()  # a tier change and its event, together
        # the shared pool's changes whose events may not have left (set by the node)
        self.journal: PoolJournal | None = None

    def announce(self) -> None:
        """This incarnation's first event: a ``config`` batch declaring L1's capacity (and a
        capped private L2's). Every replica learns of a restart from the event channel only
        (it may never see this node register); on this batch each fences the previous
        incarnation's L1, even when this one then stores nothing for a while."""
        if self.emitter is None:
            return
        declared = [(L1, L1_BACKEND, self.l1.capacity_bytes)]
        if isinstance(self.l2, FsL2) and not self.l2.shared and self.l2.max_bytes:
            declared.append((L2, self.l2.name, self.l2.max_bytes))

        def declare(sink: BatchSink) -> None:
            for tier, backend, capacity in declared:
                sink.emit(CONFIG, tier, backend, [], capacity_bytes=capacity, capacity_revision=1)

        self.emitter.barrier(declare)

    def put_l1(self, chunk: StoredChunk) -> bool:
        """Store ``chunk`` in L1 (and in L2 when it writes through); whether a tier holds it
        after. A chunk L1 refuses (too large, or no room but pinned or held chunks) leaves L1
        at once: in ``evict`` mode it goes to L2 as an evicted chunk does."""
        if self.l1.contains(chunk.key):
            self.l1.get(chunk.key)  # moves it to the LRU's recent end
            self.l1_accessed(chunk.key)
            return True
        rejected = self.l1.put(chunk)
        refused = any(r is chunk for r in rejected)
        if refused:
            self.counters["l1_rejected"] += 1
            if chunk.nbytes <= self.l1.capacity_bytes:  # it fits an empty L1: pins hold it
                self.counters["l1_refused_pinned"] += 1
        else:
            with self.report_lock:
                if self.l1.contains(chunk.key):  # else evicted already, its delete sent
                    self.gain(chunk, L1)
                    self.record(STORE, L1, L1_BACKEND, self.entry(chunk))
        if self.l2 is not None and (refused or self.config.l2_write == "through"):
            self.put_l2(chunk)
        return not refused or (self.l2 is not None and self.l2.contains(chunk.key))

    def put_l2(self, chunk: StoredChunk) -> None:
        assert self.l2 is not None
        if self.l2.contains(chunk.key):
            return
        with self._journaled(chunk.key):
            self._put_l2(chunk)

    def _journaled(self, key: ObjectKey) -> AbstractContextManager[object]:
        """A pool change of ``key``, journaled until its event is recorded (a shared pool)."""
        return nullcontext() if self.journal is None else self.journal.changing(key)

    def _put_l2(self, chunk: StoredChunk) -> None:
        assert self.l2 is not None
        try:
            self.l2.put(chunk)
        except L2FullOfPins as exc:
            self.counters["l2_refused_pinned"] += 1
            log.warning("L2 write refused for %s: %s", chunk.key.chunk_hash.hex()[:16], exc)
            return
        except (L2Unavailable, OSError) as exc:
            self.counters["l2_write_failures"] += 1
            log.warning("L2 write failed for %s: %s", chunk.key.chunk_hash.hex()[:16], exc)
            return
        self.counters["l2_chunks_written"] += 1
        self.counters["l2_bytes_written"] += chunk.nbytes
        with self.report_lock:
            # a loss between the write and here found nothing to report: no store then
            if self.l2.contains(chunk.key):
                self.gain(chunk, L2)
                self.record(STORE, L2, self.l2.name, self.entry(chunk), shared=self.l2.shared)

    def on_l1_evict(self, chunk: StoredChunk) -> None:
        self.counters["l1_evictions"] += 1
        if self.l2 is not None and self.config.l2_write == "evict":
            self.put_l2(chunk)
        with self.report_lock:
            self.record(DELETE, L1, L1_BACKEND, CacheEntry(chunk.key, chunk.nbytes))
            self.presence.lose(chunk.key, L1)

    def adopt_l2(self, chunk: StoredChunk) -> bool:
        """A chunk the private L2 already held at start-up (a restart): held and reported --
        unless it is another KV layout's (a restart with other layout flags): this node can
        never use it, so it is neither held nor announced, only counted (its file stays)."""
        assert self.l2 is not None
        if not self.layout.fits(chunk.kv.shape, chunk.kv_dtype):
            self.counters["l2_foreign_layout_kept"] += 1
            return False
        with self.report_lock:
            self.gain(chunk, L2)
            self.record(STORE, L2, self.l2.name, self.entry(chunk), shared=self.l2.shared)
        self.counters["l2_rescanned"] += 1
        return True

    def on_l2_lost(self, key: ObjectKey, cause: str) -> None:
        """``key`` left L2 without the node deleting it (``kvatlas.node.l2`` causes): counted
        as ``l2_<cause>`` and reported as a delete if this node held it there, or if it
        dropped a shared pool's corrupt or unreadable file (whichever node wrote it: the writer
        never learns its file is gone, so its placement would stay)."""
        assert self.l2 is not None
        self.counters[f"l2_{cause}"] += 1
        with self.report_lock:
            removed_shared = self.l2.shared and cause in (CORRUPT_DELETED, UNREADABLE)
            if L2 not in self.presence.tiers_of_key(key) and not removed_shared:
                return
            self.record(DELETE, L2, self.l2.name, CacheEntry(key, 0), shared=self.l2.shared)
            self.presence.lose(key, L2)

    def l1_accessed(self, key: ObjectKey) -> None:
        self.record(ACCESS, L1, L1_BACKEND, CacheEntry(key, 0))

    def gain(self, chunk: StoredChunk, tier: Tier) -> None:
        if chunk.tokens is not None:
            self.token_cache.remember(chunk.key.chunk_hash, chunk.tokens, chunk.token_offset)
        self.presence.gain(chunk, tier)

    def entry(self, chunk: StoredChunk) -> CacheEntry:
        tokens, offset = chunk.tokens, chunk.token_offset
        if tokens is None:
            remembered = self.token_cache.lookup(chunk.key.chunk_hash)
            if remembered is not None:
                tokens, offset = remembered
            else:
                self.counters["events_without_tokens"] += 1
        return CacheEntry(chunk.key, chunk.nbytes, tokens, offset)

    def record(
        self, event_type: str, tier: str, backend: str, entry: CacheEntry, *, shared: bool = False
    ) -> None:
        # The inventory changes before the event is recorded: a resync listing (taken while
        # nothing is recorded) is never older than an event queued ahead of it.
        if not shared and event_type == STORE:
            self.own.add(tier, backend, entry)
        elif not shared and event_type == DELETE:
            self.own.remove(tier, backend, entry.key)
        if self.emitter is not None:
            self.emitter.record(event_type, tier, backend, entry, shared=shared)

    def delete(self, keys: Sequence[ObjectKey], tiers: frozenset[Tier], *, force: bool) -> Deleted:
        """Remove ``keys`` from this node's ``tiers``: copies removed (L1 and L2 summed), copies
        left because a transfer holds them (L1) or the operator pinned them (L1 and L2; ``force``
        removes those too), and the error an L2 failure stopped at (the keys after it
        untouched). Each removal is a ``delete`` event, like an eviction."""
        deleted = skipped = 0
        for key in keys:
            if L1 in tiers:
                if not force and self.l1.is_pinned(key) and self.l1.contains(key):
                    skipped += 1
                elif self.drop_l1(key):
                    deleted += 1
            try:
                if L2 not in tiers or self.l2 is None:
                    continue
                if not force and key in self.pins:
                    skipped += self.l2.contains(key)
                elif self.drop_l2(key):
                    deleted += 1
            except (L2Unavailable, OSError) as exc:
                self.counters["control_delete_failures"] += 1
                self.counters["control_deleted"] += deleted
                return Deleted(deleted, skipped, str(exc))
        self.counters["control_deleted"] += deleted
        return Deleted(deleted, skipped)

    def clear_l1(self, *, force: bool) -> Deleted:
        """:meth:`delete` of every key L1 holds."""
        return self.delete(self.l1.keys(), frozenset({L1}), force=force)

    def drop_l1(self, key: ObjectKey) -> bool:
        with self.report_lock:
            chunk = self.l1.peek(key)
            if chunk is None or not self.l1.remove(key):
                return False
            self.record(DELETE, L1, L1_BACKEND, CacheEntry(key, chunk.nbytes))
            self.presence.lose(key, L1)
        return True

    def drop_l2(self, key: ObjectKey) -> bool:
        assert self.l2 is not None
        with self._journaled(key):
            existed = self.l2.delete(key)
            with self.report_lock:
                # a copy this node reported, or a shared pool's copy another node wrote
                if L2 in self.presence.tiers_of_key(key) or (existed and self.l2.shared):
                    self.record(DELETE, L2, self.l2.name, CacheEntry(key, 0), shared=self.l2.shared)
                    self.presence.lose(key, L2)
        return existed

    def announce_pool(self, keys: Sequence[ObjectKey]) -> int:
        """Announce each of ``keys`` as the shared pool holds it now — a ``store`` for a file
        that is there, a ``delete`` for one that is not, nothing for one it cannot read — for
        pool changes whose events may have been lost (:mod:`kvatlas.node.pool_journal`);
        returns how many were announced."""
        l2, n = self.l2, 0
        if l2 is None or not l2.shared:
            return 0
        for key in keys:
            chunk = l2.get(key)
            with self.report_lock:
                if chunk is not None:
                    self.record(STORE, L2, l2.name, self.entry(chunk), shared=True)
                elif not l2.contains(key):
                    self.record(DELETE, L2, l2.name, CacheEntry(key, 0), shared=True)
                else:
                    continue
            n += 1
        self.counters["pool_changes_announced"] += n
        return n

    def inventory(self) -> list[HeldPlacement]:
        """Every placement this node holds, one per (key, tier) (a consistent snapshot)."""
        l2_backend = self.l2.name if self.l2 is not None else ""
        backend = {L1: L1_BACKEND, L2: l2_backend}
        return [
            HeldPlacement(key, tier, backend[tier])
            for key, tiers, _tokens, _offset in self.presence.holdings()
            for tier in sorted(tiers)
        ]

    def held(self) -> list[HeldPlacement]:
        """What this node's own tiers really hold, read from the tiers themselves (L1's
        entries, a private fs L2's files), not from its bookkeeping: the ground truth that
        :meth:`inventory` and the coordinator's view are checked against (``GET
        /engine/inventory``; ``kvatlas soak``). A shared pool or a Redis L2 is not listed."""
        in_l1 = self.l1.keys()
        out = [HeldPlacement(key, L1, L1_BACKEND) for key in in_l1]
        if isinstance(self.l2, FsL2) and not self.l2.shared:
            in_l2 = self.l2.keys()
            out += [HeldPlacement(key, L2, self.l2.name) for key in in_l2]
        return out

    def report_inventory(self) -> int:
        """Send a ``store`` event for every placement this node holds (tokens attached when
        known), e.g. after registering with a coordinator that was down; returns how many.
        Under the report lock: no delete sent before it is contradicted by a store after."""
        if self.emitter is None:
            return 0
        n = 0
        nbytes = self.layout.chunk_bytes
        with self.report_lock:
            for key, tiers, tokens, offset in self.presence.holdings():
                entry = CacheEntry(key, nbytes, tokens, offset if tokens is not None else -1)
                if L1 in tiers:
                    self.record(STORE, L1, L1_BACKEND, entry)
                    n += 1
                if L2 in tiers and self.l2 is not None:
                    self.record(STORE, L2, self.l2.name, entry, shared=self.l2.shared)
                    n += 1
        self.counters["inventory_reported"] += n
        return n

    def resync_driver(
        self, exchange: DigestExchange, *, interval: float, settle: Any = None, lost: Any = None
    ) -> ResyncDriver | None:
        """A digest-exchange driver over this node's own tiers (``None`` without an event
        sink: nothing to resync through)."""
        emitter = self.emitter
        if emitter is None:
            return None
        backends = {L1: L1_BACKEND}
        if self.l2 is not None and not self.l2.shared:
            backends[L2] = self.l2.name

        def settled() -> None:
            emitter.flush()
            if settle is not None:
                settle()

        return ResyncDriver(
            self.own,
            backends,
            exchange=exchange,
            barrier=lambda act: emitter.barrier(lambda sink: act(resync_sender(sink))),
            settle=settled,
            lost=lost or (lambda: 0),
            tokens_of=self.token_cache.peek,
            interval=interval,
        )
