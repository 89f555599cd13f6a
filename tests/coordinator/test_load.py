"""Load: concurrent blend lookups while a stream of batches is ingested — no errors, every
batch applied, lookups answered between every two batches, memory bounded under a fixed number
of sustained lookups; lookup p99 reported. Bounded by counts and events, never by wall-clock
time, so a loaded machine makes it slower, not red."""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Callable

import httpx
import numpy as np

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank

C = 64
BATCH = 64  # entries per posted batch
LOOKERS = 3  # concurrent lookup clients
SUSTAINED = 300  # lookups per client in the memory phase


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_lookups_during_ingestion() -> None:
    rng = np.random.default_rng(0)
    config = CoordinatorConfig(port=free_port(), chunk_size=C, enable_blend_lookup=True)
    rank = pack_kv_rank(1, 0, 1, 0)
    contents = rng.integers(0, 50_000, (4000, C)).astype(np.uint32)
    with BackgroundServer(config) as server:
        errors: list[str] = []
        posted = [0]
        latencies: list[float] = []
        answered = [0]  # lookups answered so far, by all clients
        progress = threading.Condition()
        ingesting = threading.Event()
        ingesting.set()

        def ingest() -> None:
            try:
                ingest_all()
            finally:
                ingesting.clear()

        def ingest_all() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                for seq, start in enumerate(range(0, len(contents), BATCH), 1):
                    with progress:
                        before = answered[0]
                    entries = tuple(
                        CacheEntry(ObjectKey(chunk_hashes(r, C)[0], "m", rank), 1024, r, 0)
                        for r in contents[start : start + BATCH]
                    )
                    body = encode_msgpack(
                        [EventBatch("ingester", 1, seq, "store", "l1", "dram", entries=entries)]
                    )
                    r = client.post(
                        "/events", content=body, headers={"Content-Type": "application/msgpack"}
                    )
                    if r.status_code != 200:
                        errors.append(f"ingest {r.status_code}")
                    posted[0] += len(entries)
                    # Lookups interleave with ingestion: at least one is answered per batch.
                    with progress:
                        if not progress.wait_for(lambda b=before: answered[0] > b, timeout=120):
                            errors.append(f"no lookup answered while batch {seq} was ingested")

        def lookup(done: Callable[[int], bool]) -> None:
            own = np.random.default_rng(threading.get_ident())  # generators are not thread-safe
            count = 0
            with httpx.Client(base_url=server.url, timeout=30) as client:
                while not done(count):
                    picks = contents[own.integers(0, len(contents), 8)]
                    query = np.concatenate([np.array([1, 2, 3], np.uint32), *picks])
                    body = {
                        "tokens_b64": base64.b64encode(query.astype("<u4").tobytes()).decode(),
                        "model_name": "m",
                    }
                    started = time.perf_counter()
                    r = client.post("/directory/blend-lookup", json=body)
                    latencies.append(time.perf_counter() - started)
                    if r.status_code != 200 or "matches" not in r.json():
                        errors.append(f"lookup {r.status_code}")
                    count += 1
                    with progress:
                        answered[0] += 1
                        progress.notify_all()

        def run(threads: list[threading.Thread]) -> None:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
                assert not t.is_alive()

        run(
            [threading.Thread(target=ingest)]
            + [
                threading.Thread(target=lookup, args=(lambda _: not ingesting.is_set(),))
                for _ in range(LOOKERS)
            ]
        )
        assert errors == []
        assert server.service.directory.stats().keys == posted[0] == len(contents)
        latencies.sort()
        p99 = latencies[int(len(latencies) * 0.99) - 1]
        print(
            f"\nblend lookups during ingestion: {len(latencies)} requests, p99 {p99 * 1e3:.1f} ms"
        )

        # Sustained lookups (no ingestion) must not grow memory: results are not retained.
        before = rss_bytes()
        run(
            [
                threading.Thread(target=lookup, args=(lambda n: n >= SUSTAINED,))
                for _ in range(LOOKERS)
            ]
        )
        assert errors == []
        assert rss_bytes() - before < 64 * 1024 * 1024
