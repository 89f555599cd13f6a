"""Blend lookups in process, source trees side by side: the coordinator's handler
(``BlendLookup.answer``, body bytes to reply bytes) and the whole request stack above it, on
the ``bench service`` lookup workload (``kvatlas.bench.service_runs.lookup_workload``: 20,000
256-token chunks, 32k-token RAG queries with ≈50% cached chunks at random offsets, as 175 KB of
base64; ``--vocab`` Llama 3's ids or Llama 2's), without sockets or a load generator. One
worker process per tree, each building its index once; rounds alternate the trees (A B, then
B A), so a busy machine slows both alike. Per tree and stage, the median over rounds of this
thread's CPU per lookup, and the median of the paired differences against the first tree.
Stages, each a pass of its own over the 64 bodies (so no stage finds a body in the cache
another left it in): the body's decode, the query, the match, the reply; the whole handler;
and ``stack``: the request as the server reads it (one piece: ``bench service`` bodies arrive
in one read) fed to the coordinator's app behind the HTTP guard's uvicorn protocol, through an
in-memory transport on the server's event loop (uvloop), up to the reply's bytes. ``stack``
less ``answer`` is what the server spends above the handler but for the kernel's socket work.
Each tree's kernels are cached under ``.numba-cache/<hash of its sources>``, as the tests'
(numba's own cache does not see an edit of a kernel another file calls).

    python scripts/bench_blend_lookup.py --tree base=/tmp/base --tree branch=. --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("decode", "query", "match", "reply", "answer", "stack")


def memory_transport() -> Any:
    """A :class:`kvatlas.memory_transport.MemoryTransport` of this script's own tree, loaded
    by path: the worker imports another tree's kvatlas, which may not have that module."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "kvatlas" / "memory_transport.py"
    spec = importlib.util.spec_from_file_location("_memory_transport", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MemoryTransport()


def stack_driver(app: Any, bodies: list[bytes]) -> Callable[[], int]:
    """A function posting every body once to ``app`` behind the guarded uvicorn protocol
    (one connection, kept alive), returning this thread's CPU nanoseconds for the pass."""
    import uvloop
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from kvatlas.http_guard import guarded_protocol
    from kvatlas.http_limits import HttpLimits

    hour = 3600.0  # no timer may close the connection between two rounds
    protocol_class = guarded_protocol(HttpLimits(hour, hour), lambda _reason: None)
    config = Config(
        app, lifespan="off", log_level="warning", http=protocol_class, timeout_keep_alive=hour
    )
    config.load()
    loop = uvloop.new_event_loop()
    transport = memory_transport()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    requests = [
        b"POST /directory/blend-lookup HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    ]

    async def connect() -> None:
        protocol.connection_made(transport)

    async def post_all() -> int:
        clock = time.thread_time_ns
        t0 = clock()
        for request in requests:
            transport.written.clear()
            protocol.data_received(request)
            while not transport.written:
                await asyncio.sleep(0)
            if not transport.written[0].startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the stack replied {transport.written[0][:200]!r}")
        return clock() - t0

    loop.run_until_complete(connect())
    return lambda: loop.run_until_complete(post_all())


def worker(vocab_name: str) -> None:
    """Build the workload's index in this process (the tree on ``PYTHONPATH``); then, per
    line on stdin, one round over every body, printed as JSON: µs per lookup and stage."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvatlas.auth import ANONYMOUS_ADMIN
    from kvatlas.bench.service_runs import lookup_workload
    from kvatlas.coordinator._blend_reply import blend_reply
    from kvatlas.coordinator.app import create_app
    from kvatlas.coordinator.blend_lookup import BlendLookup
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.query import blend_query, decode_blend_lookup
    from kvatlas.coordinator.service import CoordinatorService
    from kvatlas.workloads import LLAMA2, LLAMA3

    vocab = LLAMA3 if vocab_name == "llama3" else LLAMA2
    workload = lookup_workload(np.random.default_rng(0), 20_000, 32_768, vocab)
    config = CoordinatorConfig(chunk_size=256, enable_blend_lookup=True)
    service = CoordinatorService(config)
    service.ingest(workload.index_batches)
    bodies = workload.bodies
    lookup = BlendLookup(service, ThreadPoolExecutor(1))
    index = service.directory.blend_index
    assert index is not None
    max_tokens = config.max_query_tokens
    post_all = stack_driver(create_app(service), bodies)
    for raw in bodies[:8]:  # warm-up: compiled kernels
        lookup.answer(raw, ANONYMOUS_ADMIN)
    post_all()
    del workload
    gc.collect()
    gc.freeze()
    clock = time.thread_time_ns
    print("ready", flush=True)
    for _ in sys.stdin:
        spent = dict.fromkeys(STAGES, 0)
        queries = []
        for raw in bodies:
            t0 = clock()
            body, decoded = decode_blend_lookup(raw, max_tokens)
            t1 = clock()
            query = blend_query(body, max_tokens, decoded)
            t2 = clock()
            assert query is not None
            queries.append(query)
            spent["decode"] += t1 - t0
            spent["query"] += t2 - t1
        for query in queries:
            t0 = clock()
            columns = index.match_columns(query.tokens, query.namespace)
            t1 = clock()
            blend_reply(columns, True)
            t2 = clock()
            spent["match"] += t1 - t0
            spent["reply"] += t2 - t1
        del queries
        t0 = clock()
        for raw in bodies:
            lookup.answer(raw, ANONYMOUS_ADMIN)
        spent["answer"] = clock() - t0
        spent["stack"] = post_all()
        print(json.dumps({k: v / len(bodies) / 1e3 for k, v in spent.items()}), flush=True)


_SOURCES_KEY = """\
try:
    from kvatlas.kernel_cache import sources_key
except ImportError:  # a tree from before kvatlas/kernel_cache.py
    from tests.numba_cache import sources_key
print(sources_key())
"""


def start(tree: Path, vocab: str) -> subprocess.Popen[str]:
    """A worker running ``tree``'s kvatlas, its kernels cached by its sources."""
    root = tree.resolve()
    key = subprocess.run(
        [sys.executable, "-c", _SOURCES_KEY],
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
