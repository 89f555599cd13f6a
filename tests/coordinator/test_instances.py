"""Instance lifecycle over HTTP: register, heartbeat, deregister, listing, timeout fencing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from kvatlas.coordinator.instances import InstanceRegistry, Registration
from kvatlas.coordinator.server import BackgroundServer
from tests.conftest import wait_for
from tests.coordinator.helpers import (
    Emitter,
    fresh,
    fresh_tokens,
    lookup_tokens,
    placements_by_key,
    post_batches,
    running,
    wire_batch,
)

TIMEOUT = 0.3


def _instances(client: httpx.Client) -> dict[str, dict[str, Any]]:
    r = client.get("/instances")
    assert r.status_code == 200, r.text
    return {row["instance_id"]: row for row in r.json()["instances"]}


def test_register_assigns_id_when_none(client: httpx.Client) -> None:
    r = client.post("/instances", json={"ip": "10.0.0.1", "http_port": 8000, "metadata": {}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["instance_id"], str) and body["instance_id"]
    assert body["re_registered"] is False
    other = client.post("/instances", json={"ip": "10.0.0.2"}).json()["instance_id"]
    assert other != body["instance_id"]
    assert {body["instance_id"], other} <= set(_instances(client))


def test_register_again_is_re_registered_and_ignores_unknown_fields(client: httpx.Client) -> None:
    inst = fresh("reg")
    body = {
        "instance_id": inst,
        "ip": "10.0.0.3",
        "http_port": 8080,
        "metadata": {"model": "m", "gpu": 0},
        "p2p_advertised_url": "http://10.0.0.3:9000",
        "mq_port": 5555,
        "lmcache_future_field": {"x": [1, 2]},
        "another": 5,
    }
    r = client.post("/instances", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"instance_id": inst, "re_registered": False}
    r = client.post("/instances", json=body)
    assert r.json() == {"instance_id": inst, "re_registered": True}
    row = _instances(client)[inst]
    assert row["ip"] == "10.0.0.3"
    assert row["http_port"] == 8080
    assert row["metadata"] == {"model": "m", "gpu": 0}
    assert row["p2p_advertised_url"] == "http://10.0.0.3:9000"
    assert row["mq_port"] == 5555
    assert row["alive"] is True
    assert "lmcache_future_field" not in row


def test_registration_strips_whitespace_as_lmcache_does(client: httpx.Client) -> None:
    """LMCache 0.5.6 strips ``instance_id``, ``ip`` and ``p2p_advertised_url`` (pydantic
    ``strip_whitespace``): ``"  b  "`` registers ``b`` (kvatlas registered ``"  b  "``, whose
    heartbeat as ``b`` was a 404), a blank id is assigned one, ``" 10.0.0.9 "`` is an address
    (a 422 here)."""
    name = fresh("ws")
    r = client.post(
        "/instances",
        json={"instance_id": f"  {name}\t", "ip": " 10.0.0.9 ", "http_port": 1,
              "p2p_advertised_url": " http://10.0.0.9:9000 "},
    )  # fmt: skip
    assert r.json() == {"instance_id": name, "re_registered": False}, r.text
    assert client.put(f"/instances/{name}/heartbeat").status_code == 200
    row = _instances(client)[name]
    assert (row["ip"], row["p2p_advertised_url"]) == ("10.0.0.9", "http://10.0.0.9:9000")
    blank = client.post("/instances", json={"instance_id": "   ", "ip": "10.0.0.9"})
    assert blank.status_code == 200 and blank.json()["instance_id"].strip(), blank.text


def test_heartbeat_known_and_unknown(client: httpx.Client) -> None:
    inst = fresh("hb")
    assert client.post("/instances", json={"instance_id": inst}).status_code == 200
    r = client.put(f"/instances/{inst}/heartbeat")
    assert r.status_code == 200, r.text
    r = client.put(f"/instances/{fresh('ghost')}/heartbeat")
    assert r.status_code == 404
    assert r.json()["detail"] == "unknown instance; re-register"


def test_deregister_fences_l1_keeps_l2_forgets_cursor(client: httpx.Client) -> None:
    em = Emitter(incarnation=3)
    tokens = fresh_tokens(2)
    assert client.post("/instances", json={"instance_id": em.instance_id}).status_code == 200
    post_batches(client, em.store_chunks(tokens))
    post_batches(client, em.store_chunks(tokens, tier="l2", backend="fs"))
    assert (
        placements_by_key(lookup_tokens(client, tokens))
        == [{(em.instance_id, "l1", "dram"), (em.instance_id, "l2", "fs")}] * 2
    )
    r = client.delete(f"/instances/{em.instance_id}")
    assert (r.status_code, r.content) == (204, b""), r.text  # as LMCache answers it
    assert placements_by_key(lookup_tokens(client, tokens)) == [{(em.instance_id, "l2", "fs")}] * 2
    assert em.instance_id not in _instances(client)
    assert client.put(f"/instances/{em.instance_id}/heartbeat").status_code == 404
    # the cursor is forgotten: seq 1 of the same incarnation applies again
    em.seq = 0
    r = post_batches(client, em.store_chunks(tokens))
    assert r.json() == {"applied": 1, "duplicates": 0, "stale": 0}
    assert _instances(client)[em.instance_id]["last_seq"] == 1
    assert (
        placements_by_key(lookup_tokens(client, tokens))
        == [{(em.instance_id, "l1", "dram"), (em.instance_id, "l2", "fs")}] * 2
    )


@pytest.mark.parametrize("name", ["rack/a", "pool:fs@x", "a%b", "sp ace", "ünï"])
def test_deregister_reaches_every_id_events_accept(client: httpx.Client, name: str) -> None:
    """``POST /events`` takes any id of up to 256 characters (``/`` and ``@`` too): its
    placements are fenced by ``DELETE /instances/{id}`` with the id percent-encoded as one
    path segment (a ``%2F`` used to split it: 404, and the L1 copies stayed)."""
    em = Emitter(instance_id=f"{fresh('emit')}-{name}")
    tokens = fresh_tokens(2)
    post_batches(client, em.store_chunks(tokens))
    assert (
        placements_by_key(lookup_tokens(client, tokens)) == [{(em.instance_id, "l1", "dram")}] * 2
    )
    r = client.delete(f"/instances/{quote(em.instance_id, safe='')}")
    assert (r.status_code, r.content) == (204, b""), r.text
    assert placements_by_key(lookup_tokens(client, tokens)) == [set()] * 2
    # a heartbeat names the same segment: the instance is gone (not "no such route")
    r = client.put(f"/instances/{quote(em.instance_id, safe='')}/heartbeat")
    assert (r.status_code, r.json()["detail"]) == (404, "unknown instance; re-register")
    # a wrong method on it is a 405 naming the route's, as for any id
    r = client.get(f"/instances/{quote(em.instance_id, safe='')}/heartbeat")
    assert (r.status_code, r.headers.get("allow")) == (405, "PUT"), r.text


def test_an_encoded_slash_is_no_literal_routes() -> None:
    """``/directory%2Fkeys`` is one segment, ``directory/keys``: no route's (it was served as
    ``/directory/keys``, the decoded path matched first)."""
    with running() as (_, client):
        assert client.get("/directory%2Fkeys").status_code == 404
        assert client.get("/directory/keys").status_code == 200


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("PUT", "/quota/%ff", {"limit_gb": 1}),  # a path parameter
        ("GET", "/quota/a%C3", None),  # a cut multi-byte sequence
        ("GET", "/cache/pins?cache_salt=%ff", None),  # a query parameter
        ("PUT", "/instances/%fe%ff/heartbeat", None),
    ],
)
def test_a_percent_encoded_name_that_is_not_utf8_is_refused(
    client: httpx.Client, method: str, url: str, body: Any
) -> None:
    """A name percent-encoded from bytes that are not UTF-8 is a 400 naming the cause: it was
    read with U+FFFD in their place (a quota for salt "\ufffd", listed and kept over a
    restart)."""
    r = client.request(method, url, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    assert "UTF-8" in r.json()["detail"]
    assert "\ufffd" not in client.get("/quota").text


def test_deregister_unknown_instance_is_harmless(client: httpx.Client) -> None:
    r = client.delete(f"/instances/{fresh('nobody')}")
    assert (r.status_code, r.content) == (204, b""), r.text  # as LMCache answers it


def test_instances_listing_shows_incarnation_seq_and_gaps(client: httpx.Client) -> None:
    inst = fresh("gaps")
    assert client.post("/instances", json={"instance_id": inst}).status_code == 200
    row = _instances(client)[inst]
    assert row["alive"] is True
    assert row["gaps"] == 0
    post_batches(client, wire_batch(inst, 11, 1), wire_batch(inst, 11, 2))
    row = _instances(client)[inst]
    assert (row["incarnation"], row["last_seq"], row["gaps"]) == (11, 2, 0)
    r = post_batches(client, wire_batch(inst, 11, 5))  # seq 3 and 4 missing: a gap, applied
    assert r.json()["applied"] == 1
    row = _instances(client)[inst]
    assert (row["incarnation"], row["last_seq"], row["gaps"]) == (11, 5, 1)
    assert row["missing_batches"] == 2
    assert row["events_dropped"] == 0
    assert row["seconds_since_last_event"] >= 0
    assert "event_delivery_delay_seconds" in row


def test_unregistered_emitter_listed(client: httpx.Client) -> None:
    inst = fresh("unreg")
    post_batches(client, wire_batch(inst, 2, 1))
    row = _instances(client)[inst]
    assert row["registered"] is False
    assert (row["incarnation"], row["last_seq"]) == (2, 1)


def test_unregistered_emitter_row_carries_lmcaches_registration_fields(
    client: httpx.Client,
) -> None:
    """LMCache's own CLI (`lmcache query coordinator --api instances`) reads ``instance["ip"]``
    and ``instance["http_port"]`` of every row: a row without them was a KeyError there (found
    driving its CLI against kvatlas). An emitter that never registered carries LMCache's
    "absent" values; ``registration_time`` is ``null`` (it never registered)."""
    inst = fresh("unreg")
    post_batches(client, wire_batch(inst, 2, 1))
    row = _instances(client)[inst]
    assert row["registered"] is False and row["alive"] is False
    absent = {"ip": "", "http_port": 0, "metadata": {}, "p2p_advertised_url": "", "mq_port": 0}
    assert {k: row[k] for k in absent} == absent
    assert row["registration_time"] is None


# ------------------------------------------------------------------------------------- timeout


class FakeClock:
    """The registry's heartbeat clock, advanced by the test: no wall-clock races."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def timeout_server() -> Iterator[tuple[BackgroundServer, httpx.Client, FakeClock]]:
    clock = FakeClock()
    with running(clock=clock, instance_timeout=TIMEOUT) as (server, client):
        yield server, client, clock


def test_instance_timeout_fences_l1(
    timeout_server: tuple[BackgroundServer, httpx.Client, FakeClock],
) -> None:
    _, client, clock = timeout_server
    em, tokens = Emitter(), fresh_tokens(2)
    # events first, registration last: the timeout counts from the registration
    post_batches(client, em.store_chunks(tokens))
    post_batches(client, em.store_chunks(tokens, tier="l2", backend="fs"))
    assert client.post("/instances", json={"instance_id": em.instance_id}).status_code == 200
    clock.now += 2 * TIMEOUT  # heartbeats stop; the background sweep fences it

    def l1_gone() -> bool:
        return (
            placements_by_key(lookup_tokens(client, tokens)) == [{(em.instance_id, "l2", "fs")}] * 2
        )

    assert wait_for(l1_gone, timeout=10.0), "L1 placements survived the instance timeout"
    # no longer a live registration (its emitter cursor may still be listed)
    assert _instances(client).get(em.instance_id, {}).get("alive") is not True
    r = client.put(f"/instances/{em.instance_id}/heartbeat")
    assert r.status_code == 404
    assert r.json()["detail"] == "unknown instance; re-register"


def test_heartbeats_keep_instance_alive(
    timeout_server: tuple[BackgroundServer, httpx.Client, FakeClock],
) -> None:
    server, client, clock = timeout_server
    em, tokens = Emitter(), fresh_tokens(1)
    post_batches(client, em.store_chunks(tokens))
    assert client.post("/instances", json={"instance_id": em.instance_id}).status_code == 200
    for _ in range(8):  # four timeouts' worth of fake time, a heartbeat every half timeout
        clock.now += TIMEOUT / 2
        assert client.put(f"/instances/{em.instance_id}/heartbeat").status_code == 200
        assert server.service.instances.expire() == []
    assert placements_by_key(lookup_tokens(client, tokens)) == [{(em.instance_id, "l1", "dram")}]
    clock.now += 2 * TIMEOUT  # once they stop, the background sweep fences it
    assert wait_for(lambda: not server.service.instances.known(em.instance_id), timeout=10.0)


def test_a_re_registration_waits_for_the_fence_of_the_instance_it_replaces() -> None:
    """The sweep forgets an expired instance, then fences it: a re-registration arriving in
    between (the paused node's next heartbeat got 404) must not land before the fence, or the
    fence would drop what the re-registered node reports from then on."""
    clock = [1000.0]
    in_fence, release = threading.Event(), threading.Event()
    order: list[str] = []

    def on_fence(instance_id: str) -> None:
        in_fence.set()
        assert release.wait(30)
        order.append(f"fenced {instance_id}")

    registry = InstanceRegistry(30.0, on_fence, clock=lambda: clock[0])
    registry.register("n1", Registration())
    clock[0] += 31
    sweep = threading.Thread(target=registry.expire)
    sweep.start()
    assert in_fence.wait(30)

    def re_register() -> None:
        registry.register("n1", Registration())
        order.append("registered n1")

    node = threading.Thread(target=re_register)
    node.start()
    node.join(timeout=0.5)  # without the ordering it lands now, inside the fence
    release.set()
    sweep.join(timeout=30)
    node.join(timeout=30)
    assert order == ["fenced n1", "registered n1"]
    assert registry.known("n1") and registry.expired_total == 1


def test_a_private_declaration_stays_its_instances_beside_a_shared_pool_of_that_backend() -> None:
    """LMCache attributes each config batch by its ``shared`` flag: an instance's private fs
    L2 (``shared: false``) is its own module even while another instance declares a shared fs
    pool. kvatlas folded it into the pool (its capacity became the pool's; the instance's row
    lost it), found running LMCache 0.5.6's coordinator and its CLI side by side."""

    def config(instance: str, shared: bool, capacity: int) -> dict[str, Any]:
        return wire_batch(instance, 1, 1, "config", tier="l2", backend="fs", shared=shared,
                          capacity_bytes=capacity, capacity_revision=1)  # fmt: skip

    with running(chunk_size=16) as (_, client):
        pool, private = fresh("pool"), fresh("private")
        assert post_batches(client, config(pool, True, 8192)).json()["applied"] == 1
        assert post_batches(client, config(private, False, 1 << 20)).json()["applied"] == 1
        usage = client.get("/instances/usage").json()
        assert usage["shared_modules"] == [
            {"tier": "l2", "backend": "fs", "shared": True, "used_bytes": 0,
             "capacity_bytes": 8192, "usage_ratio": 0.0},
        ]  # fmt: skip
        assert client.get(f"/instances/{private}/usage").json()["modules"] == [
            {"tier": "l2", "backend": "fs", "shared": False, "used_bytes": 0,
             "capacity_bytes": 1 << 20, "usage_ratio": 0.0},
        ]  # fmt: skip
