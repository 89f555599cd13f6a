"""The route table and its one request stack (``kvatlas.routing``, ``kvatlas.dispatch``,
``kvatlas.openapi``) on a dummy table shaped like the cache-control routes to come
(shared/spec/cache-control.md): multi-parameter paths, a literal path beside a template, a
route per method on one path. Each route is one entry and one handler; its access, body limit,
path parameters, request decoding and documentation follow from the entry. A second table
has a route named for one of several listeners, a reply format per call and an area of
unserved paths (what the node's table uses). Real HTTP on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.auth import Principal, TokenAuth
from kvatlas.dispatch import Dispatcher
from kvatlas.openapi import document
from kvatlas.routing import MSGPACK, NOBODY, OPEN, Access, Area, Call, Reply, Route, RouteTable

OPERATOR = "operator-token-" + "o" * 32
ENGINE = "engine-token-" + "e" * 32


class QuotaBody(msgspec.Struct):
    max_bytes: int


class QuotaReply(msgspec.Struct):
    cache_salt: str
    max_bytes: int


async def prefetch(_ctx: object, call: Call[None, None]) -> dict[str, Any]:
    return {"route": "prefetch", **call.params}


async def move(_ctx: object, call: Call[None, None]) -> dict[str, Any]:
    return {"route": "move", **call.params}


async def active_moves(_ctx: object, call: Call[None, None]) -> dict[str, Any]:
    return {"route": "active"}


async def set_quota(_ctx: object, call: Call[QuotaBody, None]) -> QuotaReply:
    return QuotaReply(cache_salt=call.params["cache_salt"], max_bytes=call.body.max_bytes)


async def cancel(_ctx: object, call: Call[None, None]) -> Reply:
    return Reply(status=204, media_type=None)


ADMIN = Access(("admin",))
ROUTES = (
    Route("GET", "/cache/prefetches/{instance_id}/{request_id}", Access(("engine",)), prefetch),
    Route("DELETE", "/cache/prefetches/{instance_id}/{request_id}", ADMIN, cancel, status=204),
    Route("GET", "/cache/moves/active", OPEN, active_moves),
    Route("GET", "/cache/moves/{move_id}", OPEN, move, "One move"),
    Route(
        "PUT", "/quota/{cache_salt}", ADMIN, set_quota, "Set a quota", request=QuotaBody,
        reply=QuotaReply, body=lambda limits: limits["quota"],
    ),
)  # fmt: skip
TABLE = RouteTable(ROUTES)


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    auth = TokenAuth.from_tokens(
        [
            (OPERATOR, Principal("operator", frozenset({"admin"}))),
            (ENGINE, Principal("engine", frozenset({"engine"}))),
        ]
    )
    limits = {"quota": 64, "small": 16}
    app = Dispatcher(
        None,
        TABLE,
        auth,
        frozenset(),
        lambda route: limits["small"] if route.body is None else route.body(limits),
        limits["small"],
    )
    server = ThreadedServer(app, port=free_port())
    server.start()
    with httpx.Client(base_url=server.url) as c:
        yield c
    server.stop()


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_multi_parameter_paths_hand_each_parameter_to_the_handler(client: httpx.Client) -> None:
    r = client.get("/cache/prefetches/node-a/req-7", headers=_as(ENGINE))
    assert r.json() == {"route": "prefetch", "instance_id": "node-a", "request_id": "req-7"}
    assert client.delete("/cache/prefetches/node-a/req-7", headers=_as(OPERATOR)).status_code == 204


def test_a_literal_path_wins_over_a_template(client: httpx.Client) -> None:
    assert client.get("/cache/moves/active").json() == {"route": "active"}
    assert client.get("/cache/moves/m-1").json() == {"route": "move", "move_id": "m-1"}


def test_a_parameter_is_one_non_empty_segment(client: httpx.Client) -> None:
    for path in ("/cache/prefetches/node-a", "/cache/prefetches/node-a/r/x", "/cache/moves/a/b"):
        assert client.get(path, headers=_as(OPERATOR)).json() == {"detail": "Not Found"}, path
    r = client.get("/cache/prefetches//req-7", headers=_as(OPERATOR))
    assert r.status_code == 404


def test_access_comes_from_the_entry(client: httpx.Client) -> None:
    path = "/cache/prefetches/node-a/req-7"
    assert client.get(path).status_code == 401
    assert client.delete(path, headers=_as(ENGINE)).status_code == 403  # admin only
    assert client.put("/quota/t", json={"max_bytes": 1}, headers=_as(ENGINE)).status_code == 403


def test_request_decoding_and_body_limit_come_from_the_entry(client: httpx.Client) -> None:
    r = client.put("/quota/tenant-a", json={"max_bytes": 5}, headers=_as(OPERATOR))
    assert r.json() == {"cache_salt": "tenant-a", "max_bytes": 5}
    r = client.put("/quota/tenant-a", json={"max_bytes": "x"}, headers=_as(OPERATOR))
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "max_bytes"]
    big = {"max_bytes": 5, "pad": "x" * 64}
    assert client.put("/quota/tenant-a", json=big, headers=_as(OPERATOR)).status_code == 413


def test_a_method_the_path_does_not_serve_is_405(client: httpx.Client) -> None:
    r = client.post("/quota/t", headers=_as(OPERATOR))
    assert (r.status_code, r.headers["allow"]) == (405, "PUT")


def test_the_document_lists_every_parameter_and_type() -> None:
    doc = document("t", "1", "d", ROUTES)
    get = doc["paths"]["/cache/prefetches/{instance_id}/{request_id}"]["get"]
    assert [p["name"] for p in get["parameters"]] == ["instance_id", "request_id"]
    put = doc["paths"]["/quota/{cache_salt}"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/QuotaBody"
    }
    assert put["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/QuotaReply"
    }
    assert {"QuotaBody", "QuotaReply"} <= set(doc["components"]["schemas"])


def test_a_table_refuses_a_route_twice_and_a_partial_parameter() -> None:
    with pytest.raises(ValueError, match="twice"):
        RouteTable([ROUTES[0], ROUTES[0]])
    with pytest.raises(ValueError, match="whole segment"):
        RouteTable([Route("GET", "/x/id-{n}", OPEN, move)])


def test_a_path_no_route_serves_needs_a_token_and_a_small_body(client: httpx.Client) -> None:
    assert client.get("/nowhere").status_code == 401
    assert client.get("/nowhere", headers=_as(ENGINE)).json() == {"detail": "Not Found"}
    r = client.post("/nowhere", content=b"x" * 17, headers=_as(ENGINE))  # the small limit: 16
    assert r.status_code == 413


# ---------------------------------------------------------------------------- several listeners

ZONED = RouteTable(
    [
        Route("GET", "/zone/here", Access(("engine",), listener="a"), active_moves,
              codec=lambda scope: MSGPACK),
        Route("GET", "/anywhere", OPEN, active_moves),
    ],
    [Area("/zone/", Access(("engine",), listener="a"), lambda scope: MSGPACK)],
    unrouted=OPEN,
)  # fmt: skip


@pytest.fixture(scope="module")
def zoned() -> Iterator[httpx.Client]:
    """:data:`ZONED` behind auth; the listener is named by the ``x-listener`` header."""
    auth = TokenAuth.from_tokens([(ENGINE, Principal("engine", frozenset({"engine"})))])

    def listener_of(scope: Any) -> str:
        return dict(scope["headers"]).get(b"x-listener", b"a").decode()

    app = Dispatcher(None, ZONED, auth, frozenset(), lambda _r: 16, 16, listener_of=listener_of)
    server = ThreadedServer(app, port=free_port())
    server.start()
    with httpx.Client(base_url=server.url) as c:
        yield c
    server.stop()


def test_a_route_named_for_a_listener_is_not_served_on_another(zoned: httpx.Client) -> None:
    r = zoned.get("/zone/here", headers={**_as(ENGINE), "x-listener": "b"})
    assert r.status_code == 404 and r.headers["connection"] == "close"
    assert "not served on this listener" in msgspec.msgpack.decode(r.content)["detail"]
    r = zoned.get("/zone/here", headers=_as(ENGINE))
    assert (r.status_code, msgspec.msgpack.decode(r.content)) == (200, {"route": "active"})
    assert zoned.get("/anywhere", headers={"x-listener": "b"}).status_code == 200


def test_replies_and_refusals_come_in_the_routes_codec(zoned: httpx.Client) -> None:
    r = zoned.get("/zone/here")
    assert (r.status_code, r.headers["content-type"]) == (401, MSGPACK.media_type)
    assert msgspec.msgpack.decode(r.content)["detail"]


def test_an_unserved_path_is_refused_as_its_area(zoned: httpx.Client) -> None:
    r = zoned.get("/zone/elsewhere")
    assert (r.status_code, r.headers["content-type"]) == (401, MSGPACK.media_type)
    assert zoned.get("/zone/elsewhere", headers={"x-listener": "b"}).status_code == 404
    assert zoned.get("/zone/elsewhere", headers=_as(ENGINE)).json() == {"detail": "Not Found"}
    assert zoned.get("/elsewhere").json() == {"detail": "Not Found"}  # unrouted: open


def test_the_caller_of_an_open_route_sees_no_tenant() -> None:
    """No token was asked for: the anonymous caller holds no role and no tenant's salt, so a
    handler that asks ``sees_everything`` or filters by its salts shows it nothing (it saw
    every tenant: ``cache_salts`` unset reads as "any")."""
    assert not NOBODY.sees_everything
    assert NOBODY.foreign_salts(["", "tenant-a"]) == {"", "tenant-a"}
