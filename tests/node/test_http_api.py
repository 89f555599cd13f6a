"""The node's HTTP surface over loopback: the engine API replies msgpack (errors included, with
the error's own status), the peer route keeps its JSON errors, ``/engine/stats`` keeps its
shape."""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from fastapi import FastAPI

from kvatlas.asgi_thread import free_port
from kvatlas.auth import ANONYMOUS_ADMIN
from kvatlas.node.cache_node import CacheNode, NodeStats
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_trackers import Identity, Trackers, tracker_bytes
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
def app(node: CacheNode) -> FastAPI:
    return create_node_app(node)


@pytest.fixture
def client(app: FastAPI) -> Iterator[httpx.Client]:
    with (
        PeerServer(app, port=free_port()) as server,
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
    trackers = stats.pop("trackers")  # the engine API's own figures, beside the node's
    assert isinstance(typed, NodeStats) and typed.to_wire() == stats
    assert trackers == {
        "held": 0, "bytes": 0, "memory_budget": CONFIG.tracker_memory_bytes, "replaced": 0,
        "expired": 0, "evicted": 0, "not_kept": 0,
    }  # fmt: skip
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


def kv_of(n_chunks: int, value: float) -> np.ndarray:
    return np.full((n_chunks, *CONFIG.layout.shape), value, dtype=np.float32)


def retrieved(client: httpx.Client, toks: bytes, request_id: str) -> tuple[int, np.ndarray]:
    status, got = call(client, "/engine/retrieve", tokens=toks, request_id=request_id)
    assert status == 200
    kv = np.frombuffer(got["kv"], dtype=np.float32).reshape((-1, *CONFIG.layout.shape))
    return got["hit_tokens"], kv


def test_reused_request_id_never_keys_one_prompt_with_another(client: httpx.Client) -> None:
    """Issue 10 item 1: two requests that share an id (A for P1, B for P2) each store their KV
    under their own prompt's keys; a retrieve of P1 never returns B's KV."""
    p1, p2 = tokens(2 * C), (np.arange(2 * C, dtype="<u4") + 1000).tobytes()
    kv_a, kv_b = kv_of(2, 1.0), kv_of(2, 2.0)
    assert call(client, "/engine/lookup", tokens=p1, request_id="r")[1]["hit_tokens"] == 0
    assert call(client, "/engine/lookup", tokens=p2, request_id="r")[1]["hit_tokens"] == 0
    status, reply = call(
        client, "/engine/store", tokens=p2, request_id="r", kv=kv_b.tobytes(), n_chunks=2
    )
    assert (status, reply["stored"]) == (200, 2)
    status, reply = call(
        client, "/engine/store", tokens=p1, request_id="r", kv=kv_a.tobytes(), n_chunks=2
    )
    assert (status, reply["stored"]) == (200, 2)
    hit, kv = retrieved(client, p1, "x")
    assert hit == 2 * C and np.array_equal(kv, kv_a), "P1 must be served A's own KV"
    hit, kv = retrieved(client, p2, "y")
    assert hit == 2 * C and np.array_equal(kv, kv_b)


def test_reused_id_after_an_aborted_request_starts_a_new_tracker(client: httpx.Client) -> None:
    p1, p2 = tokens(2 * C), (np.arange(2 * C, dtype="<u4") + 7).tobytes()
    call(client, "/engine/lookup", tokens=p1, request_id="r")  # A is aborted after its lookup
    call(client, "/engine/lookup", tokens=p2, request_id="r")
    call(client, "/engine/store", tokens=p2, request_id="r", kv=kv_of(2, 3.0).tobytes(), n_chunks=2)
    assert retrieved(client, p1, "x")[0] == 0
    hit, kv = retrieved(client, p2, "y")
    assert hit == 2 * C and np.array_equal(kv, kv_of(2, 3.0))


def test_generated_tokens_extend_the_tracker(client: httpx.Client) -> None:
    """A later call whose tokens extend the held prompt (+ generated) continues the request:
    the generated tokens are appended, so chunks they complete are stored and keyed."""
    prompt = np.arange(C + C // 2, dtype="<u4")
    full = np.concatenate([prompt, np.arange(C // 2, dtype="<u4") + 500])
    call(client, "/engine/lookup", tokens=prompt.tobytes(), request_id="g")
    status, reply = call(
        client, "/engine/store", tokens=full.tobytes(), request_id="g",
        kv=kv_of(2, 4.0).tobytes(), n_chunks=2,
    )  # fmt: skip
    assert (status, reply["stored"]) == (200, 2)
    hit, kv = retrieved(client, full.tobytes(), "x")
    assert hit == 2 * C and np.array_equal(kv, kv_of(2, 4.0))


def test_trackers_are_dropped_at_end_of_request(
    client: httpx.Client, node: CacheNode, app: FastAPI
) -> None:
    held = app.state.engine_trackers
    p = tokens(2 * C)
    call(client, "/engine/lookup", tokens=p, request_id="a")
    assert len(held) == 1
    call(client, "/engine/store", tokens=p, request_id="a", kv=kv_of(2, 1.0).tobytes(), n_chunks=2)
    call(client, "/engine/blend-lookup", tokens=p, request_id="b")
    call(client, "/engine/lookup", tokens=p, request_id="c")
    assert len(held) == 2
    status, _ = call(client, "/engine/blend-retrieve", tokens=p, request_id="b", segments=[])
    assert status == 200
    call(client, "/engine/retrieve", tokens=p, request_id="c")
    assert len(held) == 0 and node.blend.pending_count() == 0


def test_held_trackers_stay_bounded_and_a_replaced_one_is_not_dropped_for_its_successor() -> None:
    now = [0.0]
    cancelled: list[str] = []
    held = Trackers(ttl=10.0, max_entries=2, clock=lambda: now[0], on_forget=cancelled.append)
    node = CacheNode(CONFIG, instance_id="n1")
    try:

        def ident(toks: list[int]) -> tuple[Identity, Any]:
            arr = np.array(toks, dtype="<u4")
            return Identity(arr, (), ""), lambda: node.tracker(token_ids=arr)

        t1, b1 = held.get_or_create(ANONYMOUS_ADMIN, "r", *ident([1, 2, 3]))
        t2, b2 = held.get_or_create(ANONYMOUS_ADMIN, "r", *ident([9, 9]))  # reused id, other tokens
        assert t2 is not t1 and b2 != b1 and cancelled == [b1] and held.replaced == 1
        held.drop(ANONYMOUS_ADMIN, "r", t1)  # the replaced request ends: its successor stays
        assert (
            held.get_or_create(ANONYMOUS_ADMIN, "r", *ident([9, 9, 4]))[0] is t2
        )  # generation continues
        assert list(t2.get_token_ids()) == [9, 9, 4]
        held.get_or_create(ANONYMOUS_ADMIN, "s", *ident([1]))
        held.get_or_create(ANONYMOUS_ADMIN, "t", *ident([1]))
        assert len(held) == 2  # "r" evicted beyond max_entries
        now[0] = 11.0
        held.get_or_create(ANONYMOUS_ADMIN, "u", *ident([1]))
        assert len(held) == 1  # "s" and "t" expired
    finally:
        node.close()


SEGMENT = {"chunk_hash": "00" * 32, "old_st": 0, "cur_st": 0, "length": C, "source": "local"}


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/engine/blend-retrieve", {"tokens": tokens(C), "segments": [{"old_st": 0}]}),
        ("/engine/blend-retrieve", {"tokens": tokens(C), "segments": [{**SEGMENT, "chunk_hash": "zz"}]}),
        ("/engine/blend-retrieve", {"tokens": tokens(C), "segments": [{**SEGMENT, "chunk_hash": "00"}]}),
        ("/engine/blend-retrieve", {"tokens": tokens(C), "segments": [{**SEGMENT, "length": 0}]}),
        ("/engine/blend-retrieve", {"tokens": tokens(C), "segments": [{**SEGMENT, "source": "x"}]}),
        ("/engine/store", {"tokens": tokens(C), "n_chunks": 1, "first_chunk": -5,
                           "kv": b"\0" * CONFIG.layout.chunk_bytes}),
        ("/engine/store", {"tokens": tokens(C), "n_chunks": -1, "kv": b""}),
        ("/engine/lookup", {"tokens": tokens(C), "mm_items": [{"identifier": "x", "offset": 0}]}),
        ("/engine/lookup", {"tokens": tokens(C), "cache_salt": "a/b"}),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_with_a_reason_not_a_500(
    client: httpx.Client, path: str, fields: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 16 item 12: a segment without ``chunk_hash`` (or with a bad one), a negative chunk
    index, ... is a 422 with a ``detail``: no 500, no ERROR traceback, no reset connection."""
    status, payload = call(client, path, **fields)
    assert status == 422 and isinstance(payload["detail"], str) and payload["detail"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", ["/engine/blend-lookup", "/engine/blend-retrieve"])
def test_a_blend_call_without_a_request_id_is_422_not_pending_forever(
    client: httpx.Client, path: str
) -> None:
    """The request id is what a blend lookup is polled under: without one, the reply was
    ``{"pending": true}`` on every poll."""
    for fields in ({"tokens": tokens(2 * C)}, {"tokens": tokens(2 * C), "request_id": ""}):
        status, payload = call(client, path, **fields)
        assert status == 422 and "request_id" in payload["detail"], (fields, payload)
    status, _ = call(client, "/engine/lookup", tokens=b"")
    assert status == 200  # an empty prompt is a lookup of nothing, not a missing field
    status, payload = call(client, "/engine/blend-lookup", tokens=tokens(2 * C), request_id="r1")
    assert status == 200 and "pending" in payload  # negative control: named, it is answered


def test_deeply_nested_msgpack_is_a_4xx(client: httpx.Client) -> None:
    for nested in (b"\x91" * 100_000 + b"\x00", b"\x81\xa8segments" + b"\x91" * 100_000 + b"\xc0"):
        r = client.post("/engine/blend-retrieve", content=nested, headers={"content-type": MSGPACK})
        assert 400 <= r.status_code < 500 and msgspec.msgpack.decode(r.content)["detail"]


def test_json_calls_get_json_replies_and_errors(client: httpx.Client) -> None:
    r = client.post("/engine/lookup", json={"tokens": 5})
    assert r.status_code == 422 and r.headers["content-type"] == "application/json"
    assert "malformed engine call" in r.json()["detail"]
    b64 = base64.b64encode(tokens(C)).decode()
    r = client.post("/engine/lookup", json={"tokens": b64, "cache_salt": "t"})
    assert r.status_code == 200 and r.json() == {"hit_tokens": 0, "cacheable": True}


def test_body_limits_follow_the_layout() -> None:
    small = dataclasses.replace(CONFIG, max_query_tokens=64)
    assert small.max_call_bytes == 64 * 4 + 64 // C * 256 + 64 * 1024
    assert small.max_store_bytes == small.max_call_bytes + 4 * CONFIG.layout.chunk_bytes
    assert dataclasses.replace(small, max_body_bytes=1000).max_store_bytes == 1000
    node = CacheNode(small, instance_id="n1")
    try:
        with (
            PeerServer(create_node_app(node), port=free_port()) as server,
            httpx.Client(base_url=server.url, timeout=30) as c,
        ):
            over = small.max_store_bytes // CONFIG.layout.chunk_bytes
            kv = b"\0" * (over * CONFIG.layout.chunk_bytes)
            status, payload = call(c, "/engine/store", tokens=tokens(4 * C), kv=kv, n_chunks=over)
            assert status == 413 and "exceeds" in payload["detail"]
            kv = b"\0" * (4 * CONFIG.layout.chunk_bytes)
            status, payload = call(c, "/engine/store", tokens=tokens(4 * C), kv=kv, n_chunks=4)
            assert (status, payload["stored"]) == (200, 4)
            status, payload = call(c, "/engine/lookup", tokens=tokens(65))
            assert status == 413 and "--max-query-tokens" in payload["detail"]
    finally:
        node.close()


def test_tracker_memory_budget_evicts_oldest_first() -> None:
    node = CacheNode(CONFIG, instance_id="n1")
    one = tracker_bytes(10 * C, C)
    held = Trackers(memory_bytes=3 * one, chunk_size=C)
    try:

        def get(rid: str, n: int) -> Any:
            arr = np.arange(n, dtype="<u4")
            make = lambda: node.tracker(token_ids=arr)  # noqa: E731
            return held.get_or_create(ANONYMOUS_ADMIN, rid, Identity(arr, (), ""), make)[0]

        first = get("r0", 10 * C)
        for i in range(1, 4):
            get(f"r{i}", 10 * C)
        stats = held.stats()
        assert (stats.held, stats.bytes, stats.evicted) == (3, 3 * one, 1)
        assert get("r0", 10 * C) is not first  # r0 was the oldest: evicted
        get("huge", 100 * C)  # alone over the budget: serves its call, not kept
        assert held.stats().not_kept == 1 and held.stats().bytes <= 3 * one
        grown = get("r3", 10 * C)
        assert get("r3", 30 * C) is grown  # generation continues; older entries make room
        assert held.stats().bytes <= 3 * one
    finally:
        node.close()
