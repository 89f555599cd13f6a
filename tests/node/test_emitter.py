"""EventEmitter: batching by kind without reordering, size and age flushes; token cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.events import CacheEntry
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.emitter import EventEmitter
from kvatlas.node.token_cache import TokenCache
from tests.conftest import wait_for


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[tuple[str, str, str, bool, list[CacheEntry]]] = []

    def emit(
        self,
        event_type: str,
        tier: str,
        backend: str,
        entries: list[CacheEntry],
        *,
        shared: bool = False,
    ) -> bool:
        self.batches.append((event_type, tier, backend, shared, list(entries)))
        return True


def entry(i: int) -> CacheEntry:
    return CacheEntry(ObjectKey(bytes([i]) * 32, "m", pack_kv_rank(1, 0, 1, 0)), i)


def test_consecutive_same_kind_share_a_batch_and_order_is_kept() -> None:
    sink = RecordingSink()
    emitter = EventEmitter(sink, max_entries=100, max_delay_s=60)
    emitter.record("store", "l1", "dram", entry(1))
    emitter.record("store", "l1", "dram", entry(2))
    emitter.record("delete", "l1", "dram", entry(1))  # closes the store batch first
    emitter.record("store", "l2", "fs", entry(3), shared=True)
    emitter.record("store", "l1", "dram", entry(4))
    emitter.close()
    kinds = [(b[0], b[1], b[2], b[3], [e.size_bytes for e in b[4]]) for b in sink.batches]
    assert kinds == [
        ("store", "l1", "dram", False, [1, 2]),
        ("delete", "l1", "dram", False, [1]),
        ("store", "l2", "fs", True, [3]),
        ("store", "l1", "dram", False, [4]),
    ]


def test_size_flush() -> None:
    sink = RecordingSink()
    emitter = EventEmitter(sink, max_entries=3, max_delay_s=60)
    for i in range(7):
        emitter.record("store", "l1", "dram", entry(i))
    assert [len(b[4]) for b in sink.batches] == [3, 3]
    emitter.close()
    assert [len(b[4]) for b in sink.batches] == [3, 3, 1]


def test_age_flush_without_further_events() -> None:
    sink = RecordingSink()
    emitter = EventEmitter(sink, max_entries=1000, max_delay_s=0.05)
    emitter.record("store", "l1", "dram", entry(1))
    assert wait_for(lambda: len(sink.batches) == 1)
    emitter.close()
    assert emitter.batches_emitted == 1 and emitter.entries_emitted == 1


def test_token_cache_is_bounded_and_counts_misses() -> None:
    cache = TokenCache(max_chunks=2)
    tokens: Any = np.arange(4, dtype=np.uint32)
    for i in range(3):
        cache.remember(bytes([i]) * 32, tokens, i)
    assert len(cache) == 2
    assert cache.lookup(bytes([0]) * 32) is None  # the oldest fell out
    assert cache.lookup(bytes([2]) * 32) == (tokens, 2)
    assert (cache.hits, cache.misses) == (1, 1)
