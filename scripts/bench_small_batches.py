"""The directory's apply of small batches in process: decoded JSON batches of new chunks
(Llama 3 ids, 256 tokens, one shape) applied one batch a call into a fresh directory, blend
on, or (``--deletes``) those chunks stored in batches of 256 and then deleted in batches of
the size (no tokens: as a node or a KV-event eviction reports them); this thread's CPU a batch
and an entry, the median (and min) of ``--repeats`` passes of ``--entries`` entries per batch
size. What the fixed cost of a batch is (docs/performance.md, "Directory: design figures"). Compare
trees by running it with each on ``PYTHONPATH``, alternating.

    PYTHONPATH=$PWD python scripts/bench_small_batches.py --sizes 1,8,256 [--deletes]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from kvatlas.bench.ingest_bodies import store_batches
from kvatlas.directory import KeyDirectory, warm_up_kernels
from kvatlas.events import CacheEntry, EventBatch, decode_json_columns, encode_json


def _deletes(batches: list[EventBatch], size: int) -> list[EventBatch]:
    """The chunks of ``batches`` deleted in batches of ``size`` (no tokens), seqs following."""
    entries = [CacheEntry(e.key, e.size_bytes) for b in batches for e in b.entries]
    seq = batches[-1].seq
    return [
        EventBatch(
            batches[0].instance_id, 1, seq + 1 + i // size, "delete", "l1", "dram",
            entries=tuple(entries[i : i + size]),
        )
        for i in range(0, len(entries), size)
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8,64,256", help="entries a batch, comma-separated")
    parser.add_argument("--entries", type=int, default=16384, help="entries a pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deletes", action="store_true", help="time deletes, not stores")
    args = parser.parse_args()
    warm_up_kernels()
    for size in map(int, args.sizes.split(",")):
        stores, _ = store_batches(
            np.random.default_rng(1), args.entries, 256 if args.deletes else size, "node-0"
        )
        timed = _deletes(stores, size) if args.deletes else stores
        before = [cb for b in stores for cb in decode_json_columns(encode_json([b]))]
        decoded = [cb for b in timed for cb in decode_json_columns(encode_json([b]))]
        spent = []
        for _ in range(args.repeats):
            directory = KeyDirectory(256, enable_blend_lookup=True)
            if args.deletes:
                directory.apply_columns(before)
            gc.collect()
            t0 = time.thread_time_ns()
            for cb in decoded:
                directory.apply_columns([cb])
            spent.append((time.thread_time_ns() - t0) / len(decoded) / 1e3)
        med = statistics.median(spent)
        print(
            f"{size:5d} entries a batch: {med:8.1f} µs a batch (min {min(spent):.1f}), "
            f"{med / size:6.2f} µs an entry"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
