"""``engine_id`` in a node's registration (the engine whose KV connector the node is), over
real HTTP with auth on: validated as an instance id, never the node's own id nor another
node's, no node registers under an engine a node serves, only the node's own token declares
it, listed by ``GET /instances``, kept in the snapshot, dropped with the node (deregistered or
fenced) — and ``POST /route/score`` counts the node's copies as the engine's while it lasts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.conftest import HTTP, wait_for
from tests.coordinator.security_support import ADMIN, bearer, token, write_tokens

C = 16
NODES = ("node-a", "node-b", "node-c")
TOKENS = {name: token(name) for name in NODES}
DOC = np.arange(100, 100 + 2 * C, dtype=np.uint32)


@pytest.fixture
def config(tmp_path: Path) -> CoordinatorConfig:
    path = write_tokens(
        tmp_path / "tokens.json",
        {"token": ADMIN, "roles": ["admin"]},
        *({"token": TOKENS[n], "roles": ["emit", "lookup"], "instance_ids": [n]} for n in NODES),
    )
    return CoordinatorConfig(
        port=free_port(),
        chunk_size=C,
        auth_token_file=path,
        snapshot_path=tmp_path / "d.snap",
        instance_timeout=600,
    )


@pytest.fixture
def server(config: CoordinatorConfig) -> Iterator[BackgroundServer]:
    with BackgroundServer(config) as server:
        yield server


def register(url: str, node: str, engine: str | None, as_: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"instance_id": node}
    if engine is not None:
        body["engine_id"] = engine
    return httpx.post(f"{url}/instances", json=body, headers=bearer(TOKENS[as_ or node]))


def listed(url: str) -> dict[str, Any]:
    rows = HTTP.get(f"{url}/instances", headers=bearer(ADMIN)).json()["instances"]
    return {r["instance_id"]: r.get("engine_id") for r in rows}


def store_doc(url: str, node: str) -> None:
    sink = EventSink(node, HttpTransport(url, token=TOKENS[node]), incarnation=1)
    rank = pack_kv_rank(1, 0, 1, 0)
    hashes = chunk_hashes(DOC, C)
    sink.emit("store", "l1", "dram", [
        CacheEntry(ObjectKey(h, "m", rank), 64, DOC[i * C : (i + 1) * C], i * C)
        for i, h in enumerate(hashes)
    ])  # fmt: skip
    assert sink.flush(20)
    sink.close(timeout=1)


def scores(url: str, instances: list[str] | None = None) -> dict[str, float]:
    body: dict[str, Any] = {"token_ids": DOC.tolist(), "model_name": "m"}
    if instances is not None:
        body["instances"] = instances
    reply = httpx.post(f"{url}/route/score", json=body, headers=bearer(ADMIN))
    assert reply.status_code == 200, reply.text
    return {r["instance_id"]: r["score"] for r in reply.json()["instances"]}


@pytest.mark.parametrize(
    ("engine", "status", "says"),
    [
        ("../x", 422, "engine_id"),
        ("a@b", 422, "engine_id"),
        ("x" * 300, 422, "engine_id"),
        ("node-a", 422, "not the node itself"),
    ],
)
def test_a_bad_engine_id_is_refused(
    server: BackgroundServer, engine: str, status: int, says: str
) -> None:
    reply = register(server.url, "node-a", engine)
    assert reply.status_code == status, reply.text
    assert says in reply.text
    assert "node-a" not in listed(server.url)


def test_engine_and_node_ids_stay_apart(server: BackgroundServer) -> None:
    url = server.url
    # an engine no KV events named yet is fine (any start order)
    assert register(url, "node-a", "pod-a").status_code == 200
    assert register(url, "node-a", "pod-a").json()["re_registered"] is True
    # a node is no engine, and no node takes the id of an engine a node serves
    refused = register(url, "node-b", "node-a")
    assert refused.status_code == 409 and "registered node" in refused.text
    assert register(url, "node-b", None).status_code == 200
    refused = register(url, "node-c", "node-b")
    assert refused.status_code == 409
    # several nodes may serve one engine (one per tensor-parallel rank)
    assert register(url, "node-c", "pod-a").status_code == 200
    assert listed(url) == {"node-a": "pod-a", "node-b": None, "node-c": "pod-a"}
    # a token declares only its own registration, as for every field
    assert register(url, "node-a", "pod-z", as_="node-b").status_code == 403
    assert listed(url)["node-a"] == "pod-a"


def test_a_node_registering_under_a_served_engines_id_is_refused(tmp_path: Path) -> None:
    tokens = write_tokens(
        tmp_path / "t2.json",
        {"token": ADMIN, "roles": ["admin"]},
        {"token": TOKENS["node-a"], "roles": ["emit", "lookup"], "instance_ids": ["node-a"]},
        {"token": TOKENS["node-b"], "roles": ["emit", "lookup"], "instance_ids": ["pod-a"]},
    )
    cfg = CoordinatorConfig(port=free_port(), chunk_size=C, auth_token_file=tokens)
    with BackgroundServer(cfg) as server:
        assert register(server.url, "node-a", "pod-a").status_code == 200
        refused = register(server.url, "pod-a", None, as_="node-b")
        assert refused.status_code == 409 and "node-a" in refused.text


def test_route_score_counts_the_nodes_copies_as_its_engines_while_it_is_registered(
    server: BackgroundServer, config: CoordinatorConfig
) -> None:
    url = server.url
    assert register(url, "node-a", "pod-a").status_code == 200
    assert register(url, "node-b", None).status_code == 200
    store_doc(url, "node-a")
    # default candidates: node-a is scored as pod-a (what a router can send requests to)
    assert scores(url) == {"pod-a": 0.8 * 2 * C, "node-b": round(0.85 * 0.6 * 2 * C, 6)}  # peer
    assert scores(url, ["pod-a", "node-a"]) == {"pod-a": 0.8 * 2 * C, "node-a": 0.8 * 2 * C}
    # the snapshot carries it: a restarted coordinator still scores pod-a
    server.stop()
    with BackgroundServer(config) as again:
        assert listed(again.url) == {"node-a": "pod-a", "node-b": None}
        assert scores(again.url, ["pod-a"]) == {"pod-a": 0.8 * 2 * C}
        # the node leaves: its L1 is fenced and the attachment gone with it
        gone = httpx.delete(f"{again.url}/instances/node-a", headers=bearer(TOKENS["node-a"]))
        assert gone.status_code == 204
        assert scores(again.url) == {"node-b": 0.0}  # node-a's L1 fenced: nothing to fetch
        assert "node-a" not in listed(again.url)


def test_a_fenced_node_no_longer_speaks_for_its_engine(tmp_path: Path) -> None:
    """The instance timeout fences a silent node: its L2 stays in the directory (bytes
    outlive the process) but no longer counts as the engine's."""
    config = CoordinatorConfig(port=free_port(), chunk_size=C, instance_timeout=0.5)
    with BackgroundServer(config) as server:
        url = server.url
        body = {"instance_id": "node-a", "engine_id": "pod-a"}
        assert httpx.post(f"{url}/instances", json=body).status_code == 200
        sink = EventSink("node-a", HttpTransport(url), incarnation=1)
        rank = pack_kv_rank(1, 0, 1, 0)
        (h, *_) = chunk_hashes(DOC, C)
        sink.emit("store", "l2", "fs", [CacheEntry(ObjectKey(h, "m", rank), 64, DOC[:C], 0)])
        assert sink.flush(20)
        sink.close(timeout=1)
        assert scores(url, ["pod-a"]) == {"pod-a": 0.5 * C}
        assert wait_for(lambda: "node-a" not in listed_open(url), timeout=30)
        assert scores(url, ["pod-a"]) == {"pod-a": 0.0}


def listed_open(url: str) -> set[str]:
    rows = HTTP.get(f"{url}/instances").json()["instances"]
    return {r["instance_id"] for r in rows if r.get("alive")}
