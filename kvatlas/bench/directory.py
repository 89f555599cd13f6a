"""Directory benchmark: consume rate and memory (token-bearing stores, blend on), snapshot pause
and restore rate — against a naive dict-of-dicts, tuple-of-ints reference in the same run."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvatlas.bench.common import BenchRow, add_common_arguments, report
from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank

CHUNK = 256
BATCH = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--entries", type=int, default=None, help="store entries to consume")
    parser.add_argument("--snapshot-keys", type=int, default=None, help="keys for snapshot cases")


def _workload(n: int, seed: int, instance: str = "node-0") -> list[EventBatch]:
    """``n`` token-bearing L1 store entries (one rank, distinct 256-token chunks)."""
    rng = np.random.default_rng(seed)
    rank = pack_kv_rank(1, 0, 1, 0)
    batches = []
    for b, start in enumerate(range(0, n, BATCH)):
        count = min(BATCH, n - start)
        tokens = rng.integers(0, 50_000, size=(count, CHUNK), dtype=np.uint32)
        hashes = rng.bytes(32 * count)
        entries = []
        for i in range(count):
            arr = tokens[i].copy()  # decoded bodies give each content its own array
            arr.flags.writeable = False
            h = hashes[32 * i : 32 * i + 32]
            entries.append(CacheEntry(ObjectKey(h, "model", rank), 65536, arr, (start + i) * CHUNK))
        batches.append(
            EventBatch(instance, 1, b + 1, "store", "l1", "dram", False, 0.0, tuple(entries))
        )
    return batches


class NaiveDirectory:
    """The reference's design: per-entry dict-of-dicts placements, tuple-of-ints token
    bindings, a dict-of-sets per-namespace claim map and a content-keyed dict index."""

    def __init__(self) -> None:
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
                if e.token_offset >= 0 and len(tokens) == CHUNK:
                    self.index.setdefault(tokens, {})[e.key.chunk_hash] = e.token_offset


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _consume_all(target: Any, batches: list[EventBatch]) -> None:
    for b in batches:
        target.consume(b)


def _memory_per_chunk(make: Callable[[], Any], n: int, seed: int) -> float:
    """Bytes retained per chunk (directory + token arrays + index) once the inputs are gone."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        target = make()
        batches = _workload(n, seed)
        _consume_all(target, batches)
        del batches
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del target
    return used / n


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    n = args.entries or (20_000 if quick else 200_000)
    snap_keys = args.snapshot_keys or (100_000 if quick else 1_000_000)
    repeats = max(1, args.repeats if not quick else min(args.repeats, 2))
    rows: list[BenchRow] = []

    batches = _workload(n, args.seed)

    def ours() -> None:
        _consume_all(KeyDirectory(CHUNK, enable_blend_lookup=True), batches)

    def naive() -> None:
        _consume_all(NaiveDirectory(), batches)

    def ours_no_blend() -> None:
        _consume_all(KeyDirectory(CHUNK), batches)

    ours_s = _median_time(ours, repeats)
    naive_s = _median_time(naive, repeats)
    plain_s = _median_time(ours_no_blend, repeats)
    batches = []  # free the inputs before the memory pass
    mem_n = min(n, 50_000)
    ours_mem = _memory_per_chunk(lambda: KeyDirectory(CHUNK, enable_blend_lookup=True), mem_n, 1)
    naive_mem = _memory_per_chunk(NaiveDirectory, mem_n, 1)
    rows.append(
        BenchRow(
            f"consume {n:,} token-bearing store entries, blend on",
            ours_s,
            naive_s,
            "≥ 200k entries/s, ≤ 1.5 KB/chunk",
            {
                "entries/s": f"{n / ours_s:,.0f}",
                "naive entries/s": f"{n / naive_s:,.0f}",
                "B/chunk": f"{ours_mem:,.0f}",
                "naive B/chunk": f"{naive_mem:,.0f}",
            },
        )
    )

    rows.append(
        BenchRow(
            f"consume {n:,} token-bearing store entries, blend off (directory alone)",
            plain_s,
            naive_s,
            "",
            {"entries/s": f"{n / plain_s:,.0f}"},
        )
    )
    directory = KeyDirectory(CHUNK)
    _consume_all(directory, _workload(snap_keys, args.seed + 1))
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "directory.snap"
        infos = [save_snapshot(directory, path, stream_position="0-0") for _ in range(repeats)]
        pause = statistics.median(i.max_pause_s for i in infos)
        total = statistics.median(i.seconds for i in infos)
        rows.append(
            BenchRow(
                f"snapshot pause at {snap_keys:,} keys (stop-the-world reference)",
                pause,
                total,
                "≤ 10 ms pause",
                {
                    "snapshot total": f"{total:.2f} s",
                    "file MB": f"{os.path.getsize(path) / 1e6:,.0f}",
                },
            )
        )
        del directory
        gc.collect()
        restore_s = []
        for _ in range(repeats):
            target = KeyDirectory(CHUNK)
            gc.collect()
            restore_s.append(load_snapshot(target, path).seconds)
            del target
        restore = statistics.median(restore_s)
        rows.append(
            BenchRow(
                f"restore {snap_keys:,} keys (blend off)",
                restore,
                None,
                "≥ 500k keys/s",
                {"keys/s": f"{snap_keys / restore:,.0f}"},
            )
        )
    report(
        "kvatlas bench directory",
        rows,
        args.json,
        {"seed": args.seed, "repeats": repeats, "entries": n, "snapshot_keys": snap_keys},
    )
    return 0
