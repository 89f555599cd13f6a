"""A move's hold on its target node (``kvatlas/node/holds.py``, ``PUT``/``DELETE
/cache/holds/{hold_id}``; ``docs/cache-control.md``, "Moves"): held keys are passed by L1's
LRU until the hold is released or expires; the route loads what L1 lacks from the node's own
L2 before holding; a source it cannot read is a 503 (asked again), bad input a 4xx that
changes nothing, and only ``admin`` may call it. A real source over the peer path, and the
coordinator driving it: ``tests/coordinator/test_cache_control_moves.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.auth import Principal, TokenAuth
from kvatlas.keys import ObjectKey, chunk_hashes, expand_prefix_keys
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.holds import MoveHolds
from kvatlas.node.http_api import create_node_app
from kvatlas.node.l2 import FsL2
from kvatlas.node.peer import PeerServer
from kvatlas.node.presence import L1

C = 16
MODEL = "test-model"
CONFIG = NodeConfig(
    model_name=MODEL, num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32",
    l1_bytes=1 << 20, l2="none",
)  # fmt: skip
CHUNK_BYTES = CONFIG.layout.chunk_bytes


def doc(n: int) -> list[int]:
    return [n] + [9906] * (3 * C - 1)


def keys_of(tokens: list[int]) -> list[ObjectKey]:
    return expand_prefix_keys(chunk_hashes(tokens, C), MODEL)


def store(node: CacheNode, n: int) -> None:
    kv = np.full((3, *CONFIG.layout.shape), n, dtype=np.float32)
    assert node.store(node.tracker(token_ids=doc(n)), list(kv)) == 3


def body(n: int, **extra: Any) -> dict[str, Any]:
    return {"model_name": MODEL, "world_size": 1, "token_ids": doc(n),
            "source_instance_id": "elsewhere", **extra}  # fmt: skip


def test_holds_last_until_released_or_expired() -> None:
    now = [0.0]
    holds = MoveHolds(clock=lambda: now[0])
    one, two = keys_of(doc(1)), keys_of(doc(2))
    holds.hold("m1", one, ttl_s=10)
    holds.hold("m2", two[:1], ttl_s=20)
    assert all(k in holds for k in one) and two[0] in holds and two[1] not in holds
    holds.hold("m1", one[:1], ttl_s=10)  # set again: replaces what it held
    assert one[1] not in holds and len(holds) == 2
    now[0] = 15.0
    assert one[0] not in holds and two[0] in holds  # m1 expired
    assert holds.release("m2") == 1 and len(holds) == 0
    assert holds.release("m2") == 0  # idempotent


def test_l1_passes_held_keys_by_until_the_hold_is_released() -> None:
    """L1 fits six chunks: storing two more documents evicts the first one, unless it is
    held (negative control: the unheld second document goes instead)."""
    node = CacheNode(
        NodeConfig(**{**CONFIG.__dict__, "l1_bytes": 6 * CHUNK_BYTES}), instance_id="n1"
    )
    store(node, 1)
    node.holds.hold("move", keys_of(doc(1)), ttl_s=60)
    store(node, 2)
    store(node, 3)
    assert all(node.l1.contains(k) for k in keys_of(doc(1)))  # held: passed by
    assert not any(node.l1.contains(k) for k in keys_of(doc(2)))  # evicted in its place
    assert node.scrape()["held_keys"] == 3
    assert node.holds.release("move") == 3
    store(node, 4)
    assert not any(node.l1.contains(k) for k in keys_of(doc(1)))  # evictable again
    node.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[CacheNode]:
    node = CacheNode(CONFIG, instance_id="n1", l2=FsL2(tmp_path / "l2"))
    store(node, 1)
    yield node
    node.close()


@pytest.fixture
def client(node: CacheNode) -> Iterator[httpx.Client]:
    with (
        PeerServer(create_node_app(node), port=free_port()) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        yield c


def test_a_hold_loads_from_the_nodes_own_l2_and_holds(
    client: httpx.Client, node: CacheNode
) -> None:
    one = keys_of(doc(1))
    node.delete(one, frozenset({L1}), force=True)  # L2 only now
    r = client.put("/cache/holds/move-1", json=body(1))
    assert r.status_code == 200, r.text
    reply = r.json()
    assert (len(reply["held"]), reply["missing"], reply["no_room"]) == (3, [], 0)
    assert {k["chunk_hash_hex"] for k in reply["held"]} == {k.chunk_hash.hex() for k in one}
    assert all(node.l1.contains(k) and k in node.holds for k in one)
    r = client.delete("/cache/holds/move-1")
    assert r.json() == {"hold_id": "move-1", "released": 3}
    assert client.delete("/cache/holds/move-1").json()["released"] == 0  # idempotent
    assert len(node.holds) == 0


def test_a_large_hold_loads_over_several_calls(
    client: httpx.Client, node: CacheNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call loads for a bounded time, then answers with the rest ``unfinished``; the
    next call goes on (a chunk a call here)."""
    import kvatlas.node.moves as moves

    monkeypatch.setattr(moves, "MOVE_BATCH", 1)
    monkeypatch.setattr(moves, "MOVE_BUDGET_S", 0.0)
    node.delete(keys_of(doc(1)), frozenset({L1}), force=True)
    got = []
    for _ in range(3):
        reply = client.put("/cache/holds/big", json=body(1)).json()
        got.append((len(reply["held"]), reply["missing"], reply["unfinished"]))
    assert got == [(1, [], 2), (2, [], 1), (3, [], 0)]


def test_a_large_hold_of_keys_found_nowhere_goes_on_where_it_stopped(
    client: httpx.Client, node: CacheNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys an earlier call found nowhere are not asked again by the same hold: each call
    makes progress, however many keys are missing (without that memory every call would try
    the same first batch and the move would never finish)."""
    import kvatlas.node.moves as moves
    from kvatlas.node.fleet_view import InProcessFleetView
    from kvatlas.node.peer import PeerReply

    class Empty:  # a source that answers, holding none of them
        asked = 0

        def fetch(self, keys: Any, tiers: Any = ("l1",)) -> PeerReply:
            Empty.asked += len(keys)
            return PeerReply()

    monkeypatch.setattr(moves, "MOVE_BATCH", 1)
    monkeypatch.setattr(moves, "MOVE_BUDGET_S", 0.0)
    node.fleet = InProcessFleetView(lambda keys: [[] for _ in keys], lambda _i: Empty())
    got = []
    for _ in range(3):
        reply = client.put("/cache/holds/nowhere", json=body(7)).json()
        got.append((len(reply["held"]), len(reply["missing"]), reply["unfinished"]))
    assert got == [(0, 1, 2), (0, 2, 1), (0, 3, 0)]
    assert Empty.asked == 6  # each key once from the source's L1, once from its L2


def test_a_source_the_node_cannot_read_is_a_503_and_what_l1_has_stays_held(
    client: httpx.Client, node: CacheNode
) -> None:
    """No fleet view here: the keys L1 and L2 lack cannot come from the source; the
    coordinator asks again later (a 5xx), and nothing was half-done but the hold of what L1
    has."""
    r = client.put("/cache/holds/move-2", json=body(7))
    assert r.status_code == 503 and "not reachable" in r.json()["detail"], r.text
    assert len(node.holds) == 0


BAD_HOLDS: list[tuple[str, Any, int]] = [
    ("/cache/holds/a b", body(1), 400),  # hold id
    ("/cache/holds/" + "x" * 129, body(1), 400),
    ("/cache/holds/m", body(1, model_name="other"), 400),
    ("/cache/holds/m", body(1, world_size=2), 400),
    ("/cache/holds/m", body(1, source_instance_id="a@b"), 400),
    ("/cache/holds/m", body(1, cache_salt="a@b"), 400),
    ("/cache/holds/m", body(1, ttl_s=0), 422),
    ("/cache/holds/m", body(1, ttl_s=3601), 422),
    ("/cache/holds/m", body(1, tll_s=5), 422),  # unknown field
    ("/cache/holds/m", {"model_name": MODEL}, 422),
]


@pytest.mark.parametrize(("path", "payload", "status"), BAD_HOLDS)
def test_bad_holds_are_refused_and_change_nothing(
    client: httpx.Client, node: CacheNode, path: str, payload: Any, status: int
) -> None:
    before = sorted((p.key.chunk_hash, p.tier) for p in node.held())
    r = client.put(path, json=payload)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["detail"], str)
    assert sorted((p.key.chunk_hash, p.tier) for p in node.held()) == before
    assert len(node.holds) == 0


def test_holds_are_for_admin_only(node: CacheNode) -> None:
    auth = TokenAuth.from_tokens([
        ("admin-token", Principal("ops", frozenset({"admin"}))),
        ("engine-token", Principal("engine", frozenset({"engine"}))),
    ])  # fmt: skip
    with (
        PeerServer(create_node_app(node, auth=auth), port=free_port()) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        for headers, status in (({}, 401), ({"authorization": "Bearer engine-token"}, 403)):
            assert c.put("/cache/holds/m", json=body(1), headers=headers).status_code == status
            assert c.delete("/cache/holds/m", headers=headers).status_code == status
            assert len(node.holds) == 0
        r = c.put("/cache/holds/m", json=body(1), headers={"authorization": "Bearer admin-token"})
        assert r.status_code == 200 and len(r.json()["held"]) == 3


def test_a_release_while_a_hold_call_loads_stands_and_leaves_nothing_behind(
    node: CacheNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator releases a move's hold (the move finished or failed) while a hold call
    of that move still loads from L2: the call's end does not hold the keys again, a later
    call of that move holds nothing, and what it found nowhere is not kept (negative control:
    a hold under another id is set as before)."""
    one = keys_of(doc(1))
    node.delete(one, frozenset({L1}), force=True)  # L2 only now: the call loads
    assert node.l2 is not None
    get_many = node.l2.get_many

    def released_meanwhile(keys: Any) -> Any:
        assert node.holds.release("move") == 3  # the first hold was set: all three keys
        return get_many(keys)

    monkeypatch.setattr(node.moves.l2, "get_many", released_meanwhile)
    node.moves.load_and_hold("move", node.tracker(token_ids=doc(1)), "elsewhere", 600.0)
    assert node.holds.holds() == 0 and not any(k in node.holds for k in one)
    node.moves.load_and_hold("move", node.tracker(token_ids=doc(1)), "elsewhere", 600.0)
    assert node.holds.holds() == 0
    node.holds.note_missing("gone", one)  # a late call's keys found nowhere, after its release
    node.holds.hold("gone", one, 60.0)  # an id never released is held
    assert node.holds.missing("gone") == frozenset()  # nothing stale came with it
    assert node.holds.holds() == 1
