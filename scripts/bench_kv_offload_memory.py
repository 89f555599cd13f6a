"""The re-keyer's block map through a CPU offload, in process: ``--requests`` requests of
``--blocks`` blocks (16 Llama 3 ids each, chunks of 256) stored on the GPU by one event each,
then the same blocks stored on the CPU (vLLM's offload: the same hashes, medium ``CPU``), then
removed from the GPU. Prints the block map's bytes per block after each step (tracemalloc of
what the re-keyer keeps). Run it from a tree with ``PYTHONPATH=<tree>`` to compare trees.

    PYTHONPATH=. python scripts/bench_kv_offload_memory.py
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

import numpy as np

from kvatlas.coordinator.kv_events import Rekeyer
from kvatlas.events.vllm_wire import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    split_batch,
)
from kvatlas.keys import KeyScheme
from kvatlas.workloads import random_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=128, help="blocks of each request")
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    steps: dict[str, list[bytes]] = {"GPU": [], "+CPU": [], "GPU evicted": []}
    for _ in range(args.requests):
        hashes = [rng.bytes(32) for _ in range(args.blocks)]
        ids = random_token_ids(rng, args.blocks * 16).tolist()
        for name, event in (
            ("GPU", BlockStored(hashes, None, ids, 16, medium="GPU")),
            ("+CPU", BlockStored(hashes, None, ids, 16, medium="CPU")),
            ("GPU evicted", BlockRemoved(hashes, "GPU")),
        ):
            steps[name].append(encode_batch(KVEventBatch(1.0, [event])))
    gc.collect()
    tracemalloc.start()
    rekeyer = Rekeyer(KeyScheme("blake3", 256), 1 << 22)
    shown = []
    for name, payloads in steps.items():
        for payload in payloads:
            rekeyer.translate("pod-a", "m", split_batch(payload))
        gc.collect()
        per_block = tracemalloc.get_traced_memory()[0] / rekeyer.total_blocks
        shown.append(f"{name} {per_block:.0f} B")
    print(f"block map a block ({rekeyer.total_blocks} blocks): " + " · ".join(shown))


if __name__ == "__main__":
    main()
