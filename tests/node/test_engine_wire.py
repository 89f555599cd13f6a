"""The engine and peer APIs' wire is ``kvatlas.api`` (docs/node.md, "Engine API"): over real
loopback HTTP, every reply the node sends is of its type, a client refuses a reply that is not
(instead of reading a half-formed dict), and a call is checked by its type."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvatlas.api.engine import EngineLayout, InventoryReply, NodeHealthReply
from kvatlas.api.peer import PeerFetch, PeerRecord
from kvatlas.asgi_thread import free_port
from kvatlas.client.engine_client import ENGINE_REPLIES, MSGPACK, EngineCallError, EngineClient
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import create_node_app
from kvatlas.node.peer import PEER_KV_PATH, PeerServer

C = 16
CONFIG = NodeConfig(
    model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32",
    l1_bytes=1 << 20, l2="none",
)  # fmt: skip


@pytest.fixture(scope="module")
def node_url() -> Iterator[str]:
    node = CacheNode(CONFIG, instance_id="n1")
    try:
        with PeerServer(create_node_app(node), port=free_port()) as server:
            yield server.url
    finally:
        node.close()


def post(url: str, path: str, **fields: object) -> httpx.Response:
    body = msgspec.msgpack.encode(fields)
    return httpx.post(url + path, content=body, headers={"content-type": MSGPACK}, timeout=30)


def test_every_engine_reply_is_of_its_type(node_url: str) -> None:
    tokens = np.arange(2 * C, dtype="<u4").tobytes()
    kv = np.zeros((2, *CONFIG.layout.shape), dtype=np.float32).tobytes()
    calls = {
        "/engine/store": {"tokens": tokens, "kv": kv, "n_chunks": 2},
        "/engine/lookup": {"tokens": tokens},
        "/engine/retrieve": {"tokens": tokens, "request_id": "r"},
        "/engine/blend-lookup": {"tokens": tokens, "request_id": "b"},
        "/engine/blend-retrieve": {"tokens": tokens, "request_id": "b"},
    }
    assert set(calls) == set(ENGINE_REPLIES)
    for path, fields in calls.items():
        r = post(node_url, path, **fields)
        assert r.status_code == 200, (path, r.content)
        msgspec.msgpack.decode(r.content, type=ENGINE_REPLIES[path], strict=True)
    headers = {"accept": MSGPACK}
    for path, reply in (
        ("/engine/layout", EngineLayout),
        ("/engine/inventory", InventoryReply),
        ("/healthz", NodeHealthReply),
    ):
        got = httpx.get(node_url + path, headers=headers, timeout=30)
        msgspec.msgpack.decode(got.content, type=reply, strict=True)


@pytest.mark.parametrize("field", ["n_chunks", "first_chunk", "prefix_len"])
def test_a_negative_count_is_refused_by_the_calls_type(node_url: str, field: str) -> None:
    r = post(node_url, "/engine/store", tokens=b"", kv=b"", **{field: -1})
    assert r.status_code == 422
    assert field in msgspec.msgpack.decode(r.content)["detail"]


def test_peer_fetch_body_and_records_are_the_api_types(node_url: str) -> None:
    """The body a fetching node sends is a ``PeerFetch``; a key with a field no key has is a
    422 naming the key (it may carry identity), a body that is not a fetch a 400."""
    key = {"chunk_hash_hex": "00" * 32, "model_name": "toy", "kv_rank": 1 << 24 | 1 << 8}
    ok = httpx.post(node_url + PEER_KV_PATH, content=msgspec.json.encode({"keys": [key]}))
    assert ok.status_code == 200
    assert msgspec.msgpack.decode(ok.content, type=list[PeerRecord]) == []
    msgspec.json.decode(msgspec.json.encode({"keys": [key]}), type=PeerFetch)
    bad = httpx.post(node_url + PEER_KV_PATH, json={"keys": [{**key, "shard": 2}]})
    assert bad.status_code == 422 and "keys[0]" in bad.json()["detail"]
    assert httpx.post(node_url + PEER_KV_PATH, json={"keys": 5}).status_code == 400


def _fake_node(reply: bytes) -> FastAPI:
    app = FastAPI()

    @app.post("/engine/{call}")
    async def answer(call: str, request: Request) -> Response:
        return Response(reply, media_type=MSGPACK)

    return app


@pytest.mark.parametrize(
    ("method", "reply"),
    [
        ("store", {"stored": "3", "cacheable": True}),
        ("lookup", {"hit": 3}),
        ("retrieve", {"hit_tokens": 0, "kv": b"", "sources": {"l1": "x"}}),
    ],
)
def test_a_reply_not_of_its_type_is_an_engine_call_error(method: str, reply: object) -> None:
    """Before, the client read the reply as a dict: a wrong one was a KeyError, a TypeError or
    a wrong number (``int("3")``) in the engine; now it is refused whole, naming the field."""
    layout = EngineLayout(
        model_name="toy", hash_scheme="blake3", chunk_size=C, num_layers=1, num_kv_heads=1,
        head_dim=8, dtype="float32", rotary_dim=8, rope_style="neox", rope_theta=1e4,
        world_size=1, rank=0, kv_rank=1 << 24 | 1 << 8,
    )  # fmt: skip
    tokens = list(range(C))
    with (
        PeerServer(_fake_node(msgspec.msgpack.encode(reply)), port=free_port()) as server,
        EngineClient(server.url, layout) as client,
    ):
        call = {
            "store": lambda: client.store(tokens, [np.zeros(layout.shape, np.float32)]),
            "lookup": lambda: client.lookup(tokens),
            "retrieve": lambda: client.retrieve(tokens),
        }[method]
        with pytest.raises(EngineCallError, match="malformed reply"):
            call()
