"""KV events of a decoding engine, re-keyed in process: ``--requests`` requests stored by one
prefill event each (``--prefill`` blocks), then every further block as an event of its own with
its parent, ``--per-step`` of them in each engine batch (vLLM publishes one batch a scheduler
step: each request whose block filled in that step adds an event). Llama 3 ids, blocks of 16,
chunks of 256. Prints this thread's CPU per one-block event (median of ``--repeats``, the
start-up heap frozen as a coordinator freezes it) and the block map's bytes per block
(tracemalloc). Run it from a tree with ``PYTHONPATH=<tree>`` to compare trees.

    PYTHONPATH=. python scripts/bench_kv_decode_steps.py --per-step 8
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc

import numpy as np

from kvatlas.coordinator.kv_events import Rekeyer
from kvatlas.events.vllm_wire import BlockStored, KVEventBatch, encode_batch, split_batch
from kvatlas.keys import KeyScheme
from kvatlas.workloads import random_token_ids

BLOCK, CHUNK = 16, 256


def payloads(
    rng: np.random.Generator, requests: int, prefill: int, decode: int, per_step: int
) -> tuple[list[bytes], list[bytes]]:
    """The prefill batches (one per request), then the decode steps' batches."""
    first, chains = [], []
    for _ in range(requests):
        hashes = [rng.bytes(32) for _ in range(prefill + decode)]
        ids = random_token_ids(rng, (prefill + decode) * BLOCK).tolist()
        chains.append((hashes, ids))
        event = BlockStored(hashes[:prefill], None, ids[: prefill * BLOCK], BLOCK, medium="GPU")
        first.append(encode_batch(KVEventBatch(1.0, [event])))
    events = [
        BlockStored([hashes[j]], hashes[j - 1], ids[j * BLOCK : (j + 1) * BLOCK], BLOCK,
                    medium="GPU")
        for j in range(prefill, prefill + decode)
        for hashes, ids in chains
    ]  # fmt: skip
    steps = [
        encode_batch(KVEventBatch(2.0, events[i : i + per_step]))
        for i in range(0, len(events), per_step)
    ]
    return first, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=8, help="blocks of each prefill event")
    parser.add_argument("--decode", type=int, default=64, help="one-block events a request")
    parser.add_argument("--per-step", type=int, default=8, help="events in each engine batch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    first, steps = payloads(
        np.random.default_rng(1), args.requests, args.prefill, args.decode, args.per_step
    )
    scheme = KeyScheme("blake3", CHUNK)
    gc.collect()
    gc.freeze()

    def rekeyed(timed: list[float]) -> Rekeyer:
        rekeyer = Rekeyer(scheme, 1 << 20)
        for payload in first:
            rekeyer.translate("pod-a", "m", split_batch(payload))
        started = time.thread_time()
        for payload in steps:
            rekeyer.translate("pod-a", "m", split_batch(payload))
        timed.append(time.thread_time() - started)
        return rekeyer

    timed: list[float] = []
    for _ in range(args.repeats):
        rekeyed(timed)
    events = args.requests * args.decode
    tracemalloc.start()
    kept = rekeyed([])
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(
        f"{statistics.median(timed) / events * 1e6:.2f} µs a one-block event "
        f"({args.per_step} a batch, {len(steps)} batches); block map "
        f"{held / kept.total_blocks:.0f} B a block ({kept.total_blocks} blocks)"
    )


if __name__ == "__main__":
    main()
