"""Peers serve private L2 on request (issue 11, convergence.md §4): ``POST /peer/kv`` with
``tiers`` (default ``["l1"]``) over real loopback HTTP, the reply format unchanged (records of
``chunk`` without token ids and ``tokens_digest``), shared pools never served; and end to end
with real processes, a chunk that only another node's private L2 holds is counted by a prefix
lookup *and* retrieved (before: counted, then missed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.keys import ObjectKey
from kvatlas.node.chunk_digest import tokens_digest
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import FsL2
from kvatlas.node.peer import PEER_KV_PATH, PeerClient, PeerServer, create_peer_app
from kvatlas.node.stored_chunk import StoredChunk, decode_chunk
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service, spawn_services, stop
from tests.conftest import wait_for
from tests.helpers import TOY_LAYOUT


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "org/model", 1 << 24 | 1 << 8)


def chunk(i: int) -> StoredChunk:
    kv = np.arange(64, dtype=np.float16).reshape(2, 2, 16) + np.float16(i)
    return StoredChunk(key(i), kv, np.arange(i, i + 4, dtype=np.uint32), 256 * i)


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[str]:
    """A peer with key 0 in L1 and L2, key 1 in its private L2 only, key 2 in L1 only."""
    l1, l2 = L1Cache(1 << 20), FsL2(tmp_path / "private")
    l1.put(chunk(0))
    l1.put(chunk(2))
    l2.put(chunk(0))
    l2.put(chunk(1))
    with PeerServer(create_peer_app(l1, l2=l2), port=free_port()) as server:
        yield server.url


def fetched(url: str, tiers: tuple[str, ...] | None) -> set[ObjectKey]:
    with PeerClient(url, max_chunk_bytes=256) as client:
        keys = [key(i) for i in range(4)]
        reply = client.fetch(keys) if tiers is None else client.fetch(keys, tiers)
    assert reply.failure == "" and reply.dropped == 0
    for k, (c, digest) in reply.chunks.items():
        original = chunk(int.from_bytes(k.chunk_hash, "big"))
        assert c.tokens is None and original.tokens is not None
        assert digest == tokens_digest(original.tokens)
        np.testing.assert_array_equal(c.kv, original.kv)
    return set(reply.chunks)


def test_tiers_default_to_l1_and_l2_is_served_only_when_asked(peer: str) -> None:
    assert fetched(peer, None) == {key(0), key(2)}
    assert fetched(peer, ("l1",)) == {key(0), key(2)}
    assert fetched(peer, ("l1", "l2")) == {key(0), key(1), key(2)}
    assert fetched(peer, ("l2",)) == {key(0), key(1)}


def test_reply_format_is_unchanged_records_of_chunk_and_digest(peer: str) -> None:
    body = {"keys": [key(1).to_wire()], "tiers": ["l1", "l2"]}
    reply = httpx.post(peer + PEER_KV_PATH, json=body)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/octet-stream"
    records = msgspec.msgpack.decode(reply.content)
    assert [set(r) for r in records] == [{"chunk", "tokens_digest"}]
    sent = decode_chunk(records[0]["chunk"])
    assert sent.key == key(1) and sent.tokens is None  # token ids never leave the node
    assert chunk(1).tokens is not None
    assert records[0]["tokens_digest"] == tokens_digest(chunk(1).tokens)


@pytest.mark.parametrize("tiers", [[], ["l3"], ["l1", "dram"], "l1"])
def test_bad_tiers_are_a_4xx_with_a_detail(peer: str, tiers: object) -> None:
    reply = httpx.post(peer + PEER_KV_PATH, json={"keys": [key(0).to_wire()], "tiers": tiers})
    assert 400 <= reply.status_code < 500 and "detail" in reply.json()


def test_a_shared_pool_is_never_served(tmp_path: Path) -> None:
    pool = FsL2(tmp_path / "pool", "fs-shared", shared=True)
    pool.put(chunk(1))
    with PeerServer(create_peer_app(L1Cache(1 << 20), l2=pool), port=free_port()) as server:
        assert fetched(server.url, ("l1", "l2")) == set()


# -- end to end: real processes -------------------------------------------------------------

C = 16
MODEL_FLAGS = [
    "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
    "--chunk-size", str(C), "--dtype", "float32", "--log-level", "warning",
]  # fmt: skip
LAYOUT = TOY_LAYOUT


def test_a_chunk_only_in_a_peers_private_l2_is_counted_and_retrieved(tmp_path: Path) -> None:
    coord_port, a_port, b_port = free_port(), free_port(), free_port()
    coord = f"http://127.0.0.1:{coord_port}"
    coord_args = ["coordinator", "--port", str(coord_port), "--chunk-size", str(C)]
    procs = [spawn_service(["-m", "kvatlas.cli", *coord_args, "--log-level", "warning"], coord)]
    a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
    a = b = None
    try:
        procs += spawn_services([
            (["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", name,
              "--coordinator-url", coord, "--coordinator-event-reporting", "--l2", l2,
              "--l2-path", str(tmp_path / "l2"),
              # L1 holds two chunks: the first two of four live in A's private L2 only
              "--l1-bytes", str(2 * LAYOUT.chunk_bytes), *MODEL_FLAGS], f"http://127.0.0.1:{port}")
            for name, port, l2 in (("a", a_port, "fs"), ("b", b_port, "none"))
        ])  # fmt: skip
        a = NodeEngineClient(a_url, LAYOUT, timeout=60)
        b = NodeEngineClient(b_url, LAYOUT, timeout=60)
        model = ToyRopeModel(LAYOUT)
        tokens = np.random.default_rng(7).integers(0, 500, 4 * C).astype(np.uint32)
        assert a.store(tokens, model.kv_chunks(tokens)) == 4
        assert wait_for(lambda: b.lookup(tokens) == 4 * C, timeout=60)
        kv, sources = b.retrieve(tokens)
        assert sources == {"peer_l2": 2, "peer_l1": 2}  # every counted chunk is served
        for i, got in enumerate(kv):
            np.testing.assert_allclose(got, model.kv_chunk(tokens[i * C : (i + 1) * C], i * C))
    finally:
        for client in (a, b):
            if client is not None:
                client.close()
        stop(procs)
