"""Redis Streams transport against a real redis-server: kill -9 and restart the coordinator
mid-stream (snapshot + replay equals an oracle), restart Redis (ingestion resumes)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from kvatlas.client import EventSink, RedisStreamTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.stream_format import encode_stream_fields
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, RedisServer, wait_for

CHUNK = 16
MODEL = "m"


def make_workload(seed: int, instances: int = 3, batches_each: int = 120) -> list[EventBatch]:
    """Interleaved store/delete batches with token-bearing stores, deterministic from seed."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 5000, CHUNK * 4).tolist() for _ in range(40)]
    out: list[EventBatch] = []
    stored: dict[str, list[CacheEntry]] = {f"node-{i}": [] for i in range(instances)}
    for step in range(batches_each):
        for i in range(instances):
            inst = f"node-{i}"
            seq = step + 1
            if stored[inst] and rng.random() < 0.25:
                victims = [
                    stored[inst].pop(int(rng.integers(len(stored[inst]))))
                    for _ in range(min(2, len(stored[inst])))
                ]
                out.append(
                    EventBatch(
                        inst,
                        7,
                        seq,
                        "delete",
                        "l1",
                        "dram",
                        ts=1000.0 + step,
                        entries=tuple(victims),
                    )
                )
                continue
            doc = docs[int(rng.integers(len(docs)))]
            hashes = chunk_hashes(doc, CHUNK)
            salt = ["", "tenant-b"][int(rng.integers(2))]
            entries = tuple(
                CacheEntry(
                    ObjectKey(h, MODEL, pack_kv_rank(1, 0, 1, 0), 0, salt),
                    size_bytes=4096,
                    token_ids=np.asarray(doc[c * CHUNK : (c + 1) * CHUNK], dtype=np.uint32),
                    token_offset=c * CHUNK,
                )
                for c, h in enumerate(hashes)
            )
            stored[inst].extend(entries)
            out.append(
                EventBatch(inst, 7, seq, "store", "l1", "dram", ts=1000.0 + step, entries=entries)
            )
    return out


def oracle(batches: list[EventBatch]) -> KeyDirectory:
    directory = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for batch in batches:
        directory.consume(batch)
    return directory


def listing_from_directory(directory: KeyDirectory) -> set[Any]:
    out: set[Any] = set()
    cursor = None
    while True:
        page = directory.list_keys(cursor=cursor, limit=500)
        for kp in page.items:
            out.add(
                (
                    kp.key,
                    tuple((p.instance_id, p.tier, p.backend, p.size_bytes) for p in kp.placements),
                )
            )
        cursor = page.next_cursor
        if cursor is None:
            return out


def listing_over_http(url: str) -> set[Any]:
    out: set[Any] = set()
    cursor = None
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            params: dict[str, Any] = {"limit": 500}
            if cursor:
                params["cursor"] = cursor
            reply = client.get("/directory/keys", params=params).json()
            for item in reply["keys"]:
                key = ObjectKey.from_wire(item["key"])
                pls = tuple(
                    (p["instance_id"], p["tier"], p["backend"], p["size_bytes"])
                    for p in item["placements"]
                )
                out.add((key, pls))
            cursor = reply["next_cursor"]
            if cursor is None:
                return out


def xadd_all(
    client: redis.Redis, stream: str, batches: list[EventBatch], per_entry: int = 4
) -> None:
    for i in range(0, len(batches), per_entry):
        client.xadd(stream, encode_stream_fields(batches[i : i + per_entry]))  # type: ignore[arg-type]


class CoordinatorProcess:
    def __init__(self, args: list[str], port: int) -> None:
        self.args = args
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(self.port), *self.args], self.url
        )

    def ready(self) -> bool:
        try:
            return HTTP.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def applied(self) -> int:
        return int(HTTP.get(f"{self.url}/directory/stats", timeout=5).json()["batches"]["applied"])

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


@pytest.fixture
def stream_name(request: pytest.FixtureRequest) -> str:
    return f"kvatlas:test:{request.node.name}"


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_kill_and_restart_mid_stream_equals_oracle(
    redis_server: RedisServer, redis_client: redis.Redis, stream_name: str, tmp_path: Path
) -> None:
    batches = make_workload(seed=1)
    half = len(batches) // 2
    snapshot = tmp_path / "directory.snap"
    port = free_port()
    args = [
        "--event-transport", "redis", "--redis-url", redis_server.url, "--event-stream", stream_name,
        "--snapshot-path", str(snapshot), "--snapshot-interval", "0.2",
        "--chunk-size", str(CHUNK), "--enable-blend-lookup",
    ]  # fmt: skip
    coordinator = CoordinatorProcess(args, port)
    coordinator.start()
    try:
        xadd_all(redis_client, stream_name, batches[:half])
        assert wait_for(lambda: coordinator.applied() >= half // 2, timeout=60)
        assert wait_for(snapshot.exists, timeout=30)
        coordinator.kill()  # mid-stream, no final snapshot
        xadd_all(redis_client, stream_name, batches[half:])  # arrives while it is down
        coordinator.start()
        assert wait_for(coordinator.ready, timeout=60)
        expected = oracle(batches)
        assert wait_for(
            lambda: listing_over_http(coordinator.url) == listing_from_directory(expected),
            timeout=60,
        )
        # The blend index was rebuilt from the restored bindings and follows the stream.
        rng = np.random.default_rng(5)
        for _ in range(5):
            batch = batches[int(rng.integers(len(batches)))]
            if batch.event_type != "store":
                continue
            query = np.concatenate(
                [np.array([1, 2, 3], np.uint32), *(e.token_ids for e in batch.entries)]
            )
            ns = BlendNamespace.from_object_key(batch.entries[0].key)
            want = [
                (m.chunk_hash.hex(), m.old_st, m.cur_st) for m in expected.blend_match(query, ns)
            ]
            reply = httpx.post(
                f"{coordinator.url}/directory/blend-lookup",
                json={
                    "token_ids": query.tolist(),
                    "model_name": ns.model_name,
                    "cache_salt": ns.cache_salt,
                },
            ).json()
            assert [(m["chunk_hash"], m["old_st"], m["cur_st"]) for m in reply["matches"]] == want
    finally:
        coordinator.stop()


def test_redis_restart_ingestion_resumes(
    redis_server: RedisServer, redis_client: redis.Redis, stream_name: str
) -> None:
    batches = make_workload(seed=2, instances=2, batches_each=40)
    half = len(batches) // 2
    config = CoordinatorConfig(
        port=free_port(),
        chunk_size=CHUNK,
        event_transport="redis",
        redis_url=redis_server.url,
        event_stream=stream_name,
    )
    with BackgroundServer(config) as server:
        directory = server.service.directory
        xadd_all(redis_client, stream_name, batches[:half])
        assert wait_for(lambda: directory.stats().batches["applied"] == half, timeout=30)
        redis_server.restart()
        # An emitter keeps going through the restart: its sink retries until Redis is back.
        sink = EventSink(
            "late-node", RedisStreamTransport(redis_server.url, stream_name), incarnation=1
        )
        rest = batches[half:]
        fresh = redis.Redis.from_url(redis_server.url)
        xadd_all(fresh, stream_name, rest)
        fresh.close()
        sink.emit("store", "l2", "fs", rest[0].entries)
        assert sink.flush(timeout=30)
        sink.close()
        expected = oracle(
            [
                *batches,
                EventBatch("late-node", 1, 1, "store", "l2", "fs", ts=0, entries=rest[0].entries),
            ]
        )
        assert wait_for(
            lambda: listing_from_directory(directory) == listing_from_directory(expected),
            timeout=60,
        )
