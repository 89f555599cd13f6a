"""The node's MP-server cache-control routes over loopback (``docs/cache-control.md``): delete
by keys and tier (held keys skipped unless ``force``), prefetch L2 -> L1 with a status kept for a
bounded time, object listing, clear; bad input changes nothing; only ``admin`` may call them.
The same requests against a real ``lmcache server``: tests/lmcache_mp/."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.api.cache_control import MAX_DELETE_KEYS, DeleteObjectsReply, EncodedKey
from kvatlas.asgi_thread import free_port
from kvatlas.auth import Principal, TokenAuth
from kvatlas.client import MPServerClient
from kvatlas.keys import ObjectKey, chunk_hashes, expand_prefix_keys
from kvatlas.node.cache_control import PrefetchJobs
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.http_api import create_node_app
from kvatlas.node.l2 import FsL2
from kvatlas.node.peer import PeerServer
from kvatlas.node.presence import L1, L2

C = 16
MODEL = "test-model"
CONFIG = NodeConfig(
    model_name=MODEL, num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32",
    l1_bytes=1 << 20, l2="none",
)  # fmt: skip


def sequence(n: int) -> list[int]:
    """Three complete chunks, distinct per ``n`` (LMCache's benchmark engine's shape)."""
    return [n] + [9906] * (3 * C - 1)


def keys_of(tokens: list[int], salt: str = "") -> list[ObjectKey]:
    return expand_prefix_keys(chunk_hashes(tokens, C), MODEL, cache_salt=salt)


def wire(keys: list[ObjectKey]) -> list[dict[str, Any]]:
    return [k.to_wire() for k in keys]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[CacheNode]:
    node = CacheNode(CONFIG, instance_id="n1", l2=FsL2(tmp_path / "l2"))
    for n in (1, 2):
        kv = np.full((3, *CONFIG.layout.shape), n, dtype=np.float32)
        assert node.store(node.tracker(token_ids=sequence(n)), list(kv)) == 3
    yield node
    node.close()


@pytest.fixture
def client(node: CacheNode) -> Iterator[httpx.Client]:
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        yield c


def held(node: CacheNode, keys: list[ObjectKey]) -> dict[str, int]:
    return {
        "l1": sum(node.l1.contains(k) for k in keys),
        "l2": sum(node.l2.contains(k) for k in keys),  # type: ignore[union-attr]
        "presence": sum(bool(node.presence.tiers_of_key(k)) for k in keys),
    }


def delete(client: httpx.Client, body: Any) -> httpx.Response:
    return client.request("DELETE", "/cache/objects", json=body)


def prefetched(client: httpx.Client, tokens: list[int]) -> dict[str, Any]:
    r = client.post(
        "/cache/prefetches", json={"model_name": MODEL, "world_size": 1, "token_ids": tokens}
    )
    assert r.status_code == 202, r.text
    submitted = r.json()
    assert (
        set(submitted) == {"request_id", "chunks", "status"} and submitted["status"] == "submitted"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = client.get(f"/cache/prefetches/{submitted['request_id']}")
        assert status.status_code == 200, status.text
        if status.json()["status"] == "completed":
            return dict(status.json())
        assert status.json() == {"request_id": submitted["request_id"], "status": "pending"}
        time.sleep(0.02)
    raise AssertionError("prefetch did not complete")


def test_delete_all_tiers_removes_every_copy_and_only_those(
    client: httpx.Client, node: CacheNode
) -> None:
    one, two = keys_of(sequence(1)), keys_of(sequence(2))
    assert held(node, one) == {"l1": 3, "l2": 3, "presence": 3}
    r = delete(client, {"keys": wire(one), "tier": "all"})
    assert (r.status_code, r.json()) == (200, {"deleted": 6, "skipped": 0, "ok": True})
    assert held(node, one) == {"l1": 0, "l2": 0, "presence": 0}
    assert held(node, two) == {"l1": 3, "l2": 3, "presence": 3}  # the other sequence stays
    assert not {p.key for p in node.inventory()} & set(one)
    # deleting what is gone deletes nothing (LMCache's L2 counts the batch; kvatlas counts copies)
    assert delete(client, {"keys": wire(one), "tier": "all"}).json() == {
        "deleted": 0,
        "skipped": 0,
        "ok": True,
    }


def test_the_coordinators_client_splits_a_delete_over_the_servers_key_limit(
    client: httpx.Client, node: CacheNode
) -> None:
    """A delete of more keys than one ``DELETE /cache/objects`` may carry (10,000: 1M tokens at
    16 per chunk are 62,500) is sent in parts and its counts summed, not refused with a 400."""
    one = keys_of(sequence(1))
    absent = keys_of(list(range(1, MAX_DELETE_KEYS * C + 1)), salt="absent")
    keys = [EncodedKey(**k) for k in wire(absent[:5_000] + one + absent[5_000:])]
    assert len(keys) > MAX_DELETE_KEYS
    with MPServerClient(str(client.base_url)) as mp:
        assert mp.delete_objects(keys, "all") == DeleteObjectsReply(6, 0, True)
    assert held(node, one) == {"l1": 0, "l2": 0, "presence": 0}


def test_delete_defaults_to_l2_like_lmcache(client: httpx.Client, node: CacheNode) -> None:
    one = keys_of(sequence(1))
    assert delete(client, {"keys": wire(one)}).json() == {"deleted": 3, "skipped": 0, "ok": True}
    assert held(node, one) == {"l1": 3, "l2": 0, "presence": 3}


def test_delete_skips_a_key_held_for_a_transfer_unless_forced(
    client: httpx.Client, node: CacheNode
) -> None:
    one = keys_of(sequence(1))
    with node.l1.pinned(one[:1]):
        r = delete(client, {"keys": wire(one), "tier": "l1"})
        assert r.json() == {"deleted": 2, "skipped": 1, "ok": True}
        assert node.l1.contains(one[0]) and not node.l1.contains(one[1])
        r = delete(client, {"keys": wire(one), "tier": "l1", "force": True})
        assert r.json() == {"deleted": 1, "skipped": 0, "ok": True}
    assert held(node, one) == {"l1": 0, "l2": 3, "presence": 3}


def test_prefetch_warms_l1_from_l2_and_keeps_its_status(
    client: httpx.Client, node: CacheNode
) -> None:
    one = keys_of(sequence(1))
    assert client.post("/cache/clear").json() == {"status": "ok", "cleared": {"tier": "l1"}}
    assert len(node.l1) == 0 and held(node, one)["l2"] == 3
    done = prefetched(client, sequence(1))
    assert (done["status"], done["found_keys"], done["total_keys"]) == ("completed", 3, 3)
    assert held(node, one)["l1"] == 3 and {L1, L2} == set(node.presence.tiers_of_key(one[0]))
    again = client.get(f"/cache/prefetches/{done['request_id']}")
    assert again.json() == done  # kept for a while, not consumed by the first poll (LMCache's)
    delete(client, {"keys": wire(one), "tier": "all"})
    assert prefetched(client, sequence(1))["found_keys"] == 0
    assert prefetched(client, sequence(2))["found_keys"] == 3  # already in L1: found


def test_prefetch_of_less_than_a_chunk_is_a_noop(client: httpx.Client) -> None:
    r = client.post(
        "/cache/prefetches", json={"model_name": MODEL, "world_size": 1, "token_ids": [1, 2]}
    )
    assert (r.status_code, r.json()) == (202, {"chunks": 0, "status": "noop"})


def test_object_listing_pages_through_every_l2_key(client: httpx.Client, node: CacheNode) -> None:
    seen: list[dict[str, Any]] = []
    token = None
    for _ in range(4):
        params: dict[str, Any] = {"page_size": 4}
        if token is not None:
            params["page_token"] = token
        page = client.get("/cache/objects", params=params).json()
        assert set(page) == {"adapter", "shared", "entries", "next_page_token"}
        assert (page["adapter"], page["shared"]) == ("fs", False)
        seen += page["entries"]
        token = page["next_page_token"]
        if token is None:
            break
    want = {ObjectKey.from_wire(k.to_wire()) for k in keys_of(sequence(1)) + keys_of(sequence(2))}
    assert {ObjectKey.from_wire(e["key"]) for e in seen} == want and len(seen) == 6
    assert {e["size_bytes"] for e in seen} == {CONFIG.layout.chunk_bytes}
    other = client.get("/cache/objects", params={"model_name": "other"}).json()
    assert other["entries"] == [] and other["next_page_token"] is None


BAD: list[tuple[str, str, Any, int]] = [
    # (method, path, JSON body or query, LMCache 0.5.6's status for it)
    ("DELETE", "/cache/objects", {}, 422),
    ("DELETE", "/cache/objects", {"keys": [], "tier": "l3"}, 422),
    (
        "DELETE",
        "/cache/objects",
        {"keys": [{"chunk_hash_hex": "00" * 32, "model_name": MODEL}]},
        422,
    ),
    (
        "DELETE",
        "/cache/objects",
        {"keys": [{"chunk_hash_hex": "zz" * 32, "model_name": MODEL, "kv_rank": 16777472}]},
        400,
    ),
    (
        "DELETE",
        "/cache/objects",
        {"keys": [{"chunk_hash_hex": "00" * 32, "model_name": "m@x", "kv_rank": 16777472}]},
        400,
    ),
    (
        "DELETE",
        "/cache/objects",
        {
            "keys": [
                {
                    "chunk_hash_hex": "00" * 32,
                    "model_name": MODEL,
                    "kv_rank": 16777472,
                    "cache_salt": "a@b",
                }
            ]
        },
        400,
    ),
    (
        "DELETE",
        "/cache/objects",
        {
            "keys": [
                {
                    "chunk_hash_hex": "00" * 32,
                    "model_name": MODEL,
                    "kv_rank": 16777472,
                    "object_group_id": -1,
                }
            ]
        },
        400,
    ),
    (
        "DELETE",
        "/cache/objects",
        {
            "keys": [{"chunk_hash_hex": "00" * 32, "model_name": MODEL, "kv_rank": 16777472}]
            * 10_001
        },
        400,
    ),
    ("DELETE", "/cache/objects", {"keys": [], "adapter": "s3"}, 404),
    ("POST", "/cache/prefetches", {"world_size": 1, "token_ids": [1]}, 422),
    ("POST", "/cache/prefetches", {"model_name": MODEL, "world_size": 1, "token_ids": ["a"]}, 422),
    (
        "POST",
        "/cache/prefetches",
        {
            "model_name": MODEL,
            "world_size": 1,
            "token_ids": [1],
            "source_tier": "l1",
            "target_tier": "l2",
        },
        400,
    ),
    (
        "POST",
        "/cache/prefetches",
        {"model_name": MODEL, "world_size": 1, "token_ids": [1], "cache_salt": "a@b"},
        400,
    ),
    ("POST", "/cache/prefetches", {"model_name": MODEL, "world_size": 2, "token_ids": [1]}, 503),
    ("POST", "/cache/prefetches", {"model_name": "other", "world_size": 1, "token_ids": [1]}, 503),
    ("GET", "/cache/prefetches/never-submitted", None, 404),
    ("GET", "/cache/objects?tier=l1", None, 400),
    ("GET", "/cache/objects?tier=l3", None, 422),
    ("GET", "/cache/objects?page_size=0", None, 422),
    ("POST", "/cache/clear", {"tier": "l2"}, 400),
    ("POST", "/cache/clear", {"tier": "l9"}, 422),
]
"""Bad input the real ``lmcache server`` was asked too (tests/lmcache_mp/), with its status."""


def send(client: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    return (
        client.request(method, path, json=body)
        if body is not None
        else client.request(method, path)
    )


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    BAD,
    ids=[f"{m} {p} {i}" for i, (m, p, _b, _s) in enumerate(BAD)],
)
def test_bad_input_gets_lmcaches_status_and_changes_nothing(
    client: httpx.Client, node: CacheNode, method: str, path: str, body: Any, status: int
) -> None:
    before = sorted((p.key.chunk_hash, p.tier) for p in node.held())
    r = send(client, method, path, body)
    assert r.status_code == status, r.text
    assert "detail" in r.json()
    assert sorted((p.key.chunk_hash, p.tier) for p in node.held()) == before


def test_negative_token_ids_are_a_400_not_lmcaches_500(client: httpx.Client) -> None:
    r = client.post(
        "/cache/prefetches",
        json={"model_name": MODEL, "world_size": 1, "token_ids": [-5] + [1] * 16},
    )
    assert r.status_code == 400 and "token" in r.json()["detail"]


def test_unknown_fields_are_refused_where_lmcache_ignores_them(
    client: httpx.Client, node: CacheNode
) -> None:
    """A misspelt ``tier`` would otherwise delete from the default tier: refused, nothing done."""
    one = keys_of(sequence(1))
    r = delete(client, {"keys": wire(one), "teir": "l1"})
    assert r.status_code == 422 and "teir" in r.json()["detail"]
    assert held(node, one) == {"l1": 3, "l2": 3, "presence": 3}


def test_a_key_given_twice_is_refused_and_named(client: httpx.Client, node: CacheNode) -> None:
    """Was a delete from the last ``tier`` given (here L1, the first said L2): a 422 naming the
    key, nothing deleted; the same body with the key once deletes."""
    one = keys_of(sequence(1))
    raw = json.dumps({"keys": wire(one), "tier": "l2"})[:-1] + ', "tier": "l1"}'
    r = client.request("DELETE", "/cache/objects", content=raw,
                       headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 422 and "Duplicate key 'tier'" in r.json()["detail"], r.text
    assert held(node, one) == {"l1": 3, "l2": 3, "presence": 3}
    raw = json.dumps({"model_name": MODEL, "world_size": 1, "token_ids": sequence(1)})
    r = client.post("/cache/prefetches", content=raw[:-1] + ', "world_size": 2}',
                    headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 422 and "world_size" in r.json()["detail"], r.text
    assert delete(client, {"keys": wire(one), "tier": "l1"}).status_code == 200
    assert held(node, one)["l1"] == 0


def test_a_node_without_l2_refuses_l2_deletes_but_deletes_l1(tmp_path: Path) -> None:
    node = CacheNode(CONFIG, instance_id="n2")
    node.store(
        node.tracker(token_ids=sequence(1)), list(np.zeros((3, *CONFIG.layout.shape), np.float32))
    )
    one = keys_of(sequence(1))
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        assert delete(c, {"keys": wire(one)}).status_code == 503  # tier l2 (the default)
        assert c.get("/cache/objects").status_code == 503
        assert len(node.l1) == 3
        assert delete(c, {"keys": wire(one), "tier": "l1"}).json() == {
            "deleted": 3,
            "skipped": 0,
            "ok": True,
        }
    node.close()


def test_cache_control_is_for_admin_only(node: CacheNode) -> None:
    auth = TokenAuth.from_tokens([
        ("admin-token", Principal("ops", frozenset({"admin"}))),
        ("engine-token", Principal("engine", frozenset({"engine"}))),
    ])  # fmt: skip
    one = keys_of(sequence(1))
    body = {"keys": wire(one), "tier": "all"}
    with (
        PeerServer(create_node_app(node, auth=auth), port=free_port()) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        for headers, status in (({}, 401), ({"authorization": "Bearer engine-token"}, 403)):
            assert (
                c.request("DELETE", "/cache/objects", json=body, headers=headers).status_code
                == status
            )
            assert c.post("/cache/clear", headers=headers).status_code == status
            assert held(node, one) == {"l1": 3, "l2": 3, "presence": 3}
        r = c.request(
            "DELETE", "/cache/objects", json=body, headers={"authorization": "Bearer admin-token"}
        )
        assert r.json() == {"deleted": 6, "skipped": 0, "ok": True}


def test_prefetch_status_is_kept_for_its_ttl_then_forgotten() -> None:
    now = [0.0]
    jobs = PrefetchJobs(ttl_s=10.0, max_jobs=2, clock=lambda: now[0])
    first = jobs.submit(lambda: 1, 1)
    wait_done(jobs, first)
    now[0] = 9.0
    assert jobs.status(first).found_keys == 1
    now[0] = 10.5
    with pytest.raises(Exception, match="unknown prefetch"):
        jobs.status(first)
    a, b = jobs.submit(lambda: 1, 1), jobs.submit(lambda: 2, 2)
    wait_done(jobs, a)
    wait_done(jobs, b)
    c = jobs.submit(lambda: 3, 3)  # the cap drops the oldest completed job
    wait_done(jobs, c)
    with pytest.raises(Exception, match="unknown prefetch"):
        jobs.status(a)
    assert jobs.status(b).found_keys == 2 and jobs.status(c).found_keys == 3
    jobs.close()


def wait_done(jobs: PrefetchJobs, request_id: str) -> None:
    deadline = time.monotonic() + 10
    while jobs.status(request_id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.01)


anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
wire_key = st.fixed_dictionaries(
    {},
    optional={
        "chunk_hash_hex": st.sampled_from(["00" * 32, "zz" * 32, "", "00ff"]) | anything,
        "model_name": st.sampled_from([MODEL, "m@x", ""]) | anything,
        "kv_rank": st.sampled_from([16777472, 0, -1, 1 << 40]) | anything,
        "object_group_id": st.integers(-2, 2) | anything,
        "cache_salt": st.sampled_from(["", "a@b", "x" * 300]) | anything,
    },
)
bodies = {
    ("DELETE", "/cache/objects"): st.fixed_dictionaries(
        {}, optional={"keys": st.lists(wire_key, max_size=3) | anything, "tier": st.sampled_from(["l1", "l2", "all", "l3"]) | anything,
                      "force": st.booleans() | anything, "adapter": st.sampled_from([None, "fs", "s3"]) | anything},
    ),
    ("POST", "/cache/prefetches"): st.fixed_dictionaries(
        {}, optional={"model_name": st.sampled_from([MODEL, "other"]) | anything, "world_size": st.integers(-1, 3) | anything,
                      "token_ids": st.lists(st.integers(-(2**33), 2**33), max_size=40) | anything,
                      "cache_salt": st.sampled_from(["", "a@b"]) | anything,
                      "source_tier": st.sampled_from(["l1", "l2", "x"]) | anything, "target_tier": st.sampled_from(["l1", "l2"]) | anything},
    ),
    ("POST", "/cache/clear"): st.fixed_dictionaries(
        {}, optional={"tier": st.sampled_from(["l1", "l2", "x"]) | anything, "force": st.booleans() | anything}
    ),
}  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    route=st.sampled_from(sorted(bodies)), data=st.data(), raw=st.none() | st.binary(max_size=40)
)
def test_cache_control_fuzz_no_server_errors(
    client: httpx.Client, route: tuple[str, str], data: st.DataObject, raw: bytes | None
) -> None:
    body = data.draw(bodies[route]) if raw is None else None
    content = msgspec.json.encode(body) if raw is None else raw
    r = client.request(*route, content=content, headers={"content-type": "application/json"})
    # the one 5xx by contract: a prefetch for a layout the node does not serve is LMCache's
    # 503 "no layout registered" (docs/cache-control.md, "What a real lmcache server answers")
    layout = (body.get("model_name"), body.get("world_size")) if isinstance(body, dict) else None
    unserved = route == ("POST", "/cache/prefetches") and layout not in (None, (MODEL, 1))
    refused = r.status_code == 503 and r.json()["detail"].startswith("no layout registered")
    assert r.status_code < 500 or (unserved and refused), (
        r.status_code, r.text[:300])  # fmt: skip
    if r.status_code >= 400:
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]


def test_deeply_nested_bodies_are_refused_not_a_server_error(client: httpx.Client) -> None:
    for route in bodies:
        r = client.request(
            *route, content=b"[" * 100_000, headers={"content-type": "application/json"}
        )
        assert 400 <= r.status_code < 500, (route, r.status_code)


def test_the_directory_follows_deletes_clears_and_prefetches(tmp_path: Path) -> None:
    """Every copy a cache-control call removes or loads is an event: the directory shows it."""
    from dataclasses import replace

    from kvatlas.api.cache_control import ClearBody, DeleteObjectsBody, EncodedKey, PrefetchBody
    from kvatlas.node.cache_control import NodeCacheControl
    from kvatlas.node.embedded import EmbeddedFleet

    with EmbeddedFleet([replace(CONFIG, l2="fs")], l2_root=tmp_path) as fleet:
        node = fleet.nodes["node-0"]
        control = NodeCacheControl(node)
        kv = list(np.zeros((3, *CONFIG.layout.shape), dtype=np.float32))
        node.store(node.tracker(token_ids=sequence(1)), kv)
        node.store(node.tracker(token_ids=sequence(2)), kv)
        one, two = keys_of(sequence(1)), keys_of(sequence(2))

        def tiers(keys: list[ObjectKey]) -> list[set[str]]:
            assert fleet.settle()
            return [{p.tier for p in kp.placements} for kp in fleet.directory.lookup(keys)]

        assert tiers(one) == [{"l1", "l2"}] * 3
        wire_keys = [EncodedKey(**k.to_wire()) for k in one]
        assert control.delete_objects(DeleteObjectsBody(keys=wire_keys, tier="all")).deleted == 6
        assert tiers(one) == [set()] * 3 and tiers(two) == [{"l1", "l2"}] * 3
        control.clear(ClearBody())
        assert tiers(two) == [{"l2"}] * 3
        submitted = control.submit_prefetch(
            PrefetchBody(model_name=MODEL, world_size=1, token_ids=sequence(2))
        )
        assert isinstance(submitted.request_id, str)
        deadline = time.monotonic() + 10
        while control.prefetch_status(submitted.request_id).status != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert tiers(two) == [{"l1", "l2"}] * 3
        control.close()


def test_a_delete_from_a_shared_pool_removes_the_pools_copy_another_node_wrote(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from kvatlas.api.cache_control import DeleteObjectsBody, EncodedKey
    from kvatlas.node.cache_control import NodeCacheControl
    from kvatlas.node.embedded import EmbeddedFleet

    shared = replace(CONFIG, l2="fs", l2_shared=True)
    with EmbeddedFleet([shared, shared], l2_root=tmp_path) as fleet:
        writer, other = fleet.nodes["node-0"], fleet.nodes["node-1"]
        writer.store(
            writer.tracker(token_ids=sequence(1)),
            list(np.zeros((3, *CONFIG.layout.shape), np.float32)),
        )
        one = keys_of(sequence(1))
        assert fleet.settle()
        assert [
            {(p.tier, p.shared) for p in kp.placements} for kp in fleet.directory.lookup(one)
        ] == [{("l1", False), ("l2", True)}] * 3
        body = DeleteObjectsBody(keys=[EncodedKey(**k.to_wire()) for k in one], tier="l2")
        assert NodeCacheControl(other).delete_objects(body).deleted == 3  # through any member
        assert fleet.settle()
        assert [{p.tier for p in kp.placements} for kp in fleet.directory.lookup(one)] == [
            {"l1"}
        ] * 3
        assert not any(writer.l2.contains(k) for k in one)  # type: ignore[union-attr]


def test_an_l2_failure_is_a_result_with_the_copies_removed_before_it(tmp_path: Path) -> None:
    """LMCache's shape: ``ok: false`` and the error, not a 5xx; what was removed is counted."""
    from kvatlas.node.l2 import L2Unavailable

    class FailingL2(FsL2):
        def delete(self, key: ObjectKey) -> bool:
            raise L2Unavailable("the L2 disk is gone")

    node = CacheNode(CONFIG, instance_id="n3", l2=FailingL2(tmp_path / "l2"))
    node.store(
        node.tracker(token_ids=sequence(1)), list(np.zeros((3, *CONFIG.layout.shape), np.float32))
    )
    one = keys_of(sequence(1))
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        r = delete(c, {"keys": wire(one), "tier": "all"})
        assert (r.status_code, r.json()) == (
            200, {"deleted": 1, "skipped": 0, "ok": False, "error": "the L2 disk is gone"}
        )  # fmt: skip
    assert [node.l1.contains(k) for k in one] == [False, True, True]  # stopped at the failure
    node.close()


def test_openapi_describes_the_cache_control_bodies(client: httpx.Client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    body = paths["/cache/objects"]["delete"]["requestBody"]["content"]["application/json"]["schema"]
    assert "keys" in json.dumps(body) and "force" in json.dumps(body)
    assert {"/cache/prefetches", "/cache/prefetches/{request_id}", "/cache/clear"} <= set(paths)


def test_a_body_over_the_limit_is_413(client: httpx.Client, node: CacheNode) -> None:
    from kvatlas.node.http_api import CACHE_CONTROL_MAX_BYTES

    huge = b'{"keys": [' + b" " * CACHE_CONTROL_MAX_BYTES + b"]}"
    r = client.request(
        "DELETE", "/cache/objects", content=huge, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and held(node, keys_of(sequence(1))) == {
        "l1": 3,
        "l2": 3,
        "presence": 3,
    }
