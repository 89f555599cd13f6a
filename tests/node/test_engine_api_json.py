"""The engine API for someone without kvatlas installed: JSON calls with KV as base64 round-trip
bit-exactly, the node publishes its OpenAPI (with the engine calls' body schemas) and /docs,
``GET /engine/layout`` describes the KV, and ``kvatlas.client.EngineClient`` needs only the URL."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.client import EngineClient, EngineLayout
from kvatlas.processes import spawn_service, stop

C = 16
SHAPE = (1, 2, C, 2, 8)


@pytest.fixture(scope="module")
def node_url() -> Iterator[str]:
    port = free_port()
    args = [
        "-m", "kvatlas.cli", "node", "--port", str(port), "--model-name", "toy",
        "--num-layers", "1", "--num-kv-heads", "2", "--head-dim", "8", "--chunk-size", str(C),
        "--dtype", "bfloat16", "--l2", "none", "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc: subprocess.Popen[bytes] = spawn_service(args, url, timeout=120)
    try:
        yield url
    finally:
        stop([proc])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_json_store_and_retrieve_round_trip_kv_as_base64(node_url: str) -> None:
    tokens = np.arange(7000, 7000 + 2 * C, dtype="<u4")
    kv = np.random.default_rng(1).integers(0, 1 << 16, size=(2, *SHAPE), dtype="<u2")  # bf16 bits
    stored = httpx.post(
        f"{node_url}/engine/store",
        json={"tokens": _b64(tokens.tobytes()), "kv": _b64(kv.tobytes()), "n_chunks": 2},
    )
    assert stored.status_code == 200 and stored.headers["content-type"] == "application/json"
    assert stored.json() == {"stored": 2, "cacheable": True}
    got = httpx.post(f"{node_url}/engine/retrieve", json={"tokens": _b64(tokens.tobytes())})
    assert got.status_code == 200 and got.json()["hit_tokens"] == 2 * C
    assert base64.b64decode(got.json()["kv"]) == kv.tobytes()  # bit-exact, NaN patterns included


def test_json_errors_are_json(node_url: str) -> None:
    r = httpx.post(f"{node_url}/engine/store", json={"tokens": _b64(b"\0" * 4 * C), "kv": "AAAA"})
    assert r.status_code == 422 and r.headers["content-type"] == "application/json"
    assert "kv bytes do not match" in r.json()["detail"]


def test_openapi_declares_every_engine_call_with_its_body(node_url: str) -> None:
    spec = httpx.get(f"{node_url}/openapi.json").json()
    calls = ("store", "lookup", "retrieve", "blend-lookup", "blend-retrieve")
    for call in calls:
        body = spec["paths"][f"/engine/{call}"]["post"]["requestBody"]["content"]
        assert set(body) == {"application/json", "application/msgpack"}
        assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/EngineCall"}
    call_schema = spec["components"]["schemas"]["EngineCall"]
    assert call_schema["properties"]["kv"]["contentEncoding"] == "base64"
    assert "WireSegment" in spec["components"]["schemas"]
    assert "/engine/layout" in spec["paths"]
    docs = httpx.get(f"{node_url}/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_engine_client_reads_the_layout_from_the_node(node_url: str) -> None:
    layout = httpx.get(f"{node_url}/engine/layout").json()
    assert layout["kv_rank"] == 16777472 and layout["rotary_dim"] == 8
    with EngineClient(node_url) as client:
        assert isinstance(client.layout, EngineLayout)
        assert client.layout.shape == SHAPE and str(client.layout.numpy_dtype()) == "bfloat16"
        tokens = np.arange(9000, 9000 + C)
        kv = np.full((1, *SHAPE), 1.5, dtype=client.layout.numpy_dtype())
        assert client.store(tokens, kv) == 1
        chunks, sources = client.retrieve(tokens)
        assert len(chunks) == 1 and np.array_equal(chunks[0], kv[0]) and sources
        segments = None
        query = np.concatenate([np.arange(100, 104), tokens])
        while segments is None:
            segments = client.blend_segments(query, "r")
        assert [(s.cur_st, s.old_st) for s in segments] == [(4, 0)]
        parts = client.blend_parts(query, "r", segments)["parts"]
        assert parts[0][1].shape == SHAPE


def test_retrieve_from_first_chunk_sends_only_the_chunks_asked(node_url: str) -> None:
    """An engine holding a prompt's first chunks in its own prefix cache asks for the rest only
    (``first_chunk``): the node used to fetch and send every leading chunk (the
    vLLM connector placed the ones it needed and dropped the others). ``hit_tokens`` still
    counts from the request's start."""
    tokens = np.arange(11_000, 11_000 + 4 * C, dtype="<u4")
    kv = np.random.default_rng(2).integers(0, 1 << 16, size=(4, *SHAPE), dtype="<u2")
    with EngineClient(node_url) as client:
        assert client.store(tokens, kv.view(client.layout.numpy_dtype())) == 4
        chunks, sources = client.retrieve(tokens, first_chunk=1)
        want = [kv[1].tobytes(), kv[2].tobytes(), kv[3].tobytes()]
        assert [c.view("<u2").tobytes() for c in chunks] == want
        assert sum(sources.values()) == 3
        chunks, _ = client.retrieve(tokens, first_chunk=3)  # to the end
        assert [c.view("<u2").tobytes() for c in chunks] == [kv[3].tobytes()]
        assert client.retrieve(tokens, first_chunk=4) == ([], {})  # nothing left to send
    body = {"tokens": _b64(tokens.tobytes()), "first_chunk": 2}
    got = httpx.post(f"{node_url}/engine/retrieve", json=body).json()
    assert got["hit_tokens"] == 4 * C  # from the request's start
    assert base64.b64decode(got["kv"]) == kv[2:].tobytes()


def test_a_node_that_ignores_first_chunk_is_read_from_chunk_0(
    node_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node from before ``first_chunk`` answers from chunk 0 (its ``hit_tokens`` counts the
    chunks sent): the client skips to ``first_chunk``, never placing chunk 0's KV at 2's."""
    from kvatlas.api.engine import RetrieveReply

    tokens = np.arange(12_000, 12_000 + 3 * C, dtype="<u4")
    kv = np.random.default_rng(3).integers(0, 1 << 16, size=(3, *SHAPE), dtype="<u2")
    with EngineClient(node_url) as client:
        assert client.store(tokens, kv.view(client.layout.numpy_dtype())) == 3
        real = client._call

        def old_node(path: str, **fields: object) -> object:
            fields.pop("first_chunk", None)
            return real(path, **fields)

        monkeypatch.setattr(client, "_call", old_node)
        chunks, _ = client.retrieve(tokens, first_chunk=2)
        assert [c.view("<u2").tobytes() for c in chunks] == [kv[2].tobytes()]
        reply = real("/engine/retrieve", tokens=tokens)
        assert isinstance(reply, RetrieveReply) and reply.hit_tokens == 3 * C
