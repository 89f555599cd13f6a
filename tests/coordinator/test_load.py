"""Load: concurrent blend lookups while ingesting at a high rate for a bounded time — no errors,
every batch applied, memory bounded under sustained lookups; lookup p99 reported."""

from __future__ import annotations

import base64
import os
import threading
import time

import httpx
import numpy as np

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank

C = 64
SECONDS = 2.0


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_lookups_during_ingestion() -> None:
    rng = np.random.default_rng(0)
    config = CoordinatorConfig(port=free_port(), chunk_size=C, enable_blend_lookup=True)
    rank = pack_kv_rank(1, 0, 1, 0)
    contents = rng.integers(0, 50_000, (4000, C)).astype(np.uint32)
    with BackgroundServer(config) as server:
        stop = threading.Event()
        errors: list[str] = []
        posted = [0]
        latencies: list[float] = []

        def ingest() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                seq = 0
                while not stop.is_set() and seq * 64 < len(contents):
                    rows = contents[seq * 64 : (seq + 1) * 64]
                    seq += 1
                    entries = tuple(
                        CacheEntry(ObjectKey(chunk_hashes(r, C)[0], "m", rank), 1024, r, 0)
                        for r in rows
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

        def lookup() -> None:
            own = np.random.default_rng(threading.get_ident())  # generators are not thread-safe
            with httpx.Client(base_url=server.url, timeout=30) as client:
                while not stop.is_set():
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

        threads = [threading.Thread(target=ingest)] + [
            threading.Thread(target=lookup) for _ in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(SECONDS)  # the load's bounded duration, not a synchronisation
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert errors == []
        assert server.service.directory.stats().keys == posted[0] > 0
        assert len(latencies) > 10
        latencies.sort()
        p99 = latencies[int(len(latencies) * 0.99) - 1]
        print(
            f"\nblend lookups during ingestion: {len(latencies)} requests, p99 {p99 * 1e3:.1f} ms"
        )

        # Sustained lookups (no ingestion) must not grow memory: results are not retained.
        before = rss_bytes()
        stop.clear()
        lookers = [threading.Thread(target=lookup) for _ in range(3)]
        for t in lookers:
            t.start()
        time.sleep(SECONDS)
        stop.set()
        for t in lookers:
            t.join(timeout=60)
        assert errors == []
        assert rss_bytes() - before < 64 * 1024 * 1024
