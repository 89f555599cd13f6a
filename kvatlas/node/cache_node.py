"""CacheNode: the engine-facing cache — store, prefix lookup and retrieval, blend lookup and
blend retrieval with re-RoPE — always keyed through the request tracker (``docs/node.md``).

Orchestration only: tier membership and the local index live in :mod:`kvatlas.node.presence`,
reads across tiers in :mod:`kvatlas.node.tiered_fetch`, the blend lookup in
:mod:`kvatlas.node.unified_lookup`; this module stores, reports events and verifies.

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
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

import numpy as np

from kvatlas.client import FleetMatcher
from kvatlas.directory import BlendIndex, BlendStats
from kvatlas.errors import Unprocessable
from kvatlas.events import ACCESS, DELETE, STORE, CacheEntry
from kvatlas.keys import (
    BlendNamespace,
    MMItem,
    ObjectKey,
    RequestTracker,
    TokenArray,
    check_instance_id,
)
from kvatlas.logs import Throttle
from kvatlas.node.chunk_digest import rejection
from kvatlas.node.config import NodeConfig
from kvatlas.node.emitter import BatchSink, EventEmitter
from kvatlas.node.fleet_view import FleetView
from kvatlas.node.inventory import DigestExchange, NodeInventory, ResyncDriver, resync_sender
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend, L2Unavailable
from kvatlas.node.presence import L1, L2, Presence, Tier
from kvatlas.node.rope import rerope_k
from kvatlas.node.segments import Segment
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.tiered_fetch import Fetched, TieredFetch
from kvatlas.node.token_cache import TokenCache, TokenCacheStats
from kvatlas.node.unified_lookup import LookupResult, UnifiedBlendLookup

log = logging.getLogger(__name__)

L1_BACKEND = "dram"


@dataclass
class Retrieved:
    """Prefix retrieval: the KV of the leading chunks that could be found, in order."""

    kv: list[Any]
    hit_tokens: int
    sources: Counter[str] = field(default_factory=Counter)


@dataclass
class BlendRetrieval:
    """Blend retrieval: re-RoPE'd KV per reused segment; misses are reported, not fatal."""

    parts: list[tuple[Segment, Any]]
    misses: list[Segment]
    sources: Counter[str] = field(default_factory=Counter)

    @property
    def reused_tokens(self) -> int:
        return sum(seg.length for seg, _ in self.parts)


@dataclass(frozen=True, slots=True)
class NodeStats:
    """A node's state at one instant. ``local_index`` is the local blend index's stats;
    ``counters`` what the node counted (stores, refusals, misses, ...; a counter appears once
    it was first counted)."""

    instance_id: str
    l1_chunks: int
    l1_bytes: int
    local_index: BlendStats
    token_cache: TokenCacheStats
    counters: Mapping[str, int]
    event_sink: Mapping[str, int] | None = None
    """The event sink's counters (sent, dropped, quarantined, auth failures, splits, ...), if
    the sink keeps any (see docs/node.md)."""

    def to_wire(self) -> dict[str, Any]:
        """The engine API's ``/engine/stats`` reply: the counters flat beside the fields."""
        return {
            "instance_id": self.instance_id,
            "l1_chunks": self.l1_chunks,
            "l1_bytes": self.l1_bytes,
            "local_index": asdict(self.local_index),
            "token_cache": asdict(self.token_cache),
            **({"event_sink": dict(self.event_sink)} if self.event_sink is not None else {}),
            **self.counters,
        }


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
        self.scheme = config.scheme
        self.chunk_size = config.chunk_size
        self.l1 = L1Cache(config.l1_bytes, on_evict=self._on_l1_evict)
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
        self.tiers = TieredFetch(
            self.l1,
            l2,
            fleet,
            instance_id=self.instance_id,
            layout=self.layout,
            on_l1_hit=self._l1_accessed,
            counters=self.counters,
        )
        self.blend = UnifiedBlendLookup(
            self.index,
            fleet_matcher,
            chunk_size=config.chunk_size,
            deadline_s=config.coordinator_blend_timeout,
            prefer_cheaper=config.prefer_cheaper,
            cost_of=self.presence.cost_of,
            allow_trim=config.allow_trim,
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
            self._put_l1(StoredChunk(key, kv, chunk_tokens, i * c, self.layout.dtype))
            stored += 1
        self.counters["chunks_stored"] += stored
        return stored

    def _check_kv(self, kv: Any) -> None:
        shape = tuple(kv.shape)
        if shape != self.layout.shape:
            raise Unprocessable(
                f"KV chunk shape {shape} does not match the layout {self.layout.shape}"
            )

    def _put_l1(self, chunk: StoredChunk) -> None:
        if self.l1.contains(chunk.key):
            self.l1.get(chunk.key)  # moves it to the LRU's recent end
            self._l1_accessed(chunk.key)
            return
        rejected = self.l1.put(chunk)
        if any(r is chunk for r in rejected):
            self.counters["l1_rejected"] += 1
        else:
            self._gain(chunk, L1)
            self._record(STORE, L1, L1_BACKEND, self._entry(chunk))
        if self.l2 is not None and self.config.l2_write == "through":
            self._put_l2(chunk)

    def _put_l2(self, chunk: StoredChunk) -> None:
        assert self.l2 is not None
        if self.l2.contains(chunk.key):
            return
        try:
            self.l2.put(chunk)
        except (L2Unavailable, OSError) as exc:
            self.counters["l2_write_failures"] += 1
            log.warning("L2 write failed for %s: %s", chunk.key.chunk_hash.hex()[:16], exc)
            return
        self._gain(chunk, L2)
        self._record(STORE, L2, self.l2.name, self._entry(chunk), shared=self.l2.shared)

    def _on_l1_evict(self, chunk: StoredChunk) -> None:
        self._record(DELETE, L1, L1_BACKEND, CacheEntry(chunk.key, chunk.nbytes))
        if self.l2 is not None and self.config.l2_write == "evict":
            self._put_l2(chunk)
        self.presence.lose(chunk.key, L1)

    def _l1_accessed(self, key: ObjectKey) -> None:
        self._record(ACCESS, L1, L1_BACKEND, CacheEntry(key, 0))

    def _gain(self, chunk: StoredChunk, tier: Tier) -> None:
        if chunk.tokens is not None:
            self.token_cache.remember(chunk.key.chunk_hash, chunk.tokens, chunk.token_offset)
        self.presence.gain(chunk, tier)

    def _entry(self, chunk: StoredChunk) -> CacheEntry:
        tokens, offset = chunk.tokens, chunk.token_offset
        if tokens is None:
            remembered = self.token_cache.lookup(chunk.key.chunk_hash)
            if remembered is not None:
                tokens, offset = remembered
            else:
                self.counters["events_without_tokens"] += 1
        return CacheEntry(chunk.key, chunk.nbytes, tokens, offset)

    def _record(
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

    # ------------------------------------------------------------------ prefix path

    def lookup(self, tracker: RequestTracker) -> int:
        """Prefix hit length in tokens: leading chunks retrievable from any tier."""
        if not tracker.cacheable:
            return 0
        keys = [self.key(h, tracker.cache_salt) for h in tracker.chunk_hashes()]
        return self.tiers.prefix_hits(keys) * self.chunk_size

    def retrieve(self, tracker: RequestTracker, num_tokens: int | None = None) -> Retrieved:
        """KV of the leading chunks (stops at the first chunk no tier has, or whose tokens
        are not the request's)."""
        if not tracker.cacheable:
            return Retrieved([], 0)
        hashes = tracker.chunk_hashes(num_tokens)
        tokens = tracker.get_token_ids()
        keys = [self.key(h, tracker.cache_salt) for h in hashes]
        found = self.tiers.fetch(keys)
        kv: list[Any] = []
        sources: Counter[str] = Counter()
        c = self.chunk_size
        for i, key in enumerate(keys):
            got = found.get(key)
            if got is None or not self._verified(key, got, tokens[i * c : (i + 1) * c]):
                break
            kv.append(got.chunk.kv)
            sources[got.source] += 1
        self.counters["prefix_chunks_retrieved"] += len(kv)
        return Retrieved(kv, len(kv) * self.chunk_size, sources)

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
            return LookupResult((), 0, 0, 0, False, False)
        try:
            return self.blend.poll(rid, prefix_len)
        except KeyError:
            self.blend.start(rid, tracker.get_token_ids(), self.namespace(tracker.cache_salt))
            return self.blend.poll(rid, prefix_len)

    def blend_retrieve(
        self, tracker: RequestTracker, segments: Sequence[Segment]
    ) -> BlendRetrieval:
        """Fetch every segment in one batched step, verify its key and tokens, re-RoPE it to
        the request's positions; a segment that cannot be served is a counted miss."""
        tokens = tracker.get_token_ids()
        keys = [self.key(s.chunk_hash, tracker.cache_salt) for s in segments]
        found = self.tiers.fetch(keys) if tracker.cacheable else {}
        parts: list[tuple[Segment, Any]] = []
        misses: list[Segment] = []
        sources: Counter[str] = Counter()
        c = self.chunk_size
        for seg, key in zip(segments, keys, strict=True):
            got = found.get(key)
            start = seg.chunk_cur_st
            window = tokens[start : start + c]
            if (
                got is None
                or seg.trim + seg.length > c  # its used part must lie inside the chunk
                or got.chunk.token_offset < 0
                or len(window) != c
                or not self._verified(key, got, window)
            ):
                misses.append(seg)
                continue
            chunk = got.chunk
            kv = rerope_k(chunk.kv, self.layout, chunk.token_offset, start)
            if seg.trim or seg.length != c:
                kv = kv[:, :, seg.kv_slice]
            parts.append((seg, kv))
            sources[got.source] += 1
        self.counters["segments_reused"] += len(parts)
        self.counters["segment_misses"] += len(misses)
        return BlendRetrieval(parts, misses, sources)

    # ------------------------------------------------------------------ resync

    def inventory(self) -> list[tuple[ObjectKey, str, str]]:
        """``(key, tier, backend)`` of every placement this node holds on its own tiers."""
        return self.own.placements()

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
        if self.emitter is not None:
            self.emitter.close()
        if self.l2 is not None:
            self.l2.close()
