"""HttpFleetView reads what the coordinator writes (through the same wire types): holders
per key from a real coordinator's lookup, peers from its instance listing; a malformed or
failed reply is a miss, never an exception."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvatlas.api import InstanceRow, InstancesReply, LookupReply
from kvatlas.client import CoordinatorClient, CoordinatorError
from kvatlas.client.coordinator_client import read_reply
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import Registration
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.coordinator.views import NO_EMITTER, InstanceView
from kvatlas.coordinator.wire import instance_to_wire
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
    """Answers with a raw reply (JSON), read as ``CoordinatorClient`` reads it
    (``read_reply`` into the wire type), or raises."""

    def __init__(self, lookup: Any = None, instances: Any = None) -> None:
        self._lookup = lookup
        self._instances = instances

    @staticmethod
    def _reply(reply: Any, path: str, type_: Any) -> Any:
        if isinstance(reply, Exception):
            raise reply
        return read_reply("GET", path, 200, json.dumps(reply).encode(), type_)

    def lookup_keys(self, keys: list[ObjectKey]) -> LookupReply:
        found: LookupReply = self._reply(self._lookup, "/directory/lookup", LookupReply)
        return found

    def instances(self) -> list[InstanceRow]:
        found: InstancesReply = self._reply(self._instances, "/instances", InstancesReply)
        return found.instances


@pytest.mark.parametrize(
    "reply",
    [
        CoordinatorError("down"),
        {},
        {"results": []},
        {"chunks": 3, "results": [], "prefix": []},  # fewer results than keys
        # a malformed placement row: accepting it would give holders instead of misses
        {"chunks": 3, "results": [{"placements": [{"instance_id": "a", "tier": 1}]}] * 3},
        [],
    ],
)
def test_bad_lookup_reply_is_a_miss(reply: Any) -> None:
    view = view_of(FakeClient(lookup=reply))
    assert view.holders(KEYS) == [[], [], []]


@pytest.mark.parametrize(
    "rows",
    [
        CoordinatorError("down"),
        {"instances": [{"instance_id": "x"}]},  # alive without registration fields
        {"instances": [None]},
        {"rows": []},
    ],
)
def test_bad_instance_listing_is_no_peer(rows: Any) -> None:
    view = view_of(FakeClient(instances=rows))
    assert view.peer("x") is None


def test_a_good_listing_through_the_same_fake_gives_a_peer() -> None:
    """Negative control of the two tests above: the fake reads a well-formed reply."""
    row = {"instance_id": "x", "metadata": {}, "p2p_advertised_url": "http://127.0.0.1:1"}
    assert isinstance(view_of(FakeClient(instances={"instances": [row]})).peer("x"), PeerClient)
    placement = {"instance_id": "a", "incarnation": 1, "tier": "l1", "backend": "dram"}
    placement |= {"size_bytes": 1, "shared": False}
    result = {"key": KEYS[0].to_wire(), "placements": [placement]}
    view = view_of(FakeClient(lookup={"chunks": 3, "results": [result] * 3}))
    assert view.holders(KEYS) == [[Holder("a", "l1", "dram", False)]] * 3


class ListingClient:
    """Counts ``instances()`` calls; the listing is whatever ``rows`` holds at the time."""

    def __init__(self, rows: list[InstanceRow]) -> None:
        self.rows = rows
        self.listings = 0

    def instances(self) -> list[InstanceRow]:
        self.listings += 1
        return self.rows


def _row(instance_id: str, url: str | None) -> InstanceRow:
    """A ``GET /instances`` row as the coordinator writes it."""
    view = InstanceView(instance_id, Registration(p2p_advertised_url=url), 0.0, 0.0, NO_EMITTER)
    return instance_to_wire(view)


def test_unknown_instances_list_the_fleet_at_most_once_per_interval() -> None:
    now = [0.0]
    client = ListingClient([_row("a", "http://127.0.0.1:1")])
    view = view_of(client, refresh_interval=30.0, clock=lambda: now[0])
    for _ in range(100):
        assert view.peer("ghost") is None  # a placement naming an instance without a URL
    assert isinstance(view.peer("a"), PeerClient)
    assert client.listings == 1
    now[0] = 29.9
    assert view.peer("ghost") is None and client.listings == 1
    now[0] = 30.0
    assert view.peer("ghost") is None and client.listings == 2


def test_a_refresh_follows_moved_and_departed_peers() -> None:
    now = [0.0]
    client = ListingClient([_row("a", "http://127.0.0.1:1/"), _row("b", "http://127.0.0.1:2")])
    view = view_of(client, refresh_interval=10.0, clock=lambda: now[0])
    first = view.peer("a")
    assert isinstance(first, PeerClient) and first.url == "http://127.0.0.1:1"
    assert view.peer("a") is first  # cached, same client
    client.rows = [_row("a", "http://127.0.0.1:3"), _row("c", None)]
    now[0] = 10.0
    moved = view.peer("a")
    assert isinstance(moved, PeerClient) and moved.url == "http://127.0.0.1:3"
    assert view.peer("b") is None and view.peer("c") is None
    assert client.listings == 2
    view.close()
