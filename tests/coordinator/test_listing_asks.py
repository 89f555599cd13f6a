"""Asks for full listings across replicas (docs/coordinator.md, "Stream retention"): a replica
that lost events records an ask in ``<stream>:listings``; every other replica acts on it once,
asking each node registered with it (heartbeat reply ``list_all: true``, once); the node's
client calls the listing hook. The end-to-end case, with a real node and a trimmed stream, is
``test_retention.py::test_a_replica_behind_the_trim_is_repaired_by_nodes_registered_with_another``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import redis

from kvatlas.client.coordinator_client import CoordinatorClient
from kvatlas.coordinator.fleet_liveness import (
    LISTING_ASK_WINDOW_S,
    FleetLiveness,
    share_registrations,
)
from kvatlas.coordinator.instances import InstanceRegistry, Registration
from kvatlas.coordinator.readiness import ReadinessTracker
from kvatlas.coordinator.views import Readiness
from kvatlas.errors import Unavailable
from tests.conftest import RedisServer
from tests.coordinator.helpers import running

_streams = itertools.count()


@pytest.fixture
def liveness(redis_server: RedisServer) -> Iterator[tuple[FleetLiveness, FleetLiveness]]:
    """Two replicas' records of one stream."""
    stream = f"asks-{next(_streams)}"
    a = FleetLiveness.connect(redis_server.url, stream)
    b = FleetLiveness.connect(redis_server.url, stream)
    yield a, b
    a.close()
    b.close()


def test_another_replica_acts_on_an_ask_once_and_the_asker_never(
    liveness: tuple[FleetLiveness, FleetLiveness],
) -> None:
    a, b = liveness
    assert a.listing_asks("a") == b.listing_asks("b") == (False, [])  # negative control
    a.ask_listings()
    assert a.listing_asks("a") == (True, [])  # recorded; its own nodes exchange digests with it
    assert b.listing_asks("b") == (False, ["a"])
    assert b.listing_asks("b") == (False, [])  # acted on once
    a.ask_listings()  # lost events again: a new ask
    assert a.listing_asks("a") == (True, []) and b.listing_asks("b") == (False, ["a"])


def test_an_old_ask_or_one_not_ours_to_read_is_not_acted_on(
    liveness: tuple[FleetLiveness, FleetLiveness],
) -> None:
    a, b = liveness
    sec, _ = a.client.time()
    a.client.hset(a.listings_key, "old", f"{sec - LISTING_ASK_WINDOW_S - 5:.3f}")
    a.client.hset(a.listings_key, "odd", "yesterday")
    a.client.hset(a.listings_key, "empty", "")
    a.client.hset(a.listings_key, "new", f"{sec - 5:.3f}")  # e.g. before this replica started
    assert b.listing_asks("b") == (False, ["new"])


def test_an_ask_redis_did_not_take_is_made_again(
    redis_server: RedisServer, liveness: tuple[FleetLiveness, FleetLiveness]
) -> None:
    a, b = liveness
    good = a.client
    a.client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)  # nothing there
    a.ask_listings()
    with pytest.raises(Unavailable):
        a.listing_asks("a")
    a.client.close()
    a.client = good
    assert b.listing_asks("b") == (False, [])  # not recorded yet
    assert a.listing_asks("a") == (True, [])  # recorded now
    assert b.listing_asks("b") == (False, ["a"])


def test_each_node_registered_here_is_asked_once_in_a_heartbeat_reply(
    liveness: tuple[FleetLiveness, FleetLiveness],
) -> None:
    a, b = liveness
    registry = InstanceRegistry(30.0, lambda _: None)
    for name in ("n1", "n2"):
        registry.register(name, Registration())
    a.ask_listings()
    share_registrations(a, InstanceRegistry(30.0, lambda _: None), "a")
    assert not registry.take_listing("n1")  # negative control: b has not looked yet
    assert share_registrations(b, registry, "b") == {"n1": None, "n2": None}
    assert registry.take_listing("n1") and not registry.take_listing("n1")
    registry.deregister("n2")
    assert not registry.take_listing("n2")  # gone: nothing owed
    share_registrations(b, registry, "b")
    assert not registry.take_listing("n1")  # the same ask is not acted on twice


def test_the_asking_replica_waits_for_the_listings_of_the_nodes_registered_elsewhere(
    liveness: tuple[FleetLiveness, FleetLiveness],
) -> None:
    """``/readyz`` stays ``resyncing`` until the listings it asked for arrived (each node's
    ``resync`` batch), not only its own nodes' digest exchanges; twice the instance timeout
    still bounds it."""
    a, b = liveness
    now = [0.0]
    mine, theirs = (InstanceRegistry(30.0, lambda _: None, lambda: now[0]) for _ in "ab")
    mine.register("own", Registration())
    theirs.register("n1", Registration())
    share_registrations(b, theirs, "b")  # n1 is known to be registered with b
    tracker = ReadinessTracker(mine, 30.0, lambda: now[0])
    tracker.set(Readiness.RESYNCING)  # e.g. Redis lost events
    tracker.set(Readiness.SERVING)
    mine.expect_listings()  # what the service does when it asks
    a.ask_listings()
    mine.digest_done("own")
    tracker.check_resynced()
    assert tracker.state is Readiness.RESYNCING  # the ask is not even recorded yet
    share_registrations(a, mine, "a")
    tracker.check_resynced()
    assert tracker.state is Readiness.RESYNCING  # n1's listing is due
    mine.digest_done("n1")  # its resync batch was applied
    tracker.check_resynced()
    assert tracker.state is Readiness.SERVING
    tracker.set(Readiness.RESYNCING)  # again, and the listing never comes
    tracker.set(Readiness.SERVING)
    mine.expect_listings()
    tracker.check_resynced()
    assert tracker.state is Readiness.RESYNCING
    now[0] += 61
    tracker.check_resynced()
    assert tracker.state is Readiness.SERVING and not mine.listings_due()


def test_the_heartbeat_reply_asks_once_and_the_client_calls_the_listing_hook() -> None:
    with running() as (server, http):
        client = CoordinatorClient(server.url)
        called: list[str] = []
        client.on_resync = lambda: called.append("resync")
        try:
            client.register("n1")
            assert called == ["resync"]  # a registration exchanges digests
            server.service.instances.owe_listings()
            reply = http.put("/instances/n1/heartbeat").json()
            assert reply == {"instance_id": "n1", "ok": True, "resync": True, "list_all": True}
            assert http.put("/instances/n1/heartbeat").json() == {"instance_id": "n1", "ok": True}
            server.service.instances.owe_listings()
            client.heartbeat()  # without a listing hook: an older node exchanges digests
            assert called == ["resync", "resync"]
            client.on_list_all = lambda: called.append("list_all")
            server.service.instances.owe_listings()
            client.heartbeat()
            client.heartbeat()
            assert called == ["resync", "resync", "list_all"]
        finally:
            client.close()


@pytest.mark.parametrize("name", ["n#1", "n?x=1", "n 1%2F", "n%"])
def test_the_client_names_its_instance_as_one_path_segment(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A registered id may hold ``# ? %`` and spaces (the salt rule forbids only ``@ / \\``
    and NUL): the client's heartbeat, report, digest, pins and deregistration name it
    percent-encoded (``/instances/n#1/heartbeat`` was a fragment: 404, re-registered)."""
    with running() as (server, _http):
        client = CoordinatorClient(server.url)
        try:
            assert client.register(name) == name
            client.heartbeat()
            assert "re-registering" not in caplog.text  # the heartbeat reached its instance
            assert client.pins() == []
            client.deregister()
            assert not server.service.instances.known(name)
        finally:
            client.close()
