"""Fuzz the node's HTTP API over real loopback HTTP (issue 16 item 12): the engine routes take
raw msgpack or JSON bodies (no request schema in the OpenAPI document to fuzz from), so
hypothesis builds calls of the right and wrong shapes — every field right, wrong-typed,
missing, out of range — plus mutated bytes, and ``/peer/kv`` bodies. No reply may be a 5xx,
every refusal carries a ``detail``, and the node keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.asgi_thread import free_port
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import MSGPACK, create_node_app
from kvatlas.node.peer import PEER_KV_PATH, PeerServer

C = 16
CONFIG = NodeConfig(
    model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32",
    l1_bytes=1 << 20, l2="none", max_query_tokens=1024,
)  # fmt: skip
CHUNK_BYTES = CONFIG.layout.chunk_bytes
PATHS = ["/engine/store", "/engine/lookup", "/engine/retrieve", "/engine/blend-lookup",
         "/engine/blend-retrieve"]  # fmt: skip
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    node = CacheNode(CONFIG, instance_id="fuzz")
    toks = np.arange(4 * C, dtype=np.uint32)
    node.store(node.tracker(token_ids=toks), list(np.zeros((4, *CONFIG.layout.shape), "f4")))
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        yield c
    node.close()


anything = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
small_int = st.integers(-3, 4 * C + 3) | st.integers(-(2**63), 2**63 - 1)
token_bytes = st.lists(st.integers(0, 2**32 - 1), max_size=6 * C).map(
    lambda t: np.array(t, dtype="<u4").tobytes()
) | st.binary(max_size=24)
salt = st.sampled_from(["", "tenant", "a/b", "x" * 300, "\x00"]) | st.text(max_size=6)


def maybe(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right shape, sometimes anything at all."""
    return st.one_of(right, right, right, anything)


segment = st.fixed_dictionaries(
    {},
    optional={
        "chunk_hash": maybe(st.sampled_from(["00" * 32, "ab" * 32, "zz", "", "00"])),
        "old_st": maybe(small_int),
        "cur_st": maybe(small_int),
        "length": maybe(small_int),
        "source": maybe(st.sampled_from(["local", "fleet", "prefix", "x"])),
        "cost": maybe(small_int),
        "trim": maybe(small_int),
    },
)
mm_item = st.fixed_dictionaries(
    {},
    optional={
        "identifier": maybe(st.text(max_size=8)),
        "offset": maybe(small_int),
        "length": maybe(small_int),
    },
)
call = st.fixed_dictionaries(
    {},
    optional={
        "tokens": maybe(token_bytes),
        "cache_salt": maybe(salt),
        "request_id": maybe(st.sampled_from(["", "r1", "r2"])),
        "prefix_len": maybe(small_int),
        "mm_items": maybe(st.lists(mm_item, max_size=3)),
        "kv": maybe(st.integers(0, 5).map(lambda n: b"\0" * (n * CHUNK_BYTES)) | st.binary(max_size=9)),
        "n_chunks": maybe(small_int),
        "first_chunk": maybe(small_int),
        "segments": maybe(st.lists(segment, max_size=4)),
        "extra": anything,
    },
)  # fmt: skip


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.content[:300])
    if r.status_code != 200:
        decoded = (
            msgspec.msgpack.decode(r.content) if r.headers["content-type"] == MSGPACK else r.json()
        )
        assert isinstance(decoded["detail"], str) and decoded["detail"], decoded


def encode(body: Any, as_json: bool) -> bytes:
    try:
        return msgspec.json.encode(body) if as_json else msgspec.msgpack.encode(body)
    except (OverflowError, TypeError, ValueError):  # a value the format cannot carry
        return b"\xc1"


@FUZZ
@given(path=st.sampled_from(PATHS), body=call, as_json=st.booleans())
def test_engine_calls_fuzz_no_server_errors(
    client: httpx.Client, path: str, body: dict[str, Any], as_json: bool
) -> None:
    content_type = "application/json" if as_json else MSGPACK
    check(client.post(path, content=encode(body, as_json), headers={"content-type": content_type}))


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    raw=st.binary(max_size=64)
    | st.builds(lambda n, tail: b"\x91" * n + tail, st.integers(1, 20_000), st.binary(max_size=4))
    | st.builds(lambda n: b"\x81\xa6tokens" + b"\x81\xa1a" * n + b"\xc0", st.integers(1, 5_000)),
    content_type=st.sampled_from([MSGPACK, "application/json", "text/plain", ""]),
)
def test_raw_bodies_fuzz_no_server_errors(
    client: httpx.Client, path: str, raw: bytes, content_type: str
) -> None:
    check(client.post(path, content=raw, headers={"content-type": content_type}))


@FUZZ
@given(
    body=st.fixed_dictionaries(
        {}, optional={"keys": maybe(st.lists(st.dictionaries(st.text(max_size=12), anything)))}
    )
    | anything
)
def test_peer_bodies_fuzz_no_server_errors(client: httpx.Client, body: Any) -> None:
    check(client.post(PEER_KV_PATH, content=encode(body, True)))


def test_node_still_serving_after_fuzz(client: httpx.Client) -> None:
    toks = np.arange(4 * C, dtype="<u4").tobytes()
    r = client.post(
        "/engine/lookup",
        content=msgspec.msgpack.encode({"tokens": toks}),
        headers={"content-type": MSGPACK},
    )
    assert r.status_code == 200 and msgspec.msgpack.decode(r.content)["hit_tokens"] == 4 * C
