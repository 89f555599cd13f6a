"""A real LMCache 0.5.6 ``lmcache server`` (``make test`` installs it into ``.venv-lmcache``) and
``kvatlas node`` answer the MP-server cache-control routes alike: the same requests, the same
status codes, the same reply fields and types. Where kvatlas answers differently on purpose, the
difference is listed here (:data:`DIFFERENCES`) and checked against both, so it stays a choice
(``docs/cache-control.md``). Under ``CI`` a missing LMCache fails these tests, never skips them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.api.cache_control import ClearedTier, ClearReply, DeleteObjectsReply, EncodedKey
from kvatlas.asgi_thread import free_port
from kvatlas.client import MPServerClient, MPServerError
from kvatlas.keys import ObjectKey, chunk_hashes, expand_prefix_keys
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import create_node_app
from kvatlas.node.l2 import FsL2
from kvatlas.node.peer import PeerServer
from tests.coordinator.lmcache_goldens import shape_problems
from tests.lmcache_mp.server import CHUNK_SIZE, LMCacheServer, lmcache_server
from tests.node.test_cache_control import BAD

SEQUENCES = (
    1,
    2,
    3,
    4,
)  # 3: test_one_client_drives_both_kinds_of_server's alone; 4: the coordinator's


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    with lmcache_server(tmp_path_factory.mktemp("lmcache"), SEQUENCES) as server:
        yield server


@pytest.fixture(scope="module")
def theirs(lmcache: LMCacheServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lmcache.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def ours(
    lmcache: LMCacheServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    """A kvatlas node serving the model LMCache's engine registered, holding the same
    sequences (stored through its own engine path)."""
    config = NodeConfig(
        model_name=lmcache.model_name, num_layers=1, num_kv_heads=1, head_dim=8,
        chunk_size=CHUNK_SIZE, dtype="float32", l1_bytes=1 << 20, l2="none",
    )  # fmt: skip
    node = CacheNode(config, instance_id="ours", l2=FsL2(tmp_path_factory.mktemp("ours-l2")))
    for stored in lmcache.stored:
        kv = np.zeros((3, *config.layout.shape), dtype=np.float32)
        assert node.store(node.tracker(token_ids=stored.token_ids), list(kv)) == 3
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield client
    node.close()


def keys_of(lmcache: LMCacheServer, sequence: int) -> list[dict[str, Any]]:
    """Sequence ``sequence``'s keys, by kvatlas's hashing (bit-compatible with LMCache's)."""
    tokens = next(s.token_ids for s in lmcache.stored if s.sequence == sequence)
    hashes = chunk_hashes(tokens, CHUNK_SIZE)
    return [k.to_wire() for k in expand_prefix_keys(hashes, lmcache.model_name)]


def until(check: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def l2_hashes(lmcache: LMCacheServer) -> set[str]:
    return {k["chunk_hash_hex"] for k in lmcache.l2_keys()}


def prefetch(client: httpx.Client, model: str, tokens: list[int]) -> httpx.Response:
    return client.post(
        "/cache/prefetches", json={"model_name": model, "world_size": 1, "token_ids": tokens}
    )


def completed(client: httpx.Client, request_id: str) -> dict[str, Any]:
    def poll() -> dict[str, Any] | None:
        r = client.get(f"/cache/prefetches/{request_id}")
        assert r.status_code == 200, r.text
        return dict(r.json()) if r.json()["status"] == "completed" else None

    result: dict[str, Any] = until(poll, f"prefetch {request_id}")
    return result


def test_lmcache_stores_under_the_keys_kvatlas_computes(lmcache: LMCacheServer) -> None:
    want = [ObjectKey.from_wire(k) for s in SEQUENCES for k in keys_of(lmcache, s)]
    until(lambda: len(lmcache.l2_keys()) == len(want), "LMCache's L2 writes")
    assert {ObjectKey.from_wire(k) for k in lmcache.l2_keys()} == set(want)


def test_lmcache_prefetch_then_delete(lmcache: LMCacheServer, theirs: httpx.Client) -> None:
    """What a real LMCache 0.5.6 server answers along a prefetch and a delete (recorded in
    docs/cache-control.md)."""
    model, one, two = lmcache.model_name, keys_of(lmcache, 1), keys_of(lmcache, 2)
    tokens = {s.sequence: s.token_ids for s in lmcache.stored}
    until(lambda: len(lmcache.l2_keys()) == 3 * len(SEQUENCES), "LMCache's L2 writes")
    r = theirs.post("/cache/clear")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "cleared": {"tier": "l1"}})

    r = prefetch(theirs, model, tokens[1])
    assert r.status_code == 202 and r.json()["status"] == "submitted" and r.json()["chunks"] == 3
    request_id = r.json()["request_id"]
    assert isinstance(request_id, str) and request_id
    done = completed(theirs, request_id)
    assert done == {
        "request_id": request_id,
        "status": "completed",
        "found_keys": 3,
        "total_keys": 3,
    }
    gone = theirs.get(f"/cache/prefetches/{request_id}")  # LMCache forgets it at the first poll
    assert gone.status_code == 404 and "unknown prefetch request_id" in gone.json()["detail"]

    r = theirs.request("DELETE", "/cache/objects", json={"keys": one, "tier": "all"})
    assert (r.status_code, r.json()) == (
        200,
        {"deleted": 6, "skipped": 0, "ok": True},
    )  # 3 L1 + 3 L2
    assert not l2_hashes(lmcache) & {k["chunk_hash_hex"] for k in one}
    assert {k["chunk_hash_hex"] for k in two} <= l2_hashes(lmcache)  # the other sequence stays
    r = theirs.request("DELETE", "/cache/objects", json={"keys": one, "tier": "l1"})
    assert r.json() == {"deleted": 0, "skipped": 0, "ok": True}  # L1 counts what it removed

    assert (
        completed(theirs, prefetch(theirs, model, tokens[1]).json()["request_id"])["found_keys"]
        == 0
    )
    assert (
        completed(theirs, prefetch(theirs, model, tokens[2]).json()["request_id"])["found_keys"]
        == 3
    )


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    BAD,
    ids=[f"{m} {p} {i}" for i, (m, p, _b, _s) in enumerate(BAD)],
)
def test_bad_input_same_status_as_lmcache(
    theirs: httpx.Client, ours: httpx.Client, method: str, path: str, body: Any, status: int
) -> None:
    kwargs = {"json": body} if body is not None else {}
    lmc, kva = theirs.request(method, path, **kwargs), ours.request(method, path, **kwargs)
    assert (lmc.status_code, kva.status_code) == (status, status), (lmc.text, kva.text)
    assert "detail" in lmc.json() and "detail" in kva.json()


def test_good_requests_same_status_and_fields_as_lmcache(
    lmcache: LMCacheServer, theirs: httpx.Client, ours: httpx.Client
) -> None:
    model = lmcache.model_name
    tokens = {s.sequence: s.token_ids for s in lmcache.stored}
    two = keys_of(lmcache, 2)
    requests: list[tuple[str, str, Any]] = [
        ("POST", "/cache/clear", None),
        ("POST", "/cache/clear", {"tier": "l1", "force": True}),
        (
            "POST",
            "/cache/prefetches",
            {"model_name": model, "world_size": 1, "token_ids": [1, 2, 3]},
        ),
        (
            "POST",
            "/cache/prefetches",
            {"model_name": model, "world_size": 1, "token_ids": tokens[2]},
        ),
        ("DELETE", "/cache/objects", {"keys": two[:1], "tier": "l1"}),
        ("DELETE", "/cache/objects", {"keys": two[:1], "tier": "l2", "force": False}),
        ("DELETE", "/cache/objects", {"keys": [], "adapter": "fs"}),
    ]
    for method, path, body in requests:
        kwargs = {"json": body} if body is not None else {}
        lmc, kva = theirs.request(method, path, **kwargs), ours.request(method, path, **kwargs)
        assert lmc.status_code == kva.status_code, (method, path, lmc.text, kva.text)
        assert shape_problems(lmc.json(), kva.json()) == [], (method, path)
        assert shape_problems(kva.json(), lmc.json(), names=("kvatlas", "LMCache")) == []
        if path == "/cache/prefetches" and lmc.json()["status"] == "submitted":
            pair = (
                completed(theirs, lmc.json()["request_id"]),
                completed(ours, kva.json()["request_id"]),
            )
            assert shape_problems(pair[0], pair[1]) == [] and pair[0].keys() == pair[1].keys()


DIFFERENCES: list[tuple[str, str, str, Any, int, int]] = [
    # (why, method, path, body, LMCache 0.5.6's status, kvatlas's status)
    ("an unknown field is refused, not ignored (a misspelt tier would delete elsewhere)",
     "DELETE", "/cache/objects", {"keys": [], "teir": "l1"}, 200, 422),
    ("a negative token id is bad input, not a server error",
     "POST", "/cache/prefetches", {"model_name": "{model}", "world_size": 1, "token_ids": [-5] + [1] * 16}, 500, 400),
    ("a chunk hash is 32 bytes: a shorter one names no key",
     "DELETE", "/cache/objects", {"keys": [{"chunk_hash_hex": "00ff", "model_name": "{model}", "kv_rank": 16777472}]}, 200, 400),
    ("a kv_rank packs world_size >= 1 and a rank inside it",
     "DELETE", "/cache/objects", {"keys": [{"chunk_hash_hex": "00" * 32, "model_name": "{model}", "kv_rank": 0}]}, 200, 400),
    ("a private fs L2 lists its keys (LMCache's fs adapter cannot: only S3 lists)",
     "GET", "/cache/objects", None, 503, 200),
    ("a key given twice is refused, not read as its last value (which tier was meant?)",
     "DELETE", "/cache/objects", b'{"keys": [], "tier": "l2", "tier": "l1"}', 200, 422),
]  # fmt: skip


@pytest.mark.parametrize(
    ("why", "method", "path", "body", "lmcache_status", "our_status"),
    DIFFERENCES,
    ids=[d[0][:40] for d in DIFFERENCES],
)
def test_deliberate_differences_from_lmcache(
    lmcache: LMCacheServer, theirs: httpx.Client, ours: httpx.Client,
    why: str, method: str, path: str, body: Any, lmcache_status: int, our_status: int,
) -> None:  # fmt: skip
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):  # a body json= cannot write (a key twice)
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": eval_model(body, lmcache.model_name)}
    # one connection per request: LMCache's 500 closes its connection under the next request
    lmc = httpx.request(method, f"{theirs.base_url}{path}", timeout=60, **kwargs)
    kva = httpx.request(method, f"{ours.base_url}{path}", timeout=60, **kwargs)
    assert (lmc.status_code, kva.status_code) == (lmcache_status, our_status), (
        why,
        lmc.text,
        kva.text,
    )


def eval_model(body: Any, model: str) -> Any:
    if isinstance(body, dict):
        return {k: eval_model(v, model) for k, v in body.items()}
    if isinstance(body, list):
        return [eval_model(v, model) for v in body]
    return model if body == "{model}" else body


def test_our_prefetch_status_outlives_its_first_poll(
    lmcache: LMCacheServer, ours: httpx.Client
) -> None:
    """LMCache forgets a completed prefetch at its first poll (test_lmcache_prefetch_then_delete);
    a kvatlas node keeps it for a bounded time, so a poll whose reply was lost can ask again."""
    tokens = lmcache.stored[0].token_ids
    request_id = prefetch(ours, lmcache.model_name, tokens).json()["request_id"]
    first = completed(ours, request_id)
    assert ours.get(f"/cache/prefetches/{request_id}").json() == first


def test_one_client_drives_both_kinds_of_server(
    lmcache: LMCacheServer, theirs: httpx.Client, ours: httpx.Client
) -> None:
    """The coordinator's client (``MPServerClient``) decodes LMCache's replies and a kvatlas
    node's with the same types: prefetch, status, delete, clear, a refusal's status."""
    tokens = next(s.token_ids for s in lmcache.stored if s.sequence == 3)
    keys = [EncodedKey(**k) for k in keys_of(lmcache, 3)]
    for url in (str(theirs.base_url), str(ours.base_url)):
        with MPServerClient(url) as client:
            assert client.clear() == ClearReply("ok", ClearedTier("l1"))
            submitted = client.submit_prefetch(lmcache.model_name, 1, tokens)
            assert (submitted.chunks, submitted.status) == (3, "submitted"), url
            assert isinstance(submitted.request_id, str)
            rid = submitted.request_id

            def finished(client: MPServerClient = client, rid: str = rid) -> Any:
                status = client.prefetch_status(rid)
                return status if status is not None and status.status == "completed" else None

            done = until(finished, rid)
            assert (done.found_keys, done.total_keys) == (3, 3), url
            assert client.delete_objects(keys, "all") == DeleteObjectsReply(6, 0, True), url
            assert client.prefetch_status("never-submitted") is None
            with pytest.raises(MPServerError) as refused:
                client.submit_prefetch("not-this-model", 1, tokens)
            assert refused.value.reply_status == 503, url
    with (
        pytest.raises(MPServerError) as unreachable,
        MPServerClient(f"http://127.0.0.1:{free_port()}") as c,
    ):
        c.clear()
    assert unreachable.value.reply_status is None  # retry later, not a refusal


def test_our_coordinator_drives_a_real_lmcache_server(lmcache: LMCacheServer) -> None:
    """kvatlas's coordinator (its routes, its delivery loop, ``MPServerClient``) drives
    LMCache 0.5.6's server as it drives a node: a prefetch submitted to it and its status read
    from it, then a delete of every tier that removes the keys from LMCache's L2."""
    from urllib.parse import urlsplit

    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.server import BackgroundServer

    tokens = next(s.token_ids for s in lmcache.stored if s.sequence == 4)
    hashes = {k["chunk_hash_hex"] for k in keys_of(lmcache, 4)}
    assert hashes <= l2_hashes(lmcache)
    config = CoordinatorConfig(port=free_port(), chunk_size=CHUNK_SIZE)
    with (
        BackgroundServer(config, mp_servers=MPServerClient) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        lm = {"instance_id": "lm", "ip": "127.0.0.1", "http_port": urlsplit(lmcache.url).port}
        assert c.post("/instances", json=lm).status_code == 200
        body = {"instance_id": "lm", "model_name": lmcache.model_name, "world_size": 1,
                "token_ids": tokens}  # fmt: skip
        r = c.post("/cache/prefetches", json=body)
        assert r.status_code == 202, r.text
        assert (r.json()["chunks"], r.json()["status"]) == (3, "submitted")
        rid, commands = r.json()["request_id"], server.service.cache_control.commands

        def found() -> int | None:
            command = commands.get(rid)
            return None if command is None else command.found_keys

        assert until(found, "LMCache's prefetch status, read by the loop") == 3
        r = c.post("/cache/delete", json={**body, "tier": "all"})
        assert r.status_code == 200, r.text
        assert r.json() == {"instance_id": "lm", "requested": 3, "affected": 3, "skipped": 0,
                            "status": "deleted"}  # fmt: skip
        assert until(lambda: not hashes & l2_hashes(lmcache), "the keys gone from LMCache's L2")
