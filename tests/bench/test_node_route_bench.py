"""``scripts/bench_node_asgi.py``'s workload (shared with ``bench_node_routes.py``): what the
node-route rows of docs/performance.md measure. Every store is a new prompt that L1 must evict
for, past the pinned keys; reads hit; token ids need more than 16 bits."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import bench_node_asgi as bench


def test_stores_insert_and_evict_past_the_pins_and_reads_hit() -> None:
    work = bench.Workload()
    stores = [work.call("store")[1] for _ in range(2 * bench.PROMPTS // 4)]
    assert len(set(stores)) == len(stores)  # distinct prompts
    tokens = [np.frombuffer(msgspec.msgpack.decode(b)["tokens"], np.uint32) for b in stores]
    assert max(int(t.max()) for t in tokens) >= 1 << 16  # a 128k-id vocabulary
    assert len(work.pinned_keys()) == 4 * bench.PINNED_PROMPTS
    # the benchmark itself, small: it checks that L1 ends full and every pinned key stayed
    asyncio.run(bench.main(requests=12, rounds=1))
