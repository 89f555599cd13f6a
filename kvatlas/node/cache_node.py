"""CacheNode: the engine-facing cache (node.md §6) — store, prefix lookup and retrieval, blend
lookup and blend retrieval with re-RoPE — always keyed through the request tracker.

Every key-carrying path takes its tokens from :class:`~kvatlas.keys.RequestTracker`; an
uncacheable tracker (multimodal items without identity) gets no lookup and no store.

Safety rules that go beyond "the hash matched":

* a chunk fetched for a blend segment is used only if its stored tokens equal the request's
  tokens at the segment's position (a stale or foreign chunk becomes a miss, never wrong KV);
* re-RoPE starts from the fetched chunk's own ``token_offset`` (where its KV was computed),
  not from an index's idea of it; a chunk with unknown offset is a miss.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvatlas.client.blend_client import FleetMatcher
from kvatlas.directory import BlendIndex
from kvatlas.events import CacheEntry
from kvatlas.keys import BlendNamespace, MMItem, ObjectKey, RequestTracker
from kvatlas.node.config import NodeConfig
from kvatlas.node.emitter import BatchSink, EventEmitter
from kvatlas.node.fleet_view import FleetView
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend, L2Unavailable
from kvatlas.node.rope import rerope_k
from kvatlas.node.segments import Placement, Segment
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.token_cache import TokenCache
from kvatlas.node.unified_lookup import LookupResult, UnifiedBlendLookup

log = logging.getLogger("kvatlas.node")

L1_BACKEND = "dram"
TOKEN_AXIS = 2  # [layers, 2, tokens, heads, head_dim]


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


@dataclass
class _Presence:
    tiers: set[str]
    tokens: Any
    token_offset: int


class CacheNode:
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
        self.instance_id = instance_id or config.instance_id or f"node-{uuid.uuid4().hex[:12]}"
        self.layout = config.layout
        self.scheme = config.scheme
        self.chunk_size = config.chunk_size
        self.l1 = L1Cache(config.l1_bytes, on_evict=self._on_l1_evict)
        self.l2 = l2
        self.fleet = fleet
        self.emitter = EventEmitter(sink) if sink is not None else None
        self.token_cache = TokenCache(config.token_cache_chunks)
        self.index = BlendIndex(config.chunk_size)
        self.blend = UnifiedBlendLookup(
            self.index,
            fleet_matcher,
            chunk_size=config.chunk_size,
            deadline_s=config.coordinator_blend_timeout,
            prefer_cheaper=config.prefer_cheaper,
            cost_of=self._cost_of,
            allow_trim=config.allow_trim,
        )
        self._presence: dict[ObjectKey, _Presence] = {}
        self._tiers_by_hash: dict[bytes, Counter[str]] = {}
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()

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
            self._put_l1(StoredChunk(key, kv, chunk_tokens, i * c))
            stored += 1
        self.counters["chunks_stored"] += stored
        return stored

    def _check_kv(self, kv: Any) -> None:
        shape = tuple(kv.shape)
        if shape != self.layout.shape:
            raise ValueError(
                f"KV chunk shape {shape} does not match the layout {self.layout.shape}"
            )

    def _put_l1(self, chunk: StoredChunk) -> None:
        if self.l1.contains(chunk.key):
            self.l1.get(chunk.key)  # touch
            self._record("access", "l1", L1_BACKEND, CacheEntry(chunk.key, 0))
            return
        rejected = self.l1.put(chunk)
        if any(r is chunk for r in rejected):
            self.counters["l1_rejected"] += 1
        else:
            self._gain(chunk, "l1")
            self._record("store", "l1", L1_BACKEND, self._entry(chunk))
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
        self._gain(chunk, "l2")
        self._record("store", "l2", self.l2.name, self._entry(chunk), shared=self.l2.shared)

    def _on_l1_evict(self, chunk: StoredChunk) -> None:
        self._record("delete", "l1", L1_BACKEND, CacheEntry(chunk.key, chunk.nbytes))
        if self.l2 is not None and self.config.l2_write == "evict":
            self._put_l2(chunk)
        self._lose(chunk.key, "l1")

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
        if self.emitter is not None:
            self.emitter.record(event_type, tier, backend, entry, shared=shared)

    # The local matcher indexes what this node can serve itself (its L1 and its own L2 writes).

    def _gain(self, chunk: StoredChunk, tier: str) -> None:
        key = chunk.key
        tokens = chunk.tokens
        if tokens is not None:
            self.token_cache.remember(key.chunk_hash, tokens, chunk.token_offset)
        with self._lock:
            record = self._presence.get(key)
            if record is None:
                record = self._presence[key] = _Presence(set(), tokens, chunk.token_offset)
                indexable = (
                    tokens is not None
                    and len(tokens) == self.chunk_size
                    and chunk.token_offset >= 0
                )
                if indexable:
                    self.index.add(
                        tokens, key.chunk_hash, chunk.token_offset, self.namespace(key.cache_salt)
                    )
            if tier not in record.tiers:
                record.tiers.add(tier)
                self._tiers_by_hash.setdefault(key.chunk_hash, Counter())[tier] += 1

    def _lose(self, key: ObjectKey, tier: str) -> None:
        with self._lock:
            record = self._presence.get(key)
            if record is None:
                return
            if tier not in record.tiers:
                return
            record.tiers.discard(tier)
            by_hash = self._tiers_by_hash[key.chunk_hash]
            by_hash[tier] -= 1
            if by_hash.total() <= 0:
                del self._tiers_by_hash[key.chunk_hash]
            if record.tiers:
                return
            del self._presence[key]
            if record.tokens is not None and record.token_offset >= 0:
                self.index.remove_claim(
                    record.tokens, key.chunk_hash, self.namespace(key.cache_salt)
                )

    def _cost_of(self, segment: Segment) -> int:
        with self._lock:
            record = (
                next(
                    (r for k, r in self._presence.items() if k.chunk_hash == segment.chunk_hash),
                    None,
                )
                if len(self._presence) < 64
                else None
            )
        if record is None:
            return int(Placement.PEER_L1 if segment.source == "fleet" else Placement.UNKNOWN)
        return int(Placement.LOCAL_L1 if "l1" in record.tiers else Placement.SHARED_L2)

    # ------------------------------------------------------------------ fetch (all tiers)

    def _fetch(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, tuple[StoredChunk, str]]:
        """One batched step across local L1, local/shared L2 and peer L1s; absent = miss."""
        found: dict[ObjectKey, tuple[StoredChunk, str]] = {}
        missing: list[ObjectKey] = []
        for key in keys:
            chunk = self.l1.get(key)
            if chunk is not None:
                found[key] = (chunk, "local_l1")
                self._record("access", "l1", L1_BACKEND, CacheEntry(key, 0))
            else:
                missing.append(key)
        if missing and self.l2 is not None:
            got = self.l2.get_many(missing)
            for key, chunk in got.items():
                if self._usable(chunk):
                    found[key] = (chunk, "l2")
            missing = [k for k in missing if k not in found]
        if missing and self.fleet is not None:
            holders = self.fleet.holders(missing)
            by_peer: dict[str, list[ObjectKey]] = {}
            for key, placements in zip(missing, holders, strict=False):
                for holder in placements:
                    if (
                        holder.tier == "l1"
                        and not holder.shared
                        and holder.instance_id != self.instance_id
                    ):
                        by_peer.setdefault(holder.instance_id, []).append(key)
                        break
            for instance_id, peer_keys in by_peer.items():
                peer = self.fleet.peer(instance_id)
                if peer is None:
                    continue
                for key, chunk in peer.fetch(peer_keys).items():
                    if key in peer_keys and self._usable(chunk):
                        found[key] = (chunk, "peer_l1")
        return found

    def _usable(self, chunk: StoredChunk) -> bool:
        ok = tuple(chunk.kv.shape) == self.layout.shape and chunk.kv_dtype == self.layout.dtype
        if not ok:
            self.counters["fetched_wrong_layout"] += 1
        return ok

    # ------------------------------------------------------------------ prefix path

    def lookup(self, tracker: RequestTracker) -> int:
        """Prefix hit length in tokens: leading chunks retrievable from any tier."""
        if not tracker.cacheable:
            return 0
        keys = [self.key(h, tracker.cache_salt) for h in tracker.chunk_hashes()]
        hit = 0
        for key in keys:
            if self.l1.contains(key) or (self.l2 is not None and self.l2.contains(key)):
                hit += 1
            else:
                break
        if hit < len(keys) and self.fleet is not None:
            rest = keys[hit:]
            for placements in self.fleet.holders(rest):
                if not any(h.instance_id != self.instance_id or h.shared for h in placements):
                    break
                hit += 1
        return hit * self.chunk_size

    def retrieve(self, tracker: RequestTracker, num_tokens: int | None = None) -> Retrieved:
        """KV of the leading chunks (stops at the first chunk no tier has)."""
        if not tracker.cacheable:
            return Retrieved([], 0)
        hashes = tracker.chunk_hashes(num_tokens)
        keys = [self.key(h, tracker.cache_salt) for h in hashes]
        found = self._fetch(keys)
        kv: list[Any] = []
        sources: Counter[str] = Counter()
        for key in keys:
            got = found.get(key)
            if got is None:
                break
            kv.append(got[0].kv)
            sources[got[1]] += 1
        self.counters["prefix_chunks_retrieved"] += len(kv)
        return Retrieved(kv, len(kv) * self.chunk_size, sources)

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
        """Fetch every segment in one batched step, verify its tokens, re-RoPE it to the
        request's positions; a segment that cannot be served is a counted miss."""
        tokens = tracker.get_token_ids()
        keys = [self.key(s.chunk_hash, tracker.cache_salt) for s in segments]
        found = self._fetch(keys) if tracker.cacheable else {}
        parts: list[tuple[Segment, Any]] = []
        misses: list[Segment] = []
        sources: Counter[str] = Counter()
        c = self.chunk_size
        for seg, key in zip(segments, keys, strict=True):
            got = found.get(key)
            chunk = got[0] if got else None
            start = seg.chunk_cur_st
            window = tokens[start : start + c]
            if (
                chunk is None
                or chunk.tokens is None
                or chunk.token_offset < 0
                or len(window) != c
                or not np.array_equal(chunk.tokens, window)
            ):
                misses.append(seg)
                continue
            kv = rerope_k(chunk.kv, self.layout, chunk.token_offset, start)
            if seg.trim or seg.length != c:
                kv = kv[:, :, seg.kv_slice]
            parts.append((seg, kv))
            assert got is not None
            sources[got[1]] += 1
        self.counters["segments_reused"] += len(parts)
        self.counters["segment_misses"] += len(misses)
        return BlendRetrieval(parts, misses, sources)

    # ------------------------------------------------------------------ lifecycle

    def flush_events(self) -> None:
        if self.emitter is not None:
            self.emitter.flush()

    def stats(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "l1_chunks": len(self.l1),
            "l1_bytes": self.l1.used_bytes,
            "local_index": asdict(self.index.stats()),
            "token_cache": {"chunks": len(self.token_cache), "misses": self.token_cache.misses},
            **dict(self.counters),
        }

    def close(self) -> None:
        if self.emitter is not None:
            self.emitter.close()
        if self.l2 is not None:
            self.l2.close()
