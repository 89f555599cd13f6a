"""How long fencing an instance holds the directory: one instance stores ``--chunks`` chunks
in L1 (256 Llama 3 ids each, blend on, batches of 1,024), ``--shared`` of them also held in
L1 by a second instance; then ``fence_instance`` of the first, timed in thread CPU (the whole
call is one hold of the directory's lock). A fresh directory each repeat; the median and
the spread are printed (docs/performance.md, "Directory: design figures").

    PYTHONPATH=$PWD python scripts/bench_fence.py --chunks 100000 --shared 0 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from kvatlas.directory import KeyDirectory, warm_up_kernels
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.workloads import LLAMA3

BATCH = 1024


def fenced(chunks: int, shared: int, seed: int) -> float:
    """Thread CPU seconds of one fence (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    d = KeyDirectory(256, enable_blend_lookup=True)
    rank = pack_kv_rank(1, 0, 1, 0)
    seqs = {"a": 0, "b": 0}

    def send(inst: str, entries: list[CacheEntry]) -> None:
        seqs[inst] += 1
        batch = EventBatch(inst, 1, seqs[inst], "store", "l1", "dram", False, 0.0, tuple(entries))
        d.consume(batch)

    for lo in range(0, chunks, BATCH):
        entries = [
            CacheEntry(
                ObjectKey(rng.bytes(32), "m", rank, 0, ""),
                1000,
                rng.integers(0, LLAMA3.size, 256, dtype=np.uint32),
                256 * (i % 64),
            )
            for i in range(lo, min(chunks, lo + BATCH))
        ]
        send("a", entries)
        if lo < shared:
            send("b", [CacheEntry(e.key, 1000) for e in entries[: shared - lo]])
    gc.collect()
    gc.freeze()  # as the coordinator does with what lives long (runtime.py)
    start = time.thread_time()
    d.fence_instance("a")
    took = time.thread_time() - start
    gc.unfreeze()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--shared", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warm_up_kernels()
    runs = [fenced(args.chunks, args.shared, seed) for seed in range(args.repeats)]
    print(
        f"fence of {args.chunks:,} chunks ({args.shared:,} also in another instance's L1): "
        f"median {1e3 * statistics.median(runs):.0f} ms thread CPU "
        f"(runs {', '.join(f'{1e3 * r:.0f}' for r in runs)} ms)"
    )


if __name__ == "__main__":
    main()
