"""CacheNode: the engine-facing cache — store, prefix lookup and retrieval, blend lookup and
blend retrieval with re-RoPE — always keyed through the request tracker (``docs/node.md``).

Orchestration only: tier membership and the local index live in :mod:`kvatlas.node.presence`,
every tier write with its event in :mod:`kvatlas.node.tier_writes`, reads across tiers in
:mod:`kvatlas.node.tiered_fetch`, the blend lookup in :mod:`kvatlas.node.unified_lookup`, blend
retrieval in :mod:`kvatlas.node.blend_retrieval`, a move's loads and holds in
:mod:`kvatlas.node.moves`, what calls return in :mod:`kvatlas.node.results`; this module keys,
stores, retrieves and verifies.

Every key-carrying path takes its tokens from :class:`~kvatlas.keys.RequestTracker`; an
uncacheable tracker (multimodal items without identity) gets no lookup and no store.

Safety rules that go beyond "the hash matched":

* every retrieval, prefix and blend, uses a fetched chunk (from any tier, a peer or an L2 pool)
  only if its key is the requested key and its tokens equal the request's tokens at that
  position (:mod:`kvatlas.node.chunk_digest`; a peer proves it with a digest): a stale,
  foreign or forged chunk becomes a miss counted by cause (``rejected_*``) and a warning at
  most once a minute per source, never wrong KV;
* re-RoPE starts from the fetched chunk's own ``token_offset`` (where its KV was computed),
  not from an index's idea of it; a chunk with unknown offset is a miss.
* a segment whose used part ``[trim, trim + length)`` does not lie inside the chunk (segments
  also arrive over the engine API) is a miss, never a part shorter than the span it claims.

Honest reporting (:mod:`kvatlas.node.tier_writes`): a tier change and its event happen together
under one lock; a chunk that leaves L2 on its own (evicted for the cap, corrupt, expired) is a
``delete`` event, and a restart reports what the private fs L2 really holds
(``kvatlas.node.l2``).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

import numpy as np

from kvatlas.client import FleetMatcher
from kvatlas.directory import BlendIndex
from kvatlas.errors import Unprocessable
from kvatlas.keys import (
    BlendNamespace,
    MMItem,
    ObjectKey,
    RequestTracker,
    TokenArray,
    check_instance_id,
)
from kvatlas.logs import Throttle
from kvatlas.node.blend_retrieval import BlendRetriever
from kvatlas.node.chunk_digest import rejection
from kvatlas.node.config import NodeConfig
from kvatlas.node.emitter import BatchSink, EventEmitter
from kvatlas.node.fleet_view import FleetView
from kvatlas.node.holds import AnyOf, MoveHolds
from kvatlas.node.inventory import DigestExchange, NodeInventory, ResyncDriver
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import FsL2, L2Backend
from kvatlas.node.metrics import NodeTimings, hit_tokens
from kvatlas.node.moves import MoveTarget
from kvatlas.node.pins import PinnedKeys
from kvatlas.node.pool_journal import journal_pool_changes
from kvatlas.node.presence import Presence, Tier
from kvatlas.node.results import BlendRetrieval, Deleted, HeldPlacement, NodeStats, Retrieved
from kvatlas.node.segments import Segment
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.tier_writes import TierWrites
from kvatlas.node.tiered_fetch import Fetched, TieredFetch
from kvatlas.node.token_cache import TokenCache
from kvatlas.node.unified_lookup import NOTHING_FOUND, LookupResult, UnifiedBlendLookup

log = logging.getLogger(__name__)


class CacheNode:
    """One node's tiers, events and lookups behind the engine API (see the module docstring).

    Engine calls may run concurrently (the HTTP API runs them in a thread pool): the tiers,
    the presence map, the local index and the emitter each guard their own state; the
    ``counters`` are best-effort."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        instance_id: str | None = None,
        l2: L2Backend | None = None,
        sink: BatchSink | None = None,
        fleet: FleetView | None = None,
        fleet_matcher: FleetMatcher | None = None,
    ) -> None:
        self.config = config
        self.instance_id = check_instance_id(
            instance_id or config.instance_id or f"node-{uuid.uuid4().hex[:12]}"
        )
        self.layout = config.layout
        self.layout.numpy_dtype()  # bfloat16 loads ml_dtypes now, not inside the first request
        self.scheme = config.scheme
        self.chunk_size = config.chunk_size
        self.pins = PinnedKeys()  # the operator's pins on this node (kvatlas.node.pins)
        self.holds = MoveHolds()  # keys moves hold here until the source's copy is gone
        self.l1 = L1Cache(
            config.l1_bytes, on_evict=self._on_l1_evict, held=AnyOf(self.pins, self.holds)
        )
        self.l2 = l2
        self.fleet = fleet
        self.emitter = EventEmitter(sink) if sink is not None else None
        self._sink = sink
        self.token_cache = TokenCache(config.token_cache_chunks)
        self.own = NodeInventory()  # what this node reported holding (its digests, resync)
        self.counters: Counter[str] = Counter()
        self._rejection_warnings = Throttle(60.0)
        self.index = BlendIndex(config.chunk_size)
        self.presence = Presence(self.index, self.namespace)
        self.writes = TierWrites(
            config, self.l1, l2, self.presence, self.token_cache, self.own, self.emitter,
            self.counters, self.pins,
        )  # fmt: skip
        self.timings = NodeTimings()  # fetch and re-RoPE histograms (node /metrics)
        self.timings.watch(self.scrape)
        self.coordinator_failures: Callable[[], int] = lambda: 0  # set by the node process
        self.tiers = TieredFetch(
            self.l1,
            l2,
            fleet,
            instance_id=self.instance_id,
            layout=self.layout,
            on_l1_hit=self.writes.l1_accessed,
            counters=self.counters,
            observe=self.timings.observe_fetch,
        )
        self.blend = UnifiedBlendLookup(
            self.presence,  # (matches under real chunk hashes, each salt's own offsets)
            fleet_matcher,
            chunk_size=config.chunk_size,
            deadline_s=config.coordinator_blend_timeout,
            prefer_cheaper=config.prefer_cheaper,
            cost_of=self.presence.cost_of,
            allow_trim=config.allow_trim,
        )
        self.blend_retriever = BlendRetriever(
            tiers=self.tiers, layout=self.layout, chunk_size=config.chunk_size,
            counters=self.counters, timings=self.timings, key=self.key, verified=self._verified,
        )  # fmt: skip
        self.moves = MoveTarget(  # a move's target: loads and holds (kvatlas.node.moves)
            holds=self.holds, l1=self.l1, l2=l2, tiers=self.tiers, writes=self.writes,
            layout=self.layout, chunk_size=config.chunk_size, counters=self.counters,
            key=self.key, fleet=lambda: self.fleet, flush_events=self.flush_events, sink=sink,
        )  # fmt: skip
        self.writes.announce()
        if l2 is not None:  # last: reports what a private L2 already holds, watches losses
            l2.attach(self.writes.adopt_l2, self.writes.on_l2_lost)
            if isinstance(l2, FsL2) and l2.corrupt_deleted:  # found by the rescan, keys unknown
                self.counters["l2_corrupt_deleted"] += l2.corrupt_deleted
            if foreign := self.counters["l2_foreign_layout_kept"]:
                log.warning(
                    "%d L2 chunks are of another KV layout than %s: kept on disk, not used",
                    foreign, self.layout,
                )  # fmt: skip
        # a shared pool's changes, journaled until their events left (pool_journal.py)
        self.pool_journal = (  # (a restart finds its journal by a stable --instance-id)
            journal_pool_changes(l2, sink, self.instance_id, self.flush_events, self.writes)
            if config.instance_id
            else None
        )

    # ------------------------------------------------------------------ keys

    def tracker(
        self,
        request: Any = None,
        *,
        token_ids: Any = None,
        mm_items: Sequence[MMItem] = (),
        cache_salt: str = "",
        request_id: str = "",
        engine: str | None = None,
    ) -> RequestTracker:
        """The request's single key source: from an engine request, or from tokens + items."""
        if request is not None:
            return RequestTracker.from_request(request, scheme=self.scheme, engine=engine)
        return RequestTracker(
            token_ids if token_ids is not None else [],
            mm_items,
            scheme=self.scheme,
            cache_salt=cache_salt,
            request_id=request_id,
        )

    def key(self, chunk_hash: bytes, cache_salt: str) -> ObjectKey:
        return ObjectKey(chunk_hash, self.config.model_name, self.config.kv_rank, 0, cache_salt)

    def namespace(self, cache_salt: str) -> BlendNamespace:
        return BlendNamespace(self.config.model_name, cache_salt, self.config.world_size)

    # ------------------------------------------------------------------ store

    def store(
        self, tracker: RequestTracker, kv_chunks: Sequence[Any], *, first_chunk: int = 0
    ) -> int:
        """Store the KV of full chunks ``first_chunk, first_chunk+1, ...``; returns how many."""
        if not tracker.cacheable:
            self.counters["store_refused_uncacheable"] += 1
            return 0
        hashes = tracker.chunk_hashes()
        tokens = tracker.get_token_ids()
        c = self.chunk_size
        stored = 0
        for i, kv in enumerate(kv_chunks, start=first_chunk):
            if i >= len(hashes):
                break
            self._check_kv(kv)
            chunk_tokens = np.array(tokens[i * c : (i + 1) * c], dtype=np.uint32)
            chunk_tokens.flags.writeable = False
            key = self.key(hashes[i], tracker.cache_salt)
            chunk = StoredChunk(key, kv, chunk_tokens, i * c, self.layout.dtype)
            stored += self.writes.put_l1(chunk)  # (False: no tier took it, counted)
        self.counters["chunks_stored"] += stored
        return stored

    def _check_kv(self, kv: Any) -> None:
        shape = tuple(kv.shape)
        if shape != self.layout.shape:
            raise Unprocessable(
                f"KV chunk shape {shape} does not match the layout {self.layout.shape}"
            )

    def _on_l1_evict(self, chunk: StoredChunk) -> None:
        self.writes.on_l1_evict(chunk)  # L1 is made before the writes it reports through

    def _put_l1(self, chunk: StoredChunk) -> None:
        self.writes.put_l1(chunk)

    # ------------------------------------------------------------------ prefix path

    def lookup(self, tracker: RequestTracker) -> int:
        """Prefix hit length in tokens: leading chunks retrievable from any tier."""
        if not tracker.cacheable:
            return 0
        self.counters["lookups_prefix"] += 1
        keys = [self.key(h, tracker.cache_salt) for h in tracker.chunk_hashes()]
        return self.tiers.prefix_hits(keys) * self.chunk_size

    def retrieve(
        self, tracker: RequestTracker, num_tokens: int | None = None, *, first_chunk: int = 0
    ) -> Retrieved:
        """KV of the leading chunks from chunk ``first_chunk`` (the caller holds those before
        it); stops at the first chunk no tier has, or whose tokens are not the request's.
        ``hit_tokens``: the prefix covered from the request's start, ``first_chunk``'s
        predecessors included when one came. The value counters count the request from
        ``first_chunk`` on (what was asked of this node)."""
        if not tracker.cacheable:
            return Retrieved([], 0)
        hashes = tracker.chunk_hashes(num_tokens)[first_chunk:]
        tokens = tracker.get_token_ids()
        keys = [self.key(h, tracker.cache_salt) for h in hashes]
        listed: set[ObjectKey] = set()  # keys the directory lists on another instance
        found = self.tiers.fetch(keys, listed)
        kv: list[Any] = []
        sources: Counter[str] = Counter()
        c = self.chunk_size
        for i, key in enumerate(keys, start=first_chunk):
            got = found.get(key)
            if got is None or not self._verified(key, got, tokens[i * c : (i + 1) * c]):
                break
            kv.append(got.chunk.kv)
            sources[got.source] += 1
        self.counters["prefix_chunks_retrieved"] += len(kv)
        asked = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        self._count_value(max(0, asked - first_chunk * c), len(kv) * c,
                          sum(k in listed for k in keys[len(kv):]))  # fmt: skip
        return Retrieved(kv, (first_chunk + len(kv)) * c if kv else 0, sources)

    def _verified(self, key: ObjectKey, got: Fetched, window: TokenArray) -> bool:
        """Whether ``got`` may serve ``key`` where the request's tokens are ``window``; a
        refusal is counted by cause and warned about at most once a minute per source."""
        cause = rejection(key, got.chunk, got.tokens_digest, window)
        if cause is None:
            return True
        self.counters[cause] += 1
        if self._rejection_warnings(f"{got.source}:{got.origin}"):
            log.warning(
                "%s from %s %s refused (%s); further refusals from it are counted, "
                "not logged, for a minute",
                key.chunk_hash.hex()[:16], got.source, got.origin, cause,
            )  # fmt: skip
        return False

    # ------------------------------------------------------------------ blend path

    def blend_lookup(
        self, tracker: RequestTracker, *, prefix_len: int = 0, request_id: str | None = None
    ) -> LookupResult | None:
        """Poll-able: ``None`` means "ask again" (the fleet leg is pending, deadline not passed)."""
        rid = request_id or tracker.request_id or str(id(tracker))
        if not tracker.cacheable:
            return NOTHING_FOUND
        try:
            return self.blend.poll(rid, prefix_len)
        except KeyError:
            self.counters["lookups_blend"] += 1
            # the tokens a blend retrieval could cover: the fragment hit rate's denominator
            self.counters["blend_query_tokens"] += max(0, len(tracker.get_token_ids()) - prefix_len)
            self.blend.start(rid, tracker.get_token_ids(), self.namespace(tracker.cache_salt))
            return self.blend.poll(rid, prefix_len)

    def blend_retrieve(
        self, tracker: RequestTracker, segments: Sequence[Segment]
    ) -> BlendRetrieval:
        """The segments' KV, verified and re-RoPEd (:mod:`kvatlas.node.blend_retrieval`)."""
        return self.blend_retriever.retrieve(tracker, segments)

    # ------------------------------------------------------------------ cache control

    def delete(self, keys: Sequence[ObjectKey], tiers: frozenset[Tier], *, force: bool) -> Deleted:
        """Remove ``keys`` from ``tiers`` (:meth:`TierWrites.delete`)."""
        return self.writes.delete(keys, tiers, force=force)

    def clear_l1(self, *, force: bool) -> Deleted:
        """:meth:`delete` of every key L1 holds."""
        return self.writes.clear_l1(force=force)

    def load_into_l1(self, keys: Sequence[ObjectKey]) -> int:
        """Warm L1 from this node's L2 (a prefetch): each key L1 lacks is read from L2 and put
        in L1 (a ``store`` event); returns how many of ``keys`` L1 holds afterwards. A key L2
        lacks, or whose chunk is not this node's layout, stays a miss."""
        for key in keys:
            if self.l1.contains(key) or self.l2 is None:
                continue
            chunk = self.l2.get(key)
            if chunk is not None and self.tiers.usable(chunk):
                self.writes.put_l1(chunk)
                self.counters["prefetched_chunks"] += 1
        return sum(self.l1.contains(key) for key in keys)

    # ------------------------------------------------------------------ inventory

    def inventory(self) -> list[HeldPlacement]:
        """Every placement this node holds, one per (key, tier) (a consistent snapshot)."""
        return self.writes.inventory()

    def held(self) -> list[HeldPlacement]:
        """What the tiers themselves hold (:meth:`TierWrites.held`; ``GET /engine/inventory``)."""
        return self.writes.held()

    def report_inventory(self) -> int:
        """A ``store`` event for every placement held (:meth:`TierWrites.report_inventory`)."""
        return self.writes.report_inventory()

    # ------------------------------------------------------------------ operator's view

    def _count_value(self, query: int, prefix_hit: int, regret_chunks: int) -> None:
        """One retrieval's tokens: asked, served from the prefix, and recomputed although the
        directory listed them on another instance (capped at what was recomputed)."""
        self.counters["query_tokens"] += query
        self.counters[hit_tokens("prefix")] += prefix_hit
        self.counters["regret_tokens"] += min(regret_chunks * self.chunk_size, query - prefix_hit)

    def scrape(self) -> dict[str, Any]:
        """What the node's ``/metrics`` and value report read (see ``node/metrics.py``)."""
        return {
            "counters": dict(self.counters),
            "l1_bytes": self.l1.used_bytes,
            "l1_capacity_bytes": self.l1.capacity_bytes,
            "l1_chunks": len(self.l1),
            "pinned_keys": len(self.pins),
            "held_keys": len(self.holds),
            "outbox": self._sink_stats(),
            "coordinator_failures": self.coordinator_failures(),
        }

    def tier_gauges(self) -> dict[str, int]:
        """The tiers as a value report carries them: L1 now; L2 as written by this node
        (an L2 may be shared and evicts on its own: its size is not this node's to know)."""
        return {
            "l1_bytes": self.l1.used_bytes,
            "l1_capacity_bytes": self.l1.capacity_bytes,
            "l1_chunks": len(self.l1),
            "l2_bytes": self.counters["l2_bytes_written"],
            "l2_chunks": self.counters["l2_chunks_written"],
        }

    # ------------------------------------------------------------------ resync

    def resync_driver(
        self, exchange: DigestExchange, *, interval: float, settle: Any = None, lost: Any = None
    ) -> ResyncDriver | None:
        """Digest exchanges over this node's own tiers (:meth:`TierWrites.resync_driver`)."""
        return self.writes.resync_driver(exchange, interval=interval, settle=settle, lost=lost)

    # ------------------------------------------------------------------ lifecycle

    def flush_events(self) -> None:
        if self.emitter is not None:
            self.emitter.flush()

    def stats(self) -> NodeStats:
        return NodeStats(
            instance_id=self.instance_id,
            l1_chunks=len(self.l1),
            l1_bytes=self.l1.used_bytes,
            local_index=self.index.stats(),
            token_cache=self.token_cache.stats(),
            counters=dict(self.counters),
            event_sink=self._sink_stats(),
        )

    def _sink_stats(self) -> dict[str, int] | None:
        """The sink's own counters, when it keeps them (an :class:`~kvatlas.client.EventSink`)."""
        read = getattr(self._sink, "stats", None)
        stats = read() if callable(read) else None
        return asdict(stats) if is_dataclass(stats) and not isinstance(stats, type) else None

    def close(self) -> None:
        if self.pool_journal is not None:
            self.pool_journal.stop()
        if self.emitter is not None:
            self.emitter.close()
        if self.l2 is not None:
            self.l2.close()


__all__ = [
    "BlendRetrieval",
    "CacheNode",
    "Deleted",
    "HeldPlacement",
    "NodeStats",
    "Retrieved",
]
