"""Prefix lookups over HTTP (``POST /directory/lookup``, LMCache's keys form): the server's CPU
per lookup, lookups/s and p99 with ``wrk``, against a coordinator of this tree and, with
``--lmcache PATH``, LMCache's own coordinator (one server at a time, each fed the same
chunks). ``--chunks`` Llama 3 chunks are stored in batches of 1,024 (msgpack for ours, JSON
for LMCache's); each body asks for the 128 keys of a 32k-token prompt, consecutive chunks of
one stored batch, one body for every 128 stored chunks (784 at the default size), and the
first reply is checked (every key held, 256 ids each).
Run it from the tree to measure (the coordinator imports the working directory's kvatlas):

    PYTHONPATH=$PWD python scripts/bench_prefix_lookup.py --lmcache .venv-lmcache
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import httpx
import numpy as np

from kvatlas.bench.ingest_bodies import bodies_of, post_all, store_batches
from kvatlas.bench.lmcache_reference import find_lmcache, lmcache_coordinator
from kvatlas.bench.server_cpu import LoadResult, run_wrk
from kvatlas.bench.service import COORDINATOR, service_process
from kvatlas.events import EventBatch, encode_json, encode_msgpack
from kvatlas.workloads import LLAMA3

PATH = "/directory/lookup"
PROMPT_KEYS = 128
PER_BATCH = 1024


def _bodies(batches: list[EventBatch]) -> list[bytes]:
    """A body per 128 consecutive keys of every stored batch, in an order of their own: ``wrk``
    cycles through all, so a lookup reads chunks no lookup just before it read."""
    bodies = [
        json.dumps({"keys": [e.key.to_wire() for e in b.entries[i : i + PROMPT_KEYS]]}).encode()
        for b in batches
        for i in range(0, len(b.entries) - PROMPT_KEYS + 1, PROMPT_KEYS)
    ]
    random.Random(0).shuffle(bodies)
    return bodies


def _measure(url: str, pid: int, bodies: list[bytes], args: argparse.Namespace) -> str:
    reply = httpx.post(
        f"{url}{PATH}", content=bodies[0], headers={"Content-Type": "application/json"}, timeout=60
    )
    reply.raise_for_status()
    results = reply.json()["results"]
    if len(results) != PROMPT_KEYS or not all(
        r["placements"] and len(r["token_ids"]) == 256 for r in results
    ):
        raise RuntimeError("the first lookup did not find every key with its 256 ids")
    run_wrk(url, PATH, bodies, args.connections, 1, pid)  # warm-up
    runs: list[LoadResult] = [
        run_wrk(url, PATH, bodies, args.connections, args.seconds, pid) for _ in range(args.repeats)
    ]
    cpu = [r.per_request_cpu_s * 1e6 for r in runs]
    return (
        f"server CPU {statistics.median(cpu):,.0f} µs a lookup ({min(cpu):,.0f}–{max(cpu):,.0f}), "
        f"{statistics.median(r.requests / r.seconds for r in runs):,.0f} lookups/s, "
        f"p99 {statistics.median(r.p99_s for r in runs) * 1e3:.1f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_352)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--lmcache", default=None, help="LMCache's virtual environment")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batches, _ = store_batches(rng, args.chunks, PER_BATCH, "node-1", LLAMA3)
    bodies = _bodies(batches)
    with service_process([*COORDINATOR, "--max-body-bytes", str(1 << 30)]) as (url, pid):
        post_all(url, bodies_of(batches, 4, encode_msgpack), "application/msgpack")
        print(f"kvatlas: {_measure(url, pid, bodies, args)}", flush=True)
    lmcache = find_lmcache(str(Path(args.lmcache).resolve())) if args.lmcache else None
    if lmcache is not None:
        with (
            tempfile.TemporaryDirectory() as tmp,
            lmcache_coordinator(lmcache, 256, Path(tmp), "lookup") as (url, pid),
        ):
            post_all(url, bodies_of(batches, 4, encode_json), "application/json")
            print(f"{lmcache.label}: {_measure(url, pid, bodies, args)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
