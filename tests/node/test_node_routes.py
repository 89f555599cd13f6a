"""The node's route table, checked as the coordinator's is (tests/coordinator/
test_security_exposure.py): the app serves its table and nothing else; every entry's access is
checked from the headers before the body is read, on its own listener only (404 on the other,
whoever asks); refusals come in the call's own format (msgpack or JSON); a path no route serves
is refused as the routes under its prefix would be. One node with its two listeners
(``--engine-port``), real HTTP on loopback."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx
import msgspec
import pytest

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.auth import DOCS_PATHS
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.http_api import TABLE, create_node_app
from kvatlas.node.peer import PEER_KV_PATH
from kvatlas.node.peer_credentials import PeerSecret
from kvatlas.routing import Route
from tests.helpers import node_config, write_tokens

ENGINE_A, ENGINE_ALL = "a" * 32 + "-engine", "u" * 32 + "-engine-unbound"
PEER, ADMIN, OTHER = "p" * 32 + "-peer", "z" * 32 + "-admin", "o" * 32 + "-no-node-role"
SECRET = PeerSecret("s" * 40)
MSGPACK, JSON = "application/msgpack", "application/json"


class Listeners(NamedTuple):
    peer: httpx.Client
    engine: httpx.Client

    def of(self, name: str) -> httpx.Client:
        return self.engine if name == "engine" else self.peer

    def other(self, name: str) -> httpx.Client:
        return self.peer if name == "engine" else self.engine


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Listeners, Any]]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("routes") / "tokens.json",
        {"token": ENGINE_A, "roles": ["engine"], "cache_salts": ["tenant-a"]},
        {"token": ENGINE_ALL, "roles": ["engine"]},
        {"token": PEER, "roles": ["peer"]},
        {"token": ADMIN, "roles": ["admin"]},
        {"token": OTHER, "roles": ["lookup"]},
    )
    peer_port, engine_port = free_port(), free_port()
    config = node_config(port=peer_port, engine_port=engine_port, auth_token_file=tokens)
    node = CacheNode(config, instance_id="n1")
    app = create_node_app(node, auth=config.auth(), peer_secret=SECRET)
    servers = [ThreadedServer(app, port=p) for p in (peer_port, engine_port)]
    for server in servers:
        server.start()
    try:
        with (
            httpx.Client(base_url=servers[0].url, timeout=30) as peer,
            httpx.Client(base_url=servers[1].url, timeout=30) as engine,
        ):
            yield Listeners(peer, engine), app
    finally:
        for server in servers:
            server.stop()
        node.close()


def bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def detail(r: httpx.Response) -> str:
    """The refusal's ``detail``, decoded as its content type says."""
    if r.headers["content-type"] == MSGPACK:
        body = msgspec.msgpack.decode(r.content)
    else:
        assert r.headers["content-type"] == "application/json", r.headers
        body = r.json()
    assert isinstance(body["detail"], str) and body["detail"], body
    return str(body["detail"])


def test_every_route_is_in_the_table(node: tuple[Listeners, Any]) -> None:
    """The app serves its table and nothing else; every entry (the documentation's included)
    is the route its own method and path find."""
    _, app = node
    assert app.table is TABLE and len(TABLE.routes) > 15
    served = {(r.method, r.path) for r in TABLE.routes}
    assert {("GET", p) for p in DOCS_PATHS | {"/metrics", "/healthz"}} <= served
    for route in TABLE.routes:
        found = TABLE.match(route.method, _concrete(route.path))
        assert found is not None and found[0] is route, (route.method, route.path)


def _concrete(path: str) -> str:
    return path.replace("{request_id}", "r1")


def _id(route: Route) -> str:
    return f"{route.method} {route.path}"


@pytest.mark.parametrize("route", TABLE.routes, ids=_id)
def test_every_route_checks_its_access_from_the_table(
    node: tuple[Listeners, Any], route: Route
) -> None:
    """Each entry's access, over HTTP: on the other listener a 404 even for admin; no token a
    401 unless the route is open; a valid token holding none of its roles a 403; a salt-bound
    engine token a 403 where the reply covers every tenant; every refusal before the body is
    read (the connection is closed). The right token is admitted."""
    listeners, _ = node
    access, path = route.access, _concrete(route.path)
    home = listeners.of(access.listener or "peer")

    def call(client: httpx.Client, token: str | None) -> httpx.Response:
        return client.request(route.method, path, content=b"{}", headers=bearer(token))

    if access.listener is not None:
        wrong = call(listeners.other(access.listener), ADMIN)
        assert wrong.status_code == 404 and "not served on this listener" in detail(wrong)
        assert wrong.headers["connection"] == "close"
    anonymous = call(home, None)
    if access.open:
        assert anonymous.status_code not in (401, 403), anonymous.text
        return
    assert anonymous.status_code == 401 and detail(anonymous)
    assert anonymous.headers["connection"] == "close"
    if access.roles:
        refused = call(home, OTHER)
        assert refused.status_code == 403 and "needs" in detail(refused)
    if access.every_tenant:
        refused = call(home, ENGINE_A)
        assert refused.status_code == 403 and "cache_salts" in detail(refused)
    held = {(): OTHER, ("admin",): ADMIN, ("peer",): PEER, ("engine",): ENGINE_ALL}
    admitted = call(home, held[access.roles])
    assert admitted.status_code not in (401, 403, 405), admitted.content[:300]
    assert admitted.content != b'{"detail":"Not Found"}'  # served (a handler's 404 is fine)


def test_the_peer_credential_opens_the_peer_route_only(node: tuple[Listeners, Any]) -> None:
    listeners, _ = node
    credential = bearer(SECRET.credential("n1"))
    r = listeners.peer.post(PEER_KV_PATH, json={"keys": []}, headers=credential)
    assert r.status_code == 200 and msgspec.msgpack.decode(r.content) == []
    other_node = bearer(SECRET.credential("n2"))
    assert (
        listeners.peer.post(PEER_KV_PATH, json={"keys": []}, headers=other_node).status_code == 401
    )
    for client, method, path in ((listeners.engine, "POST", "/engine/lookup"),
                                 (listeners.peer, "POST", "/cache/clear"),
                                 (listeners.peer, "GET", "/metrics")):  # fmt: skip
        assert client.request(method, path, headers=credential).status_code == 401, path


def test_refusals_come_in_the_calls_format(node: tuple[Listeners, Any]) -> None:
    """The engine API refuses in msgpack when the call speaks it (its body or the reply it
    accepts), else JSON; its figures in msgpack unless JSON is accepted; the peer route and
    cache control always JSON."""
    engine, peer = node[0].engine, node[0].peer
    cases: list[tuple[httpx.Client, str, str, dict[str, str], str]] = [
        (engine, "POST", "/engine/lookup", {"content-type": MSGPACK}, MSGPACK),
        (engine, "POST", "/engine/lookup", {"accept": MSGPACK}, MSGPACK),
        (engine, "POST", "/engine/lookup", {"content-type": JSON}, JSON),
        (engine, "POST", "/engine/nowhere", {"content-type": MSGPACK}, MSGPACK),
        (engine, "GET", "/engine/stats", {}, MSGPACK),
        (engine, "GET", "/engine/stats", {"accept": JSON}, JSON),
        (peer, "POST", PEER_KV_PATH, {"accept": MSGPACK}, JSON),
        (peer, "POST", "/cache/clear", {"accept": MSGPACK}, JSON),
    ]  # fmt: skip
    for client, method, path, headers, media in cases:
        r = client.request(method, path, content=b"x", headers=headers)
        assert (r.status_code, r.headers["content-type"]) == (401, media), (path, headers)
        assert detail(r)
    r = engine.post(
        "/engine/lookup", content=b"\xc1", headers={**bearer(ENGINE_ALL), "content-type": MSGPACK}
    )
    assert (r.status_code, r.headers["content-type"]) == (422, MSGPACK) and detail(r)


def test_an_unserved_path_is_refused_as_its_prefix_is(node: tuple[Listeners, Any]) -> None:
    """Under ``/engine/``: the engine listener and an engine token before a 404; under
    ``/cache/``: admin; elsewhere anyone learns it is not served (as before the table)."""
    listeners, _ = node
    r = listeners.peer.get("/engine/nowhere", headers=bearer(ENGINE_ALL))
    assert r.status_code == 404 and "not served on this listener" in detail(r)
    assert listeners.engine.get("/engine/nowhere").status_code == 401
    r = listeners.engine.get("/engine/nowhere", headers=bearer(ENGINE_ALL))
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    assert listeners.peer.get("/cache/nowhere", headers=bearer(ENGINE_ALL)).status_code == 403
    assert listeners.peer.get("/nowhere").json() == {"detail": "Not Found"}
    r = listeners.engine.get("/engine/lookup", headers=bearer(ENGINE_ALL))
    assert (r.status_code, r.headers["allow"]) == (405, "POST")


def test_one_listener_serves_every_route() -> None:
    """Without ``--engine-port`` the node's one listener serves both APIs (no listener check)."""
    config = dataclasses.replace(node_config(), port=free_port())
    node = CacheNode(config, instance_id="n1")
    server = ThreadedServer(create_node_app(node), port=config.port)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post(PEER_KV_PATH, json={"keys": []}).status_code == 200
            assert c.post("/engine/lookup", json={"tokens": ""}).status_code == 200
    finally:
        server.stop()
        node.close()
