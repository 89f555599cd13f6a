"""Blend lookups in process, source trees side by side: the coordinator's handler
(``BlendLookup.answer``, body bytes to reply bytes) on the ``bench service`` lookup workload
(20,000 256-token chunks, 32k-token RAG queries with ≈50% cached chunks at random offsets, as
175 KB of base64; ``--vocab`` Llama 3's ids or Llama 2's), without HTTP. One worker process
per tree, each building its index once; rounds alternate the trees (A B, then B A), so a busy
machine slows both alike. Per tree and stage — the body's decode, the query, the match, the
reply, and the whole handler (run after the stages, on the same body) — the median over rounds
of this thread's CPU per lookup, and the median of the paired differences against the first
tree. Each tree's kernels are cached under ``.numba-cache/<hash of its sources>``, as the
tests' (numba's own cache does not see an edit of a kernel another file calls).

    python scripts/bench_blend_lookup.py --tree base=/tmp/base --tree branch=. --rounds 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("decode", "query", "match", "reply", "answer")


def worker(vocab_name: str) -> None:
    """Build the workload's index in this process (the tree on ``PYTHONPATH``); then, per
    line on stdin, one round over every body, printed as JSON: µs per lookup and stage."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvatlas.auth import ANONYMOUS_ADMIN
    from kvatlas.bench.ingest_bodies import MODEL, store_batches
    try:
        from kvatlas.bench.service_runs import rag_query
    except ImportError:  # a tree from before bench/service_runs.py
        from kvatlas.bench.service import _rag_query as rag_query
    from kvatlas.client import encode_tokens_b64
    from kvatlas.coordinator._blend_reply import blend_reply
    from kvatlas.coordinator.blend_lookup import BlendLookup
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.query import blend_query, decode_blend_lookup
    from kvatlas.coordinator.service import CoordinatorService
    from kvatlas.workloads import LLAMA2, LLAMA3

    vocab = LLAMA3 if vocab_name == "llama3" else LLAMA2
    rng = np.random.default_rng(0)
    config = CoordinatorConfig(chunk_size=256, enable_blend_lookup=True)
    service = CoordinatorService(config)
    batches, index_tokens = store_batches(rng, 20_000, 1024, "node-1", vocab)
    service.ingest(batches)
    bodies = [
        json.dumps(
            {
                "tokens_b64": encode_tokens_b64(rag_query(rng, index_tokens, 32_768, vocab)),
                "model_name": MODEL,
            }
        ).encode()
        for _ in range(64)
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
    print("ready", flush=True)
    for _ in sys.stdin:
        spent = dict.fromkeys(STAGES, 0)
        for raw in bodies:
            t0 = clock()
            body, decoded = decode_blend_lookup(raw, max_tokens)
            t1 = clock()
            query = blend_query(body, max_tokens, decoded)
            assert query is not None
            t2 = clock()
            columns = index.match_columns(query.tokens, query.namespace)
            t3 = clock()
            blend_reply(columns, True)
            t4 = clock()
            lookup.answer(raw, ANONYMOUS_ADMIN)
            t5 = clock()
            for stage, took in zip(
                STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
            ):
                spent[stage] += took
        print(json.dumps({k: v / len(bodies) / 1e3 for k, v in spent.items()}), flush=True)


def start(tree: Path, vocab: str) -> subprocess.Popen[str]:
    """A worker running ``tree``'s kvatlas, its kernels cached by its sources."""
    root = tree.resolve()
    key = subprocess.run(
        [sys.executable, "-c", "from tests.numba_cache import sources_key; print(sources_key())"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "NUMBA_CACHE_DIR": str(root / ".numba-cache" / key),
    }
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", vocab],
        cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the worker of {tree} did not start")
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="NAME=PATH (two or more)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--vocab", choices=("llama3", "llama2"), default="llama3")
    parser.add_argument("--json", default=None, help="write the medians here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    if not args.tree or len(args.tree) < 2:
        parser.error("give two trees or more: --tree base=PATH --tree branch=PATH")
    trees = [(n, Path(p)) for n, _, p in (t.partition("=") for t in args.tree)]
    workers = {name: start(tree, args.vocab) for name, tree in trees}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, _ in trees if r % 2 == 0 else trees[::-1]:
            proc = workers[name]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            rounds[name].append(json.loads(proc.stdout.readline()))
    for proc in workers.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    load.append(os.getloadavg()[0])
    first = trees[0][0]
    print(f"{args.vocab}, {args.rounds} rounds, load {load[0]:.1f}–{load[1]:.1f}: µs per lookup")
    print(f"{'stage':8} " + " ".join(f"{name:>10}" for name, _ in trees) + "   paired diff")
    result: dict[str, object] = {"vocab": args.vocab, "rounds": args.rounds, "load": load}
    for stage in STAGES:
        medians = {n: statistics.median(x[stage] for x in rounds[n]) for n, _ in trees}
        diffs = {
            n: statistics.median(
                b[stage] - a[stage] for a, b in zip(rounds[first], rounds[n], strict=True)
            )
            for n, _ in trees[1:]
        }
        result[stage] = {"medians": medians, "paired_diff": diffs}
        print(
            f"{stage:8} "
            + " ".join(f"{medians[n]:10.1f}" for n, _ in trees)
            + "   "
            + " ".join(f"{n} {d:+.1f}" for n, d in diffs.items())
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
