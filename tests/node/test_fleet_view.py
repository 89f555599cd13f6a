"""HttpFleetView reads what the coordinator writes (through the same wire module): holders
per key from a real coordinator's lookup, peers from its instance listing; a malformed or
failed reply is a miss, never an exception."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvatlas.client import CoordinatorClient, CoordinatorError
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.fleet_view import Holder, HttpFleetView
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.peer import PeerClient

RANK = pack_kv_rank(1, 0, 1, 0)
KEYS = [ObjectKey(bytes([i]) * 32, "m", RANK) for i in range(1, 4)]
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, dtype="float32")


def view_of(client: Any, **kw: Any) -> HttpFleetView:
    return HttpFleetView(client, layout=LAYOUT, **kw)


@pytest.fixture(scope="module")
def coordinator() -> Iterator[BackgroundServer]:
    with BackgroundServer(CoordinatorConfig(port=free_port(), chunk_size=4)) as server:
        entries = tuple(CacheEntry(k, 10) for k in KEYS[:2])
        server.service.ingest(
            [
                EventBatch("a", 1, 1, "store", "l1", "dram", entries=entries),
                EventBatch("b", 1, 1, "store", "l2", "redis", shared=True, entries=entries[:1]),
            ]
        )
        yield server


def test_holders_from_a_real_coordinator(coordinator: BackgroundServer) -> None:
    with CoordinatorClient(coordinator.url) as client:
        holders = view_of(client).holders(KEYS)
    assert [sorted(h, key=lambda x: x.instance_id) for h in holders] == [
        [Holder("a", "l1", "dram", False), Holder("b", "l2", "redis", True)],
        [Holder("a", "l1", "dram", False)],
        [],
    ]


def test_peer_from_the_instance_listing(coordinator: BackgroundServer) -> None:
    with CoordinatorClient(coordinator.url) as client:
        client.register("peer-x", p2p_advertised_url="http://127.0.0.1:1")
        view = view_of(client, refresh_interval=0.0)
        peer = view.peer("peer-x")
        assert isinstance(peer, PeerClient) and peer.url == "http://127.0.0.1:1"
        assert view.peer("a") is None  # emits, never registered: no URL
        client.deregister()


class FakeClient:
    def __init__(self, lookup: Any = None, instances: Any = None) -> None:
        self._lookup = lookup
        self._instances = instances

    def lookup_keys(self, keys: list[ObjectKey]) -> Any:
        if isinstance(self._lookup, Exception):
            raise self._lookup
        return self._lookup

    def instances(self) -> Any:
        if isinstance(self._instances, Exception):
            raise self._instances
        return self._instances


@pytest.mark.parametrize(
    "reply",
    [
        CoordinatorError("down"),
        {},
        {"results": []},
        {"chunks": 3, "results": [], "prefix": []},  # fewer results than keys
        # a malformed placement row: accepting it would give holders instead of misses
        {"results": [{"placements": [{"instance_id": "a", "tier": 1}]}] * 3},
        [],
    ],
)
def test_bad_lookup_reply_is_a_miss(reply: Any) -> None:
    view = view_of(FakeClient(lookup=reply))
    assert view.holders(KEYS) == [[], [], []]


@pytest.mark.parametrize(
    "rows", [CoordinatorError("down"), [{"instance_id": "x"}], [None], KeyError("instances")]
)
def test_bad_instance_listing_is_no_peer(rows: Any) -> None:
    view = view_of(FakeClient(instances=rows))
    assert view.peer("x") is None
