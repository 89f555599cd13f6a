"""The virtual fleet's kvatlas nodes: what a ``kvatlas node`` does for its engine's connector,
with chunk presence instead of KV bytes.

One node per engine, an L1 of ``l1_chunks`` (least recently used out first) and one L2 pool
shared by every node (``l2_chunks``; 0: unbounded), written through on every store as the
node's default ``--l2-write through`` does. The calls are the node's engine API:

- ``retrieve`` (``/engine/retrieve``): the leading chunks, each from the cheapest source the
  node's tiered fetch reads first — its own L1, a peer's L1, then the pool; stops at the first
  chunk no source has;
- ``blend`` (``/engine/blend-lookup`` + ``/engine/blend-retrieve``): the fleet's blend matches
  (the real blend index, through the directory) after the prefix, cut and overlap-resolved by
  the node's own functions (:mod:`kvatlas.node.segments`, cheaper copies preferred), each
  segment fetched as above (one nobody can fetch, e.g. a chunk only an engine's GPU holds, is
  a miss, as on a real node);
- ``store`` (``/engine/store``): the prompt's full chunks into L1 and the pool, each change
  reported to the directory as the node's emitter would (stores carry tokens and offsets, so
  the blend index learns them).

Every source a real node reads is here; what is not is its wire (HTTP, re-RoPE, bytes).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Final

import numpy as np

from kvatlas.bench.fleet.sim_coordinator import L1_BACKEND, POOL_BACKEND, SimCoordinator
from kvatlas.events import CONFIG, DELETE, STORE, CacheEntry
from kvatlas.keys import ObjectKey
from kvatlas.node.segments import FetchCost, Segment, filter_prefix, merge_union, resolve_overlaps

LOCAL_L1: Final = "local_l1"
PEER_L1: Final = "peer_l1"
L2: Final = "l2"


class SharedPool:
    """The fleet's L2: chunk hashes, least recently used out first when bounded."""

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity = capacity_chunks
        self.chunks: OrderedDict[bytes, str] = OrderedDict()  # hash -> the node that wrote it

    def __contains__(self, chunk_hash: bytes) -> bool:
        return chunk_hash in self.chunks

    def touch(self, chunk_hash: bytes) -> None:
        if self.capacity:
            self.chunks.move_to_end(chunk_hash)

    def put(self, chunk_hash: bytes, writer: str) -> list[tuple[bytes, str]]:
        """Adds ``chunk_hash``; returns what the pool evicted for it (hash, writer)."""
        self.chunks[chunk_hash] = writer
        out: list[tuple[bytes, str]] = []
        while self.capacity and len(self.chunks) > self.capacity:
            out.append(self.chunks.popitem(last=False))
        return out


class SimNode:
    def __init__(self, node_id: str, l1_chunks: int, pool: SharedPool, coordinator: SimCoordinator,
                 chunk_bytes: int) -> None:  # fmt: skip
        self.node_id = node_id
        self.l1_capacity = l1_chunks
        self.l1: OrderedDict[bytes, None] = OrderedDict()
        self.pool = pool
        self.coordinator = coordinator
        self.chunk_bytes = chunk_bytes
        self.peers: list[SimNode] = []
        self.wrote: set[bytes] = set()  # pool chunks this node wrote (its presence in L2)
        self.counts: Counter[str] = Counter()

    def announce(self, ts: float) -> None:
        """The node's first batch: its L1 capacity (as ``CacheNode._announce``)."""
        self.coordinator.node_batch(self.node_id, CONFIG, "l1", L1_BACKEND, (), ts,
                                    capacity_bytes=self.l1_capacity * self.chunk_bytes)  # fmt: skip

    # ------------------------------------------------------------------ fetch

    def _source(self, chunk_hash: bytes) -> str | None:
        """Where the node's tiered fetch finds a chunk (and the LRU touch it causes)."""
        if chunk_hash in self.l1:
            self.l1.move_to_end(chunk_hash)
            return LOCAL_L1
        for peer in self.peers:
            if chunk_hash in peer.l1:
                peer.l1.move_to_end(chunk_hash)
                return PEER_L1
        if chunk_hash in self.pool:
            self.pool.touch(chunk_hash)
            return L2
        return None

    def retrieve(self, chunk_hashes: Sequence[bytes]) -> dict[str, int]:
        """The prefix: chunks per source of the leading chunks some source has."""
        sources: Counter[str] = Counter()
        for h in chunk_hashes:
            source = self._source(h)
            if source is None:
                break
            sources[source] += 1
        self.counts["prefix_chunks"] += sum(sources.values())
        return dict(sources)

    def _cost(self, segment: Segment) -> int:
        """``Presence.cost_of``: own L1, own copy in the pool, else what the fleet knows."""
        if segment.chunk_hash in self.l1:
            return FetchCost.LOCAL_L1
        if segment.chunk_hash in self.wrote:
            return FetchCost.SHARED_L2
        return FetchCost.PEER_L1 if segment.source == "fleet" else FetchCost.UNKNOWN

    def blend(self, tokens: np.ndarray, prefix_len: int, chunk_size: int
              ) -> tuple[list[tuple[int, int]], dict[str, int]]:  # fmt: skip
        """Fragments after ``prefix_len`` as ``(start, length)`` and chunks per source."""
        fleet = self.coordinator.blend_match(tokens)
        local = [m for m in fleet if m.chunk_hash in self.l1 or m.chunk_hash in self.wrote]
        segments = filter_prefix(merge_union(local, fleet), prefix_len, chunk_size, False)
        for i, seg in enumerate(segments):
            segments[i] = Segment(seg.chunk_hash, seg.old_st, seg.cur_st, seg.length,
                                  seg.source, self._cost(seg), seg.trim)  # fmt: skip
        spans: list[tuple[int, int]] = []
        sources: Counter[str] = Counter()
        for seg in resolve_overlaps(segments, prefer_cheaper=True):
            source = self._source(seg.chunk_hash)
            if source is None:
                self.counts["segment_misses"] += 1
                continue
            sources[source] += 1
            spans.append((seg.cur_st, seg.length))
        self.counts["fragment_chunks"] += len(spans)
        return [(s, n) for s, n in sorted(spans) if s >= prefix_len], dict(sources)

    # ------------------------------------------------------------------ store

    def store(self, keys: Sequence[ObjectKey], tokens: np.ndarray, chunk_size: int,
              ts: float) -> None:  # fmt: skip
        """The prompt's full chunks (``keys``, one per chunk of ``tokens``)."""
        l1_new: list[CacheEntry] = []
        l1_gone: list[CacheEntry] = []
        l2_new: list[CacheEntry] = []
        l2_gone: dict[str, list[CacheEntry]] = {}
        by_hash = {k.chunk_hash: k for k in keys}
        for i, key in enumerate(keys):
            h = key.chunk_hash
            chunk_tokens = None
            if h in self.l1:
                self.l1.move_to_end(h)
            else:
                self.l1[h] = None
                chunk_tokens = tokens[i * chunk_size : (i + 1) * chunk_size]
                l1_new.append(CacheEntry(key, self.chunk_bytes, chunk_tokens, i * chunk_size))
                while len(self.l1) > self.l1_capacity:
                    old, _ = self.l1.popitem(last=False)
                    l1_gone.append(CacheEntry(by_hash.get(old) or self._key(old), 0))
                    self.counts["l1_evictions"] += 1
            if h not in self.pool:
                if chunk_tokens is None:
                    chunk_tokens = tokens[i * chunk_size : (i + 1) * chunk_size]
                for old, writer in self.pool.put(h, self.node_id):
                    l2_gone.setdefault(writer, []).append(CacheEntry(self._key(old), 0))
                self.wrote.add(h)
                l2_new.append(CacheEntry(key, self.chunk_bytes, chunk_tokens, i * chunk_size))
        self.counts["stored_chunks"] += len(keys)
        # the emitter's order: the L1 store (its evictions as they happened), then L2
        c = self.coordinator
        c.node_batch(self.node_id, STORE, "l1", L1_BACKEND, l1_new, ts)
        c.node_batch(self.node_id, DELETE, "l1", L1_BACKEND, l1_gone, ts)
        c.node_batch(self.node_id, STORE, "l2", POOL_BACKEND, l2_new, ts, shared=True)
        for writer in sorted(l2_gone):
            gone = l2_gone[writer]
            self.counts["l2_evictions"] += len(gone)
            for node in (self, *self.peers):
                if node.node_id == writer:
                    node.wrote.difference_update(e.key.chunk_hash for e in gone)
            c.node_batch(writer, DELETE, "l2", POOL_BACKEND, gone, ts, shared=True)

    def _key(self, chunk_hash: bytes) -> ObjectKey:
        return self.coordinator.keys([chunk_hash])[0]
