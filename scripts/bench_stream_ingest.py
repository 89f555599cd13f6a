"""A coordinator consuming the Redis stream transport: server CPU, minor page faults and
entries/s per cache entry, as ``bench service`` measures ``POST /events``. A coordinator
(``--event-transport redis``) is started on a fresh stream and fed one warm-up stream entry;
once it has acknowledged it, ``--entries`` Llama 3 store entries are added in one pipeline, as
msgpack stream entries of ``--batches-per-entry`` batches of 256 (4: ≈1.1 MB, a ``POST
/events`` body of ``bench service``; 1: ≈280 KB), and the coordinator's CPU and faults are read
from ``/proc`` until its consumer group has acknowledged them all. The wait asks Redis, not
the coordinator, so the server's CPU is its consumption alone; its key count is checked
after (docs/performance.md, "Service: design figures"). Needs a Redis server
(``scripts/ensure-redis.sh``).

    PYTHONPATH=$PWD python scripts/bench_stream_ingest.py --batches-per-entry 4 --repeats 2
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import httpx
import numpy as np
import redis

from kvatlas.bench.ingest_bodies import store_batches
from kvatlas.bench.server_cpu import process_cpu_seconds, process_minor_faults
from kvatlas.bench.service import COORDINATOR, service_process
from kvatlas.events.stream_format import encode_stream_fields

PER_BATCH = 256


GROUP = "bench-stream-ingest"


def _keys(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^kvatlas_directory_keys (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _wait_acknowledged(client: redis.Redis, stream: str, last: bytes | str) -> None:
    """Until the coordinator's group has read up to ``last`` and acknowledged everything (an
    entry is acknowledged after it was applied)."""
    while True:
        for group in client.xinfo_groups(stream):
            mine = group["name"] == GROUP.encode() and group["last-delivered-id"] == last
            if mine and group["pending"] == 0:
                return
        time.sleep(0.01)


def consumed(redis_url: str, entries: int, per_entry: int, seed: int) -> tuple[float, float, float]:
    """(server CPU seconds per entry, minor faults per entry, entries/s) of one run."""
    stream = f"bench-stream-ingest:{time.time_ns()}"
    client = redis.Redis.from_url(redis_url)
    batches, _ = store_batches(
        np.random.default_rng(seed), entries + per_entry * PER_BATCH, PER_BATCH, "node-0"
    )
    fields = [
        encode_stream_fields(batches[i : i + per_entry]) for i in range(0, len(batches), per_entry)
    ]
    args = [*COORDINATOR, "--event-transport", "redis", "--redis-url", redis_url]
    args += ["--event-stream", stream, "--consumer-group", GROUP]
    try:
        with service_process(args) as (url, pid):
            first = client.xadd(stream, fields[0])  # type: ignore[arg-type]  # warm-up
            _wait_acknowledged(client, stream, first)
            cpu0, faults0 = process_cpu_seconds(pid), process_minor_faults(pid)
            started = time.perf_counter()
            pipe = client.pipeline()
            for f in fields[1:]:
                pipe.xadd(stream, f)  # type: ignore[arg-type]
            _wait_acknowledged(client, stream, pipe.execute()[-1])
            wall = time.perf_counter() - started
            cpu = process_cpu_seconds(pid) - cpu0
            faults = process_minor_faults(pid) - faults0
            if _keys(url) != len(batches) * PER_BATCH:
                raise RuntimeError("the coordinator acknowledged entries it does not hold")
    finally:
        client.delete(stream)
        client.close()
    n = len(batches) * PER_BATCH - per_entry * PER_BATCH
    return cpu / n, faults / n, n / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--entries", type=int, default=100_352, help="cache entries measured")
    parser.add_argument("--batches-per-entry", type=int, default=4, help="batches a stream entry")
    parser.add_argument("--repeats", type=int, default=1, help="runs, each a fresh coordinator")
    args = parser.parse_args()
    runs = [
        consumed(args.redis_url, args.entries, args.batches_per_entry, seed)
        for seed in range(args.repeats)
    ]
    cpu, faults, rate = (statistics.median(column) for column in zip(*runs, strict=True))
    print(
        f"stream of {args.batches_per_entry} batches of {PER_BATCH} an entry, "
        f"median of {len(runs)}: {cpu * 1e6:.2f} µs server CPU an entry, "
        f"{faults:.3f} minor faults an entry, {rate:,.0f} entries/s"
    )


if __name__ == "__main__":
    main()
