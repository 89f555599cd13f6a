"""Issue 16 items 1 and 8, coordinator side, over real loopback HTTP: emit tokens store only
under their own salts; peer URLs and registration fields are validated; instances and emitters
are capped (the 150,000-emitter flood, at a small scale); departed emitters' cursors and metric
series expire; with auth on, only registered instances emit."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.coordinator.server import BackgroundServer
from kvatlas.errors import Unavailable
from tests.conftest import wait_for
from tests.coordinator.helpers import (
    Emitter,
    assert_error,
    fresh,
    fresh_tokens,
    running,
    wire_batch,
    wire_entry,
    wire_key,
)
from tests.coordinator.security_support import ADMIN, EMIT_ANY, bearer, token, write_tokens

SALT_A, SALT_B = "tenant-a", "tenant-b"
NODE_A = token("node-a")  # what a node holds: emit + lookup, its instance, its tenant's salt


@pytest.fixture(scope="module")
def auth_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    path = write_tokens(
        tmp_path_factory.mktemp("emit") / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": EMIT_ANY, "role": "emit"},
        {
            "token": NODE_A,
            "roles": ["emit", "lookup"],
            "instance_ids": ["node-a"],
            "cache_salts": [SALT_A],
        },
    )
    with running(auth_token_file=path, enable_blend_lookup=True) as pair:
        r = pair[1].post("/instances", json={"instance_id": "node-a"}, headers=bearer(NODE_A))
        assert r.status_code == 200, r.text
        yield pair


def _admin_stats(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/directory/stats", headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_emit_token_cannot_store_for_a_foreign_salt(
    auth_pair: tuple[BackgroundServer, httpx.Client],
) -> None:
    """The forged-KV attack: an emit token for the attacker's own instance lists another
    tenant's keys in a STORE batch. Refused whole (403), nothing applied."""
    _, c = auth_pair
    em = Emitter("node-a", incarnation=fresh_tokens(1)[0] % 1000 + 10)
    tokens = fresh_tokens(2)
    before = _admin_stats(c)
    bodies, entries = _refusals(c)
    for batch, foreign in (
        (em.store_chunks(tokens, salt=SALT_B), [SALT_B]),
        (em.store_chunks(tokens, salt=""), [""]),  # the default salt is a tenant too
        (
            em.batch(
                "store",
                entries=[
                    wire_entry(wire_key(b"\1" * 32, salt=SALT_A)),
                    wire_entry(wire_key(b"\2" * 32, salt=SALT_B)),
                ],
            ),
            [SALT_B],
        ),
        (em.batch("delete", entries=[wire_entry(wire_key(b"\3" * 32, salt=SALT_B))]), [SALT_B]),
    ):
        r = c.post("/events", json={"batches": [batch]}, headers=bearer(NODE_A))
        body = assert_error(r, 403)
        assert "cache_salt" in body["detail"], body
        assert body["cache_salts"] == foreign, body  # every refused salt (a sink leaves them out)
    assert _admin_stats(c)["keys"] == before["keys"]
    # counted: each body (it was not), and its entries under the refused salts
    assert _refusals(c) == (bodies + 4, entries + 2 + 2 + 1 + 1)
    rows = {
        r["instance_id"]: r for r in c.get("/instances", headers=bearer(ADMIN)).json()["instances"]
    }
    assert rows["node-a"]["last_seq"] is None  # not one batch went through the gate
    ok = Emitter("node-a", incarnation=em.incarnation).store_chunks(tokens, salt=SALT_A)
    r = c.post("/events", json={"batches": [ok]}, headers=bearer(NODE_A))
    assert r.status_code == 200 and r.json()["applied"] == 1, r.text


@pytest.mark.parametrize(
    "url",
    [
        "http://attacker.example:80/peer/kv",  # a path: requests land in another API
        "http://10.0.0.1:9400/?x=1",
        "http://10.0.0.1:9400#frag",
        "http://user:secret@10.0.0.1:9400",  # credentials in the URL
        "file:///etc/passwd",
        "gopher://10.0.0.1:70",
        "http://10.0.0.1:99999",
        "http://",
        "http://a b:1",
        "http://x" + "y" * 300 + ":1",
    ],
)
def test_peer_url_must_be_scheme_host_and_port(
    auth_pair: tuple[BackgroundServer, httpx.Client], url: str
) -> None:
    _, c = auth_pair
    body = {"instance_id": "node-a", "p2p_advertised_url": url}
    r = c.post("/instances", json=body, headers=bearer(NODE_A))
    assert "p2p_advertised_url" in assert_error(r, 422)["detail"]
    row = next(
        r
        for r in c.get("/instances", headers=bearer(ADMIN)).json()["instances"]
        if r["instance_id"] == "node-a"
    )
    assert row["p2p_advertised_url"] != url


@pytest.mark.parametrize(
    "url", ["", "http://10.0.0.1:9400", "https://node-a.example:8443/", "10.0.0.8:7000"]
)
def test_good_peer_urls_are_accepted(
    auth_pair: tuple[BackgroundServer, httpx.Client], url: str
) -> None:
    """``host:port`` and ``""`` are what LMCache MP servers send."""
    _, c = auth_pair
    body = {"instance_id": "node-a", "p2p_advertised_url": url}
    r = c.post("/instances", json=body, headers=bearer(NODE_A))
    assert r.status_code == 200, r.text


def test_registration_field_limits(auth_pair: tuple[BackgroundServer, httpx.Client]) -> None:
    _, c = auth_pair
    h = bearer(NODE_A)
    r = c.post(
        "/instances", json={"instance_id": "node-a", "metadata": {"x": "y" * 20_000}}, headers=h
    )
    assert "metadata" in assert_error(r, 413)["detail"]
    r = c.post("/instances", json={"instance_id": "node-a", "ip": "1" * 300}, headers=h)
    assert "ip" in assert_error(r, 422)["detail"]
    huge = {"instance_id": "node-a", "metadata": {"x": "y" * 100_000}}  # past the route's limit
    assert_error(c.post("/instances", json=huge, headers=h), 413)


@pytest.mark.parametrize(
    "field",
    [
        {"http_port": -1},
        {"http_port": 70_000},
        {"http_port": 2**64},
        {"mq_port": -1},  # (LMCache's message-queue port: a port all the same)
        {"mq_port": 70_000},
        {"ip": "127.0.0.1:9"},  # a port inside the ip: the MP server's URL would be invalid
        {"ip": "a b/c?d#e"},
        {"ip": "[::1]"},
        {"ip": "10.0.0.1/24"},
    ],
)
def test_an_address_that_makes_no_url_is_refused_at_registration(
    auth_pair: tuple[BackgroundServer, httpx.Client], field: dict[str, object]
) -> None:
    """The coordinator calls a registered instance at ``http://ip:http_port`` (cache-control
    commands); an ``ip`` with a port or a path, or a port outside [0, 65535], was accepted, and
    every command to that instance then answered 500 (``httpx.InvalidURL``, an
    ``OverflowError`` in ``getaddrinfo``) or 502 naming ``http://127.0.0.1:-1/``."""
    _, c = auth_pair
    (name,) = field
    r = c.post("/instances", json={"instance_id": "node-a", **field}, headers=bearer(NODE_A))
    assert name in assert_error(r, 422)["detail"]


@pytest.mark.parametrize(
    "field",
    [{"ip": "10.0.0.8", "http_port": 8080}, {"ip": "::1"}, {"ip": "node-a.example"},
     {"ip": "", "http_port": 0}, {"http_port": 65535}],
)  # fmt: skip
def test_addresses_an_mp_server_sends_are_accepted(
    auth_pair: tuple[BackgroundServer, httpx.Client], field: dict[str, object]
) -> None:
    _, c = auth_pair
    r = c.post("/instances", json={"instance_id": "node-a", **field}, headers=bearer(NODE_A))
    assert r.status_code == 200, r.text


def test_only_registered_instances_emit_with_auth(
    auth_pair: tuple[BackgroundServer, httpx.Client],
) -> None:
    """An unbound emit token cannot mint emitters (cursors, series) by naming fresh ids."""
    _, c = auth_pair
    h = bearer(EMIT_ANY)
    inst = fresh("unregistered")
    r = c.post("/events", json={"batches": [wire_batch(inst, 1, 1)]}, headers=h)
    assert "not registered" in assert_error(r, 403)["detail"]
    rows = c.get("/instances", headers=bearer(ADMIN)).json()["instances"]
    assert inst not in {row["instance_id"] for row in rows}
    assert c.post("/instances", json={"instance_id": inst}, headers=h).status_code == 200
    r = c.post("/events", json={"batches": [wire_batch(inst, 1, 1)]}, headers=h)
    assert r.status_code == 200 and r.json()["applied"] == 1, r.text


def _refusals(c: httpx.Client) -> tuple[float, float]:
    """Bodies refused for salts, and their entries under those salts, as ``/metrics`` says."""
    text = c.get("/metrics", headers=bearer(ADMIN)).text

    def value(series: str) -> float:
        found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
        return float(found[1]) if found else 0.0

    return (
        value('kvatlas_event_rejected_bodies_total{reason="cache_salt"}'),
        value('kvatlas_event_refused_entries_total{reason="cache_salt",transport="http"}'),
    )


def _series(metrics: str) -> set[str]:
    return set(re.findall(r'kvatlas_event_batches_total\{instance_id="([^"]+)"', metrics))


def test_emitter_flood_is_capped() -> None:
    """The attack shape of issue 16 (three requests of 50,000 empty batches from fresh
    instance ids → 150,000 cursors and series) at a small scale: nothing grows past
    --max-instances, and a refused request applies nothing."""
    cap = 20
    with running(max_instances=cap) as (_, c):
        for round_ in range(3):
            flood = [wire_batch(f"flood-{round_}-{i}", 1, 1) for i in range(200)]
            r = c.post("/events", json={"batches": flood})
            assert "max-instances" in assert_error(r, 409)["detail"]
        assert c.get("/directory/stats").json()["emitters"] == 0  # nothing applied
        refused = 0
        for i in range(3 * cap):
            r = c.post("/events", json={"batches": [wire_batch(f"one-{i}", 1, 1)]})
            refused += r.status_code == 409
            assert r.status_code in (200, 409), r.text
        assert refused == 2 * cap
        assert c.get("/directory/stats").json()["emitters"] == cap
        assert len(c.get("/instances").json()["instances"]) == cap
        assert len(_series(c.get("/metrics").text)) == cap
        r = c.post("/events", json={"batches": [wire_batch("one-0", 1, 2)]})  # known: passes
        assert r.status_code == 200, r.text
        for i in range(cap):
            assert c.post("/instances", json={"instance_id": f"reg-{i}"}).status_code == 200
        r = c.post("/instances", json={"instance_id": "reg-over"})
        assert "max-instances" in assert_error(r, 409)["detail"]
        assert c.post("/instances", json={"instance_id": "reg-0"}).status_code == 200  # again
        assert c.delete("/instances/reg-0").status_code == 204
        assert c.post("/instances", json={"instance_id": "reg-over"}).status_code == 200


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_departed_emitters_are_forgotten() -> None:
    """An unregistered emitter that went quiet, and a deregistered instance, lose their
    cursor and metric series after --emitter-retention-s; a registered one keeps them."""
    clock = Clock()
    with running(clock, emitter_retention_s=60.0, instance_timeout=1e6) as (server, c):
        for inst in ("quiet", "leaver", "stayer"):
            if inst != "quiet":
                assert c.post("/instances", json={"instance_id": inst}).status_code == 200
            r = c.post("/events", json={"batches": [wire_batch(inst, 1, 1)]})
            assert r.status_code == 200, r.text
        assert c.delete("/instances/leaver").status_code == 204
        assert _series(c.get("/metrics").text) == {"quiet", "leaver", "stayer"}
        clock.now += 30
        assert server.service.forget_departed() == []
        clock.now += 31  # the sweeper thread or this call forgets them, whichever runs first

        def forgotten() -> bool:
            server.service.forget_departed()
            return _series(c.get("/metrics").text) == {"stayer"}

        assert wait_for(forgotten)
        rows = {r["instance_id"]: r for r in c.get("/instances").json()["instances"]}
        assert set(rows) == {"stayer"} and rows["stayer"]["last_seq"] == 1
        assert c.get("/directory/stats").json()["emitters"] == 1


class _RedisDown:
    def seen(self, _within: float) -> list[str]:
        raise Unavailable("redis: connection refused")

    def close(self) -> None:
        pass


def test_a_redis_outage_warns_of_departed_emitters_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While Redis cannot say which instances other replicas hold, nothing is forgotten and
    the sweep is asked again every 5 s: the WARNING says so once a minute, not every sweep."""
    clock = Clock()
    with running(clock, emitter_retention_s=60.0, instance_timeout=1e6) as (server, _):
        server.service.liveness = _RedisDown()  # type: ignore[assignment]
        with caplog.at_level(logging.WARNING, logger="kvatlas.coordinator.service"):
            for _ in range(24):  # two minutes of sweeps
                assert server.service.forget_departed() == []
                clock.now += 5.0
        said = [r for r in caplog.records if "not forgotten" in r.getMessage()]
        assert len(said) == 2, [r.getMessage() for r in said]


def test_salt_bound_emit_token_without_lookup_stays_bound(tmp_path: Path) -> None:
    """Binding is per token, not per role: an emit-only token bound to salt A is refused B."""
    only = token("emit-only-a")
    path = write_tokens(
        tmp_path / "t.json",
        {"token": only, "role": "emit", "instance_ids": ["e1"], "cache_salts": [SALT_A]},
    )
    with running(auth_token_file=path) as (_, c):
        assert (
            c.post("/instances", json={"instance_id": "e1"}, headers=bearer(only)).status_code
            == 200
        )
        batch = Emitter("e1").store_chunks(fresh_tokens(1), salt=SALT_B)
        assert_error(c.post("/events", json={"batches": [batch]}, headers=bearer(only)), 403)
