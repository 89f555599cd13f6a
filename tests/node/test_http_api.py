"""The node's HTTP surface over loopback: the engine API replies msgpack (errors included, with
the error's own status), the peer route keeps its JSON errors, ``/engine/stats`` keeps its
shape."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.node.cache_node import CacheNode, NodeStats
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import MSGPACK, create_node_app
from kvatlas.node.peer import PEER_KV_PATH, PeerServer

C = 16
CONFIG = NodeConfig(
    model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32",
    l1_bytes=1 << 20, l2="none",
)  # fmt: skip


@pytest.fixture
def node() -> Iterator[CacheNode]:
    node = CacheNode(CONFIG, instance_id="n1")
    yield node
    node.close()


@pytest.fixture
def client(node: CacheNode) -> Iterator[httpx.Client]:
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        yield c


def call(client: httpx.Client, path: str, **fields: Any) -> tuple[int, Any]:
    r = client.post(path, content=msgspec.msgpack.encode(fields), headers={"content-type": MSGPACK})
    assert r.headers["content-type"] == MSGPACK
    return r.status_code, msgspec.msgpack.decode(r.content)


def tokens(n: int) -> bytes:
    return np.arange(n, dtype="<u4").tobytes()


def test_store_then_stats_shape(client: httpx.Client, node: CacheNode) -> None:
    kv = np.zeros((2, *CONFIG.layout.shape), dtype=np.float32).tobytes()
    assert call(client, "/engine/store", tokens=tokens(2 * C), kv=kv, n_chunks=2) == (
        200,
        {"stored": 2, "cacheable": True},
    )
    stats = msgspec.msgpack.decode(client.get("/engine/stats").content)
    assert list(stats)[:5] == ["instance_id", "l1_chunks", "l1_bytes", "local_index", "token_cache"]
    assert stats["instance_id"] == "n1" and stats["l1_chunks"] == 2
    assert stats["l1_bytes"] == 2 * CONFIG.layout.chunk_bytes
    assert stats["token_cache"] == {"chunks": 2, "misses": 0}
    assert stats["chunks_stored"] == 2  # counters sit flat beside the fields
    assert stats["local_index"] == dataclasses.asdict(node.index.stats())
    typed = node.stats()
    assert isinstance(typed, NodeStats) and typed.to_wire() == stats
    with pytest.raises(AttributeError):
        typed.l1_chunks = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/engine/lookup", {"tokens": b"abc"}),  # not uint32
        ("/engine/store", {"tokens": tokens(C), "kv": b"\0" * 12, "n_chunks": 1}),  # wrong size
        ("/engine/blend-lookup", {"tokens": tokens(C), "prefix_len": -1}),  # a plain ValueError
        ("/engine/lookup", {"tokens": 5}),  # malformed call
    ],
)
def test_engine_errors_are_msgpack_422(
    client: httpx.Client, path: str, fields: dict[str, Any]
) -> None:
    status, payload = call(client, path, **fields)
    assert status == 422 and isinstance(payload["detail"], str) and payload["detail"]


def test_peer_route_keeps_json_errors(client: httpx.Client) -> None:
    r = client.post(PEER_KV_PATH, content=b"not json")
    assert r.status_code == 400 and "detail" in r.json()
    r = client.post(PEER_KV_PATH, content=b'{"keys": [{"model_name": "m"}]}')
    assert r.status_code == 422 and "detail" in r.json()
