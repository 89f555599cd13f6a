"""The engine API's body limits hold for both formats: the largest legitimate call (a store of
``--max-query-tokens`` tokens with their KV, a lookup of that many tokens) is accepted as msgpack
and as JSON (bytes as base64, 4/3 larger), a body of exactly a format's limit is accepted and
one byte more is a 413. Found by black-box probing: the limits were msgpack's for both, so a
legitimate JSON store or large lookup was refused."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.processes import spawn_service, stop
from tests.helpers import TOY_LAYOUT, toy_node_flags

STORE_TOKENS, STORE_CHUNK = 1024, 16
LOOKUP_TOKENS, LOOKUP_CHUNK = 262_144, 256
CHUNK_BYTES = TOY_LAYOUT.chunk_bytes  # the toy layout's, at chunks of 16


def b64(n: int) -> int:
    """Characters of ``n`` bytes in base64."""
    return 4 * -(-n // 3)


def call_limit(tokens: int, chunk: int, fmt: str) -> int:
    """docs/node.md, "Security": the tokens (uint32; base64 in JSON), a segment per chunk,
    64 KiB of fields."""
    token_bytes = tokens * 4 if fmt == "msgpack" else b64(tokens * 4)
    return token_bytes + tokens // chunk * 256 + 64 * 1024


def store_limit(fmt: str) -> int:
    kv = STORE_TOKENS // STORE_CHUNK * CHUNK_BYTES
    return call_limit(STORE_TOKENS, STORE_CHUNK, fmt) + (kv if fmt == "msgpack" else b64(kv))


def spawn(chunk: int, max_tokens: int) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "kvatlas.cli", "node", "--port", str(port), *toy_node_flags(chunk),
            "--max-query-tokens", str(max_tokens)]  # fmt: skip
    proc: subprocess.Popen[bytes] = spawn_service(args, url)
    try:
        yield url
    finally:
        stop([proc])


@pytest.fixture(scope="module")
def store_node() -> Iterator[str]:
    yield from spawn(STORE_CHUNK, STORE_TOKENS)


@pytest.fixture(scope="module")
def lookup_node() -> Iterator[str]:
    yield from spawn(LOOKUP_CHUNK, LOOKUP_TOKENS)


def encode(fields: dict[str, object], fmt: str) -> bytes:
    if fmt == "json":
        b = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
             for k, v in fields.items()}  # fmt: skip
        return json.dumps(b).encode()
    return msgspec.msgpack.encode(fields)


def padded(fields: dict[str, object], fmt: str, size: int) -> bytes:
    """``fields`` encoded as exactly ``size`` bytes: padded by a field the node ignores."""
    n = 0
    for _ in range(8):
        body = encode({**fields, "pad": "x" * n}, fmt)
        if len(body) == size:
            return body
        n = max(0, n + size - len(body))
    raise AssertionError(f"cannot pad to {size} bytes")


def post(url: str, path: str, body: bytes, fmt: str) -> httpx.Response:
    ctype = "application/json" if fmt == "json" else "application/msgpack"
    headers = {"Content-Type": ctype, "Accept": ctype}
    return httpx.post(url + path, content=body, headers=headers, timeout=120)


def reply(r: httpx.Response, fmt: str) -> dict[str, object]:
    got: dict[str, object] = r.json() if fmt == "json" else msgspec.msgpack.decode(r.content)
    return got


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_a_whole_max_query_tokens_store_fits_either_format_and_one_byte_more_is_413(
    store_node: str, fmt: str
) -> None:
    n_chunks = STORE_TOKENS // STORE_CHUNK
    tokens = np.arange(1000, 1000 + STORE_TOKENS, dtype="<u4").tobytes()
    kv = np.ones((n_chunks, *TOY_LAYOUT.shape), dtype="<f4").tobytes()
    fields: dict[str, object] = {"tokens": tokens, "kv": kv, "n_chunks": n_chunks}
    r = post(store_node, "/engine/store", encode(fields, fmt), fmt)
    assert r.status_code == 200, r.text
    assert reply(r, fmt)["stored"] == n_chunks
    limit = store_limit(fmt)
    r = post(store_node, "/engine/store", padded(fields, fmt, limit), fmt)
    assert r.status_code == 200 and reply(r, fmt)["stored"] == n_chunks, r.content[:200]
    r = post(store_node, "/engine/store", padded(fields, fmt, limit + 1), fmt)
    assert r.status_code == 413, r.content[:200]


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_a_max_query_tokens_lookup_fits_either_format_and_one_byte_more_is_413(
    lookup_node: str, fmt: str
) -> None:
    fields: dict[str, object] = {"tokens": np.arange(LOOKUP_TOKENS, dtype="<u4").tobytes()}
    r = post(lookup_node, "/engine/lookup", encode(fields, fmt), fmt)
    assert r.status_code == 200, r.content[:200]
    assert reply(r, fmt)["hit_tokens"] == 0
    limit = call_limit(LOOKUP_TOKENS, LOOKUP_CHUNK, fmt)
    r = post(lookup_node, "/engine/lookup", padded(fields, fmt, limit), fmt)
    assert r.status_code == 200, r.content[:200]
    r = post(lookup_node, "/engine/lookup", padded(fields, fmt, limit + 1), fmt)
    assert r.status_code == 413, r.content[:200]
