"""A served model's real vocabulary end to end over HTTP: token ids of Llama 3 (128,256, above
2^16) and at the form boundaries (2^24 - 1, 2^24, 2^32 - 1) ingested as JSON and msgpack,
answered exactly by lookups and blend lookups, kept in the planes form where it is smaller
(``directory/token_store.py``), and the same after a restart restores the snapshot."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from kvatlas.client import CoordinatorClient
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch, encode_json, encode_msgpack
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.workloads import LLAMA3, random_token_ids

C = 256
RANK = pack_kv_rank(1, 0, 1, 0)


def contents() -> np.ndarray:
    rows = random_token_ids(np.random.default_rng(31), (6, C), LLAMA3)
    rows[0, 7] = (1 << 24) - 1  # the planes form's largest id (8 high bits)
    rows[1, 0] = 1 << 24  # uint32
    rows[2, -1] = (1 << 32) - 1  # uint32
    rows[3] %= 1 << 16  # uint16
    return rows


def batch(rows: np.ndarray, seq: int, first: int) -> EventBatch:
    entries = tuple(
        CacheEntry(ObjectKey(chunk_hashes(r, C)[0], "m", RANK), 64, r, (first + i) * C)
        for i, r in enumerate(rows)
    )
    return EventBatch("node", 5, seq, "store", "l1", "dram", entries=entries)


def check(url: str, rows: np.ndarray) -> None:
    """Every chunk found at its stored offset inside a longer query, and its exact ids."""
    query = np.concatenate([np.array([9, 130_000, 9], np.uint32), *rows[::-1]])
    reply = httpx.post(
        f"{url}/directory/blend-lookup", json={"token_ids": query.tolist(), "model_name": "m"}
    )
    reply.raise_for_status()
    got = sorted((m["old_st"], m["cur_st"]) for m in reply.json()["matches"])
    n = len(rows)
    assert got == sorted((i * C, 3 + (n - 1 - i) * C) for i in range(n))
    near = query.copy()
    near[3 + 5] ^= 1 << 16  # one high bit off in the last chunk: that one is gone
    reply = httpx.post(
        f"{url}/directory/blend-lookup", json={"token_ids": near.tolist(), "model_name": "m"}
    )
    assert len(reply.json()["matches"]) == n - 1
    with CoordinatorClient(url) as client:
        keys = [ObjectKey(chunk_hashes(r, C)[0], "m", RANK) for r in rows]
        results = client.lookup_keys(keys).results
        assert [r.token_ids for r in results] == rows.tolist()


def test_large_vocabulary_ids_round_trip_over_http_and_a_restart(tmp_path: Path) -> None:
    rows = contents()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = CoordinatorConfig(
        port=port, chunk_size=C, enable_blend_lookup=True, snapshot_path=tmp_path / "d.snap"
    )
    with BackgroundServer(config) as server:
        for body, kind in (
            (encode_json([batch(rows[:3], 1, 0)]), "application/json"),
            (encode_msgpack([batch(rows[3:], 2, 3)]), "application/msgpack"),
        ):
            httpx.post(
                f"{url}/events", content=body, headers={"Content-Type": kind}
            ).raise_for_status()
        check(url, rows)
        stats = server.service.directory.stats().blend
        assert stats is not None  # 546: Llama 3's ids (h = 1); 770: h = 8; 1,024: uint32
        assert stats.token_bytes == 770 + 2 * 1024 + 512 + 2 * 546
    with BackgroundServer(config) as server:  # restored from the shutdown snapshot
        assert server.service.directory.stats().keys == len(rows)
        check(url, rows)
