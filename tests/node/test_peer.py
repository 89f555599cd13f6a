"""Peer L1 over real loopback HTTP: sparse fetch, pins during transfer, failures as misses,
token ids never sent (a digest instead). Hostile peers (drip, oversize): test_fetch_security."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvatlas.coordinator.server import free_port
from kvatlas.keys import ObjectKey
from kvatlas.node.chunk_digest import tokens_digest
from kvatlas.node.l1 import L1Cache
from kvatlas.node.peer import PEER_KV_PATH, PeerClient, PeerServer, create_peer_app
from kvatlas.node.stored_chunk import StoredChunk, encode_chunk

CHUNK_BYTES = 64 * 2 + 4 * 4  # KV and tokens of chunk(i)


def client_for(url: str, **kw: Any) -> PeerClient:
    return PeerClient(url, **{"max_chunk_bytes": CHUNK_BYTES, **kw})


def records(*chunks: StoredChunk | bytes) -> bytes:
    """A reply as a peer sends it: each chunk without tokens, with their digest."""
    out = []
    for c in chunks:
        if isinstance(c, bytes):
            out.append({"chunk": c, "tokens_digest": None})
            continue
        assert c.tokens is not None
        bare = StoredChunk(c.key, c.kv, None, c.token_offset)
        out.append({"chunk": encode_chunk(bare), "tokens_digest": tokens_digest(c.tokens)})
    return msgspec.msgpack.encode(out)


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "org/model", 1 << 24 | 1 << 8)


def chunk(i: int, n: int = 64) -> StoredChunk:
    kv = np.arange(n, dtype=np.float16).reshape(2, 2, n // 4) + np.float16(i)
    return StoredChunk(key(i), kv, np.arange(i, i + 4, dtype=np.uint32), 256 * i)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[L1Cache, PeerServer]]:
    l1 = L1Cache(1 << 20)
    for i in range(0, 10, 2):
        l1.put(chunk(i))
    with PeerServer(create_peer_app(l1), port=free_port()) as server:
        yield l1, server


def test_fetch_sparse_set_returns_present_keys_only(served: tuple[L1Cache, PeerServer]) -> None:
    _, server = served
    with client_for(server.url) as client:
        reply = client.fetch([key(i) for i in range(10)] + [key(4)])
    found = reply.chunks
    assert set(found) == {key(i) for i in range(0, 10, 2)} and not reply.failure
    for i in range(0, 10, 2):
        got, digest = found[key(i)]
        want = chunk(i)
        assert np.array_equal(got.kv, want.kv) and got.kv.dtype == np.float16
        assert got.token_offset == 256 * i
        # the prompt's token ids never leave the peer: only their digest does
        assert want.tokens is not None and got.tokens is None
        assert digest == tokens_digest(want.tokens)


def test_reply_carries_no_token_ids(served: tuple[L1Cache, PeerServer]) -> None:
    _, server = served
    want = chunk(2)
    assert want.tokens is not None
    r = httpx.post(server.url + PEER_KV_PATH, json=_wire([key(2)]))
    assert r.status_code == 200
    assert want.tokens.astype("<u4").tobytes() not in r.content
    assert msgspec.msgpack.decode(r.content)[0]["tokens_digest"] == tokens_digest(want.tokens)


def test_peer_token_is_sent_on_every_call() -> None:
    seen: list[str | None] = []
    app = FastAPI()

    @app.post(PEER_KV_PATH)
    async def peer_kv(request: Request) -> Response:
        seen.append(request.headers.get("authorization"))
        return _octets(records(chunk(1)))

    with PeerServer(app, port=free_port()) as server:
        with client_for(server.url, token="peer-secret") as client:
            assert set(client.fetch([key(1)]).chunks) == {key(1)}
            assert set(client.fetch([key(1)]).chunks) == {key(1)}
        with client_for(server.url) as client:
            client.fetch([key(1)])
    assert seen == ["Bearer peer-secret", "Bearer peer-secret", None]


def test_fetch_nothing_makes_no_request() -> None:
    client = client_for(f"http://127.0.0.1:{free_port()}")
    reply = client.fetch([])
    assert reply.chunks == {} and not reply.failure


def test_serving_touches_lru(served: tuple[L1Cache, PeerServer]) -> None:
    l1, server = served
    oldest = l1.keys()[0]
    with client_for(server.url) as client:
        assert set(client.fetch([oldest]).chunks) == {oldest}
    assert l1.keys()[-1] == oldest


def _wire(keys: list[ObjectKey]) -> dict[str, Any]:
    return {"keys": [k.to_wire() for k in keys]}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json", 400),
        (b"[]", 400),
        (b'{"keys": 5}', 400),
        (b'{"keys": [], "extra": 1}', 400),
        (b'{"keys": [{"chunk_hash_hex": "zz", "model_name": "m", "kv_rank": 1}]}', 422),
        (b'{"keys": [{"model_name": "m"}]}', 422),
        (b'{"keys": [{"chunk_hash_hex": 1, "model_name": [], "kv_rank": "x"}]}', 422),
        (msgspec.json.encode(_wire([key(1)] * 5000)), 413),
        (b" " * (5 * 1024 * 1024), 413),
    ],
)
def test_bad_requests_are_4xx(served: tuple[L1Cache, PeerServer], body: bytes, status: int) -> None:
    _, server = served
    r = httpx.post(server.url + PEER_KV_PATH, content=body, timeout=10)
    assert r.status_code == status, r.text
    assert "detail" in r.json()


def test_empty_key_list_is_an_empty_reply(served: tuple[L1Cache, PeerServer]) -> None:
    _, server = served
    r = httpx.post(server.url + PEER_KV_PATH, json={"keys": []})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    assert msgspec.msgpack.decode(r.content) == []
    assert httpx.get(server.url + PEER_KV_PATH).status_code == 405


def test_listed_chunks_stay_pinned_during_transfer() -> None:
    """Hold the transfer open inside the serializer, storm the serving L1, then release.

    Without pins the storm evicts every listed chunk before the serializer reaches it (the
    test checks the storm really was that strong: the unlisted chunk and, afterwards, the
    no-longer-pinned listed chunks go).
    """
    unit = chunk(0).nbytes
    l1 = L1Cache(4 * unit)
    listed = [key(1), key(2), key(3)]
    for i in (1, 2, 3, 4):
        l1.put(chunk(i))
    in_transfer = threading.Event()
    release = threading.Event()

    def slow_encoder(c: StoredChunk) -> bytes:
        if not in_transfer.is_set():
            in_transfer.set()
            assert release.wait(10), "test never released the transfer"
        return encode_chunk(c)

    result: dict[ObjectKey, object] = {}
    with PeerServer(create_peer_app(l1, encoder=slow_encoder), port=free_port()) as server:
        client = client_for(server.url, deadline=15)
        fetcher = threading.Thread(
            target=lambda: result.update(client.fetch([*listed, key(9)]).chunks)
        )
        fetcher.start()
        try:
            assert in_transfer.wait(10)
            assert all(l1.is_pinned(k) for k in listed)
            for i in range(100, 140):  # a put storm on the serving node
                l1.put(chunk(i))
            assert all(l1.contains(k) for k in listed)
            assert not l1.contains(key(4))  # the storm evicted everything it could
        finally:
            release.set()
            fetcher.join(15)
        assert set(result) == set(listed)
        assert not any(l1.is_pinned(k) for k in listed)  # pins end with the reply
        for i in range(200, 210):
            l1.put(chunk(i))
        assert not any(l1.contains(k) for k in listed)
        client.close()


def test_peer_down_is_empty_and_quick() -> None:
    client = client_for(f"http://127.0.0.1:{free_port()}", deadline=60.0)
    start = time.monotonic()
    reply = client.fetch([key(1), key(2)])
    assert reply.chunks == {} and reply.failure == "unreachable"
    assert time.monotonic() - start < 30.0  # refused at once: never waits out the timeout
    client.close()


def test_peer_dies_between_fetches() -> None:
    l1 = L1Cache(1 << 20)
    l1.put(chunk(1))
    server = PeerServer(create_peer_app(l1), port=free_port()).start()
    client = client_for(server.url, deadline=60.0)
    assert set(client.fetch([key(1)]).chunks) == {key(1)}
    server.stop()
    start = time.monotonic()
    reply = client.fetch([key(1)])
    assert reply.chunks == {} and reply.failure == "unreachable"
    assert time.monotonic() - start < 30.0  # refused at once: never waits out the timeout
    client.close()


def test_silent_peer_times_out_to_empty() -> None:
    """A peer that accepts but never answers ends in a miss by the whole-call deadline
    (the failure cause says so: no wall-clock bound needed)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        client = client_for(f"http://127.0.0.1:{port}", deadline=0.3)
        reply = client.fetch([key(1)])
        assert reply.chunks == {} and reply.failure == "deadline"
        client.close()
    finally:
        listener.close()


HTTPX_DEFAULT_TIMEOUT = 5.0


def test_the_clients_own_timeout_governs_not_httpx_default() -> None:
    """A peer that answers after httpx's default timeout: the reply arrives with a longer
    client deadline and is a miss with a shorter one. Which one happened does not depend on
    how loaded the machine is (delays only make the reply later), so no clock is read."""
    l1 = L1Cache(1 << 20)
    l1.put(chunk(1))
    app = create_peer_app(l1)

    async def late(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(HTTPX_DEFAULT_TIMEOUT + 1)
        await app(scope, receive, send)

    with PeerServer(late, port=free_port()) as server:  # type: ignore[arg-type]
        patient = client_for(server.url, deadline=60.0)
        assert set(patient.fetch([key(1)]).chunks) == {key(1)}
        patient.close()
        hasty = client_for(server.url, deadline=0.3)
        reply = hasty.fetch([key(1)])
        assert reply.chunks == {} and reply.failure == "deadline"
        hasty.close()


@pytest.fixture(scope="module")
def misbehaving() -> Iterator[tuple[PeerServer, dict[str, Response]]]:
    """A 'peer' whose reply the test chooses."""
    reply: dict[str, Response] = {}
    app = FastAPI()

    @app.post(PEER_KV_PATH)
    async def peer_kv() -> Response:
        return reply["next"]

    with PeerServer(app, port=free_port()) as server:
        yield server, reply


def _octets(content: bytes, status: int = 200) -> Response:
    return Response(content, status_code=status, media_type="application/octet-stream")


@pytest.mark.parametrize(
    "response",
    [
        _octets(b"\xc1 definitely not msgpack"),
        _octets(msgspec.msgpack.encode({"not": "a list"})),
        _octets(msgspec.msgpack.encode([1, 2, 3])),
        _octets(b""),
        _octets(msgspec.msgpack.encode([encode_chunk(chunk(1))])),  # records without a map
        _octets(records(chunk(1)), status=500),
        _octets(records(chunk(1))[:-10]),
    ],
)
def test_garbage_reply_is_empty(
    misbehaving: tuple[PeerServer, dict[str, Response]], response: Response
) -> None:
    server, reply = misbehaving
    reply["next"] = response
    with client_for(server.url) as client:
        got = client.fetch([key(1)])
    assert got.chunks == {} and got.failure in ("bad_reply", "refused")


def test_corrupt_and_unrequested_chunks_are_dropped(
    misbehaving: tuple[PeerServer, dict[str, Response]],
) -> None:
    server, reply = misbehaving
    corrupt = bytearray(encode_chunk(chunk(2)))
    corrupt[-40] ^= 0xFF
    entries = msgspec.msgpack.decode(records(chunk(1), bytes(corrupt), chunk(7)))
    entries.append({"chunk": encode_chunk(chunk(3)), "tokens_digest": b"short"})
    reply["next"] = _octets(msgspec.msgpack.encode(entries))
    with client_for(server.url) as client:
        got = client.fetch([key(1), key(2), key(3)])
    assert set(got.chunks) == {key(1)}  # 2 corrupt, 7 never requested, 3's digest malformed
    assert got.dropped == 3 and not got.failure


def test_oversized_reply_is_empty(misbehaving: tuple[PeerServer, dict[str, Response]]) -> None:
    server, reply = misbehaving
    reply["next"] = _octets(records(chunk(1, 4096)))
    with client_for(server.url) as client:
        got = client.fetch([key(1)])
    assert got.chunks == {} and got.failure == "too_large"
    with client_for(server.url, max_chunk_bytes=4096 * 2 + 16) as client:
        assert set(client.fetch([key(1)]).chunks) == {key(1)}
