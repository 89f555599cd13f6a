"""In-process blend lookups: the coordinator's handler (``BlendLookup.answer``, body bytes to
reply bytes) on the ``bench service`` lookup workload (``--index-chunks`` 256-token chunks of
Llama 3 ids, 32k-token RAG queries with ≈50% cached chunks at random offsets, as 175 KB of
base64), without HTTP. Prints this thread's CPU per lookup (median over ``--rounds`` rounds of
every body) and per stage: the body's decode, the query, the match, the reply. Runs against
whatever ``kvatlas`` is on ``PYTHONPATH``: run it in two trees, interleaved, to compare them.

    PYTHONPATH=$PWD python scripts/bench_blend_lookup.py --rounds 30
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvatlas.auth import ANONYMOUS_ADMIN
from kvatlas.bench.ingest_bodies import MODEL, store_batches
from kvatlas.bench.service import _rag_query
from kvatlas.client import encode_tokens_b64
from kvatlas.coordinator._blend_reply import blend_reply
from kvatlas.coordinator.blend_lookup import BlendLookup
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.query import blend_query, decode_blend_lookup
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.workloads import LLAMA2, LLAMA3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-chunks", type=int, default=20_000)
    parser.add_argument("--query-tokens", type=int, default=32_768)
    parser.add_argument("--bodies", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--vocab", choices=("llama3", "llama2"), default="llama3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the medians (µs) here")
    args = parser.parse_args()
    vocab = LLAMA3 if args.vocab == "llama3" else LLAMA2
    rng = np.random.default_rng(args.seed)
    config = CoordinatorConfig(chunk_size=256, enable_blend_lookup=True, max_query_tokens=1 << 20)
    service = CoordinatorService(config)
    batches, index_tokens = store_batches(rng, args.index_chunks, 1024, "node-1", vocab)
    service.ingest(batches)
    bodies = [
        json.dumps(
            {
                "tokens_b64": encode_tokens_b64(
                    _rag_query(rng, index_tokens, args.query_tokens, vocab)
                ),
                "model_name": MODEL,
            }
        ).encode()
        for _ in range(args.bodies)
    ]
    lookup = BlendLookup(service, ThreadPoolExecutor(1))
    index = service.directory.blend_index
    assert index is not None
    max_tokens = config.max_query_tokens
    for raw in bodies[:8]:  # warm-up: compiled kernels
        lookup.answer(raw, ANONYMOUS_ADMIN)
    del batches
    gc.collect()
    gc.freeze()
    clock = time.thread_time_ns
    stages: dict[str, list[float]] = {
        k: [] for k in ("answer", "decode", "query", "match", "reply", "matches")
    }
    for _ in range(args.rounds):
        per: dict[str, int] = dict.fromkeys(stages, 0)
        for raw in bodies:
            t0 = clock()
            lookup.answer(raw, ANONYMOUS_ADMIN)
            t1 = clock()
            body, decoded = decode_blend_lookup(raw, max_tokens)
            t2 = clock()
            query = blend_query(body, max_tokens, decoded)
            assert query is not None
            t3 = clock()
            columns = index.match_columns(query.tokens, query.namespace)
            t4 = clock()
            blend_reply(columns, True)
            t5 = clock()
            per["answer"] += t1 - t0
            per["decode"] += t2 - t1
            per["query"] += t3 - t2
            per["match"] += t4 - t3
            per["reply"] += t5 - t4
            per["matches"] += len(columns.chunk_hashes)
        for k, v in per.items():
            stages[k].append(v / len(bodies) / (1 if k == "matches" else 1e3))
    medians = {k: statistics.median(v) for k, v in stages.items()}
    load = os.getloadavg()[0]
    print(
        f"{args.vocab} N={args.index_chunks} q={args.query_tokens} load={load:.1f}: "
        + "  ".join(f"{k} {v:.1f}" for k, v in medians.items())
        + " (µs; matches per lookup)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**medians, "load": load}, f)


if __name__ == "__main__":
    main()
