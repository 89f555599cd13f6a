"""Blend retrieval: the KV of a blend lookup's segments, fetched in one batched step from any
tier, verified (key and tokens, by the node's check) and re-RoPEd from the chunk's own
``token_offset`` to the request's positions (``docs/node.md``).

A segment that cannot be served is a miss counted by cause (``segment_miss_*``), never wrong
KV: not found, a used part ``[trim, trim + length)`` outside the chunk (segments also arrive
over the engine API), a chunk of unknown offset, a window shorter than a chunk, or a chunk the
check refused. Each request's fragment hits count once, however often it retrieves them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvatlas.keys import ObjectKey, RequestTracker, TokenArray
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.metrics import NodeTimings, hit_tokens
from kvatlas.node.results import BlendRetrieval
from kvatlas.node.rope import rerope_k
from kvatlas.node.segments import Segment
from kvatlas.node.tiered_fetch import Fetched, TieredFetch


class BlendRetriever:
    """One node's blend retrievals (see the module docstring)."""

    def __init__(
        self,
        *,
        tiers: TieredFetch,
        layout: KVLayout,
        chunk_size: int,
        counters: Counter[str],
        timings: NodeTimings,
        key: Callable[[bytes, str], ObjectKey],
        verified: Callable[[ObjectKey, Fetched, TokenArray], bool],
    ) -> None:
        self.tiers = tiers
        self.layout = layout
        self.chunk_size = chunk_size
        self.counters = counters
        self.timings = timings
        self.key = key
        self.verified = verified
        self._fragments_counted: weakref.WeakKeyDictionary[RequestTracker, set[int]] = (
            weakref.WeakKeyDictionary()
        )  # each request's fragment hits count once, however often it retrieves them
        self._fragments_lock = threading.Lock()

    def retrieve(self, tracker: RequestTracker, segments: Sequence[Segment]) -> BlendRetrieval:
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
            cause = _segment_miss(seg, got, c, len(window))
            if cause is None and got is not None and not self.verified(key, got, window):
                cause = "rejected"
            if cause is not None or got is None:
                self.counters[f"segment_miss_{cause}"] += 1
                misses.append(seg)
                continue
            chunk = got.chunk
            started = time.perf_counter()
            kv = rerope_k(chunk.kv, self.layout, chunk.token_offset, start)
            self.timings.rerope_seconds.observe(time.perf_counter() - started)
            if seg.trim or seg.length != c:
                kv = kv[:, :, seg.kv_slice]
            parts.append((seg, kv))
            sources[got.source] += 1
        self.counters["segments_reused"] += len(parts)
        self.counters["segment_misses"] += len(misses)
        with self._fragments_lock:
            counted = self._fragments_counted.setdefault(tracker, set())
            new = [seg for seg, _ in parts if seg.cur_st not in counted]
            counted.update(seg.cur_st for seg in new)
        self.counters[hit_tokens("fragment")] += sum(seg.length for seg in new)
        return BlendRetrieval(parts, misses, sources)


def _segment_miss(seg: Segment, got: Fetched | None, chunk_size: int, window: int) -> str | None:
    """Why a blend segment cannot be served from ``got`` before verification, or ``None``."""
    if got is None:
        return "not_found"
    if seg.trim + seg.length > chunk_size:  # its used part must lie inside the chunk
        return "outside_chunk"
    if got.chunk.token_offset < 0:
        return "unknown_offset"
    return "short_window" if window != chunk_size else None


__all__ = ["BlendRetriever"]
