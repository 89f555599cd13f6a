"""What the directory spends on batches that change chunks it already holds: one instance
stores ``--chunks`` chunks in L1 (256 Llama 3 ids each, blend on, batches of 256, four a
body), then one kind of change to every chunk arrives as JSON bodies of the same shape,
decoded and applied as ``POST /events`` does (``decode_json_columns``, ``apply_columns``).
Per kind: the thread CPU per entry of decoding and applying the change (median of
``--repeats`` fresh directories, each value printed) and the memory it leaves behind per
chunk (tracemalloc, one more directory). Kinds: ``delete`` (the L1 copies dropped: the
chunks go), ``access`` (newer ``last_access``), ``again`` (the same copy reported again),
``l2`` (a copy in L2 of the same key, tokens included), ``other`` (another instance's L1
copy). docs/performance.md, "Directory: design figures".

    PYTHONPATH=$PWD python scripts/bench_key_changes.py --chunks 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc

import numpy as np

from kvatlas.directory import KeyDirectory, warm_up_kernels
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.json_codec import decode_json_columns, encode_json
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.workloads import LLAMA3, random_token_ids

BATCH = 256
PER_BODY = 4
CHUNK = 256
FIRST = ("store", "a", "l1", "dram", 0.0)
"""The first report of every chunk (older than every change: an access is newer)."""
KINDS = {  # kind: (event type, instance, tier, backend, ts)
    "delete": ("delete", "a", "l1", "dram", 0.0),
    "access": ("access", "a", "l1", "dram", 5.0),
    "again": ("store", "a", "l1", "dram", 5.0),
    "l2": ("store", "a", "l2", "fs", 5.0),
    "other": ("store", "b", "l1", "dram", 5.0),
}


def entries(chunks: int, seed: int) -> list[list[CacheEntry]]:
    """The stored chunks' entries, batch by batch."""
    rng = np.random.default_rng(seed)
    rank = pack_kv_rank(1, 0, 1, 0)
    out = []
    for lo in range(0, chunks, BATCH):
        n = min(BATCH, chunks - lo)
        tokens = random_token_ids(rng, (n, CHUNK), LLAMA3)
        hashes = rng.bytes(32 * n)
        out.append(
            [
                CacheEntry(
                    ObjectKey(hashes[32 * i : 32 * i + 32], "m", rank),
                    65536,
                    tokens[i],
                    (lo + i) * CHUNK,
                )
                for i in range(n)
            ]
        )
    return out


def bodies(batches: list[list[CacheEntry]], kind: str, seq0: int) -> list[bytes]:
    """JSON bodies of ``kind`` over every stored chunk (``seq0``: the emitter's next seq)."""
    event, inst, tier, backend, ts = FIRST if kind == "first" else KINDS[kind]
    out = []
    seq = seq0 if inst == "a" else 1
    for lo in range(0, len(batches), PER_BODY):
        group = []
        for es in batches[lo : lo + PER_BODY]:
            if event != "store":  # (deletes and accesses name keys: no tokens)
                es = [CacheEntry(e.key, e.size_bytes) for e in es]
            group.append(EventBatch(inst, 1, seq, event, tier, backend, False, ts, tuple(es)))
            seq += 1
        out.append(encode_json(group))
    return out


def applied(stores: list[bytes], change: list[bytes]) -> tuple[KeyDirectory, float]:
    """A directory holding ``stores``, and the thread CPU seconds of applying ``change``."""
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for body in stores:
        d.apply_columns(decode_json_columns(body))
    gc.collect()
    started = time.thread_time()
    for body in change:
        d.apply_columns(decode_json_columns(body))
    return d, time.thread_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    warm_up_kernels()
    batches = entries(args.chunks, args.seed)
    stores = bodies(batches, "first", 1)
    seq0 = len(batches) + 1
    for kind in args.kinds.split(","):
        change = bodies(batches, kind, seq0)
        times = []
        for _ in range(args.repeats):
            d, cpu = applied(stores, change)
            times.append(1e6 * cpu / args.chunks)
            del d
            gc.collect()
        d = KeyDirectory(CHUNK, enable_blend_lookup=True)
        for body in stores:
            d.apply_columns(decode_json_columns(body))
        gc.collect()
        tracemalloc.start()
        for body in change:
            d.apply_columns(decode_json_columns(body))
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] / args.chunks
        tracemalloc.stop()
        del d
        gc.collect()
        spread = " · ".join(f"{t:.2f}" for t in times)
        print(
            f"{kind:7s} CPU {statistics.median(times):.2f} µs an entry ({spread}); "
            f"memory left {kept:.1f} B a chunk",
            flush=True,
        )


if __name__ == "__main__":
    main()
