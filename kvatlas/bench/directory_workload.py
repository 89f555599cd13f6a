"""The directory benchmark's workload and its naive reference (``bench directory``): token-bearing
store batches as a node reports them, and the dict-of-dicts directory a competent engineer
writes first, which every row is measured against."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.workloads import LLAMA3, Vocabulary, random_token_ids

CHUNK = 256
BATCH = 256
MODEL = "model"
"""The workload's model name: its chunks' blend namespace is ``(MODEL, "", 1)``."""


def workload(
    n: int, seed: int, instance: str = "node-0", vocab: Vocabulary = LLAMA3, batch: int = BATCH
) -> list[EventBatch]:
    """``n`` token-bearing L1 store entries (one rank, distinct 256-token chunks, ids from
    ``vocab``) in batches of ``batch``."""
    rng = np.random.default_rng(seed)
    rank = pack_kv_rank(1, 0, 1, 0)
    batches = []
    for b, start in enumerate(range(0, n, batch)):
        count = min(batch, n - start)
        tokens = random_token_ids(rng, (count, CHUNK), vocab)
        hashes = rng.bytes(32 * count)
        entries = []
        for i in range(count):
            arr = tokens[i].copy()  # decoded bodies give each content its own array
            arr.flags.writeable = False
            h = hashes[32 * i : 32 * i + 32]
            entries.append(CacheEntry(ObjectKey(h, MODEL, rank), 65536, arr, (start + i) * CHUNK))
        batches.append(
            EventBatch(instance, 1, b + 1, "store", "l1", "dram", False, 0.0, tuple(entries))
        )
    return batches


class NaiveDirectory:
    """The reference's design: per-entry dict-of-dicts placements, tuple-of-ints token
    bindings, a dict-of-sets per-namespace claim map and a content-keyed dict index."""

    def __init__(self, blend: bool = True) -> None:
        self.blend = blend
        self.cursors: dict[str, tuple[int, int]] = {}
        self.placements: dict[ObjectKey, dict[tuple[str, str, str], dict[str, Any]]] = {}
        self.bindings: dict[bytes, dict[str, Any]] = {}
        self.index: dict[tuple[int, ...], dict[bytes, int]] = {}

    def consume(self, batch: EventBatch) -> None:
        cur = self.cursors.get(batch.instance_id)
        if cur is not None and (batch.incarnation, batch.seq) <= cur:
            return
        self.cursors[batch.instance_id] = (batch.incarnation, batch.seq)
        for e in batch.entries:
            ident = (batch.instance_id, batch.tier, batch.backend)
            self.placements.setdefault(e.key, {})[ident] = {
                "instance_id": batch.instance_id,
                "incarnation": batch.incarnation,
                "tier": batch.tier,
                "backend": batch.backend,
                "size": e.size_bytes,
                "shared": batch.shared,
                "ts": batch.ts,
            }
            if e.token_ids is not None:
                tokens = tuple(e.token_ids.tolist())
                ns = (e.key.model_name, e.key.cache_salt, e.key.world_size)
                binding = self.bindings.setdefault(
                    e.key.chunk_hash, {"tokens": tokens, "offset": e.token_offset, "keys": {}}
                )
                binding["keys"].setdefault(ns, set()).add(e.key)
                if self.blend and e.token_offset >= 0 and len(tokens) == CHUNK:
                    self.index.setdefault(tokens, {})[e.key.chunk_hash] = e.token_offset

    def lookup(self, keys: list[ObjectKey]) -> list[tuple[ObjectKey, list[Any], Any]]:
        """Each key's placements and its chunk's bound token ids (``None``: none)."""
        out = []
        for k in keys:
            held = self.placements.get(k)
            binding = self.bindings.get(k.chunk_hash) if held else None
            out.append(
                (k, [] if held is None else list(held.values()), binding and binding["tokens"])
            )
        return out


def median_time(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def consume_all(target: Any, batches: list[EventBatch]) -> None:
    for b in batches:
        target.consume(b)
