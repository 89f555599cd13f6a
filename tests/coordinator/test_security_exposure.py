"""Issue 16 items 4 and 11, coordinator side: every route's roles are checked from the
headers (the table is complete); a salt-bound token sees only its tenants' instances, without
their metadata, and no global statistics; /metrics and the docs need a token unless made
public. Over real loopback HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvatlas.auth import DOCS_PATHS
from kvatlas.coordinator.app import TABLE, create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.routing import Route
from tests.coordinator.helpers import assert_error, running, wire_batch
from tests.coordinator.security_support import ADMIN, LOOKUP_ALL, bearer, token, write_tokens

NODE_A, NODE_A2, NODE_B = token("node-a"), token("node-a2"), token("node-b")
LOOKUP_A = token("lookup-a")
ROUTER = token("router")  # a valid token holding none of the coordinator's roles
CACHE_A, CACHE_ALL = token("cache-a"), token("cache-all")  # cache control: bound to a / not
METRICS_PATH = "/metrics"
CLOSED = (METRICS_PATH, "/docs", "/openapi.json")


def _node(tok: str, inst: str, salt: str) -> dict[str, object]:
    return {
        "token": tok,
        "roles": ["emit", "lookup"],
        "instance_ids": [inst],
        "cache_salts": [salt],
    }


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokens(
        tmp_path_factory.mktemp("exposure") / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": LOOKUP_ALL, "role": "lookup"},
        {"token": LOOKUP_A, "role": "lookup", "cache_salts": ["a"]},
        {"token": ROUTER, "role": "route"},
        {"token": CACHE_A, "role": "cache", "cache_salts": ["a"]},
        {"token": CACHE_ALL, "role": "cache"},
        _node(NODE_A, "node-a", "a"),
        _node(NODE_A2, "node-a2", "a"),
        _node(NODE_B, "node-b", "b"),
    )


LAYOUT = {"kv_shape": [2, 2, 16, 2, 16], "kv_dtype": "float16"}  # (node metadata: PEER_METADATA)


@pytest.fixture(scope="module")
def pair(tokens: Path) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    with running(auth_token_file=tokens) as pair:
        c = pair[1]
        for tok, inst in ((NODE_A, "node-a"), (NODE_A2, "node-a2"), (NODE_B, "node-b")):
            body = {
                "instance_id": inst,
                "ip": f"10.0.0.{len(inst)}",
                "metadata": {"secret": f"{inst}-internal", **LAYOUT},
                "p2p_advertised_url": f"http://{inst}.internal:9400",
            }
            assert c.post("/instances", json=body, headers=bearer(tok)).status_code == 200
            r = c.post("/events", json={"batches": [wire_batch(inst, 1, 1)]}, headers=bearer(tok))
            assert r.status_code == 200, r.text
        yield pair


def test_every_route_is_in_the_access_table() -> None:
    """A new route must say who may call it (checked before its body is read) and how much
    body it takes: the app serves its table and nothing else, and every entry of the table
    (the documentation's included) is the route its own method and path find."""
    app = create_app(CoordinatorService(CoordinatorConfig()))
    assert app.table is TABLE
    assert len(TABLE.routes) > 15
    served = {(r.method, r.path) for r in TABLE.routes}
    assert {("GET", path) for path in DOCS_PATHS | {METRICS_PATH}} <= served
    for route in TABLE.routes:
        found = TABLE.match(route.method, _concrete(route.path))
        assert found is not None and found[0] is route, (route.method, route.path)


def _concrete(path: str) -> str:
    return path.replace("{instance_id}", "node-a")


def _id(route: Route) -> str:
    return f"{route.method} {route.path}"


@pytest.fixture(scope="module")
def fresh(tokens: Path) -> Iterator[httpx.Client]:
    """A coordinator of its own (the requests below deregister and register)."""
    with running(auth_token_file=tokens) as (_, c):
        yield c


@pytest.mark.parametrize("route", TABLE.routes, ids=_id)
def test_every_route_checks_its_access_from_the_table(fresh: httpx.Client, route: Route) -> None:
    """Each entry's access, over HTTP: no token is 401 unless the route is open; a valid token
    holding none of its roles is 403; a salt-bound token is 403 where the reply covers every
    tenant. Every refusal comes before the body is read (it closes the connection)."""
    c = fresh
    path = _concrete(route.path)
    access = route.access

    def call(tok: str | None) -> httpx.Response:
        headers = bearer(tok) if tok else {}
        return c.request(route.method, path, content=b"{}", headers=headers)

    anonymous = call(None)
    if access.open:
        assert anonymous.status_code != 401, anonymous.text
        return
    assert_error(anonymous, 401)
    assert anonymous.headers["connection"] == "close"
    if access.roles:
        refused = call(ROUTER)
        assert "needs" in assert_error(refused, 403)["detail"]
        assert refused.headers["connection"] == "close"
    cache = access.roles == ("cache",)  # cache control: a cache token, bound or not
    if access.every_tenant:
        bound = CACHE_A if cache else LOOKUP_A
        assert "cache_salts" in assert_error(call(bound), 403)["detail"]
    held = ADMIN if access.roles == ("admin",) else NODE_A  # emit + lookup, bound to node-a
    held = CACHE_A if cache else held
    unbound = CACHE_ALL if cache else LOOKUP_ALL
    admitted = call(unbound if access.every_tenant else held)
    assert admitted.status_code not in (401, 405), admitted.text
    assert admitted.content != b'{"detail":"Not Found"}'  # served (a handler's 404 is fine)
    if admitted.status_code == 403:  # a binding the body names (an instance), not the route's
        assert "needs" not in admitted.json()["detail"]


def test_metrics_and_docs_need_a_token_with_auth(
    pair: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, c = pair
    for path in CLOSED:
        assert_error(c.get(path), 401)
        assert c.get(path, headers=bearer(ADMIN)).status_code == 200, path
    assert c.get("/metrics", headers=bearer(LOOKUP_ALL)).status_code == 200
    assert_error(c.get("/metrics", headers=bearer(LOOKUP_A)), 403)  # every tenant's series
    assert c.get("/openapi.json", headers=bearer(LOOKUP_A)).status_code == 200
    assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200


def test_public_flags_open_metrics_and_docs(tokens: Path) -> None:
    with running(auth_token_file=tokens, public_metrics=True, public_docs=True) as (_, c):
        for path in CLOSED:
            assert c.get(path).status_code == 200, path
    with running() as (_, c):  # auth off: public by default
        for path in CLOSED:
            assert c.get(path).status_code == 200, path


def test_public_metrics_name_no_tenant_salt(tokens: Path) -> None:
    """``--public-metrics`` opens ``/metrics`` to anyone: the series that name a cache salt
    (quotas, usage, evictions: a tenant, which nobody may learn about unless it owns it) are
    left out of it, as ``GET /quota`` refuses them; a scrape with a token that sees every
    tenant still gets them (the old coordinator published every salt with a quota)."""
    secret = "tenant-b-secret"
    with running(auth_token_file=tokens, public_metrics=True) as (_, c):
        put = c.put(f"/quota/{secret}", json={"limit_gb": 1}, headers=bearer(CACHE_ALL))
        assert put.status_code == 200, put.text
        assert_error(c.get("/quota"), 401)
        public = c.get("/metrics")
        assert public.status_code == 200
        assert secret not in public.text and "kvatlas_directory_keys" in public.text
        for tok in (ADMIN, LOOKUP_ALL):
            assert secret in c.get("/metrics", headers=bearer(tok)).text
        for tok in (LOOKUP_A, "x" * 40):  # a token that may not see every tenant, or none
            assert secret not in c.get("/metrics", headers=bearer(tok)).text
        two = [("Authorization", f"Bearer {ADMIN}"), ("Authorization", f"Bearer {LOOKUP_A}")]
        assert secret not in c.get("/metrics", headers=two).text  # which one was meant?


def test_salt_bound_token_gets_no_global_stats(pair: tuple[BackgroundServer, httpx.Client]) -> None:
    """Per-salt figures are not kept, and global ones are every tenant's: 403."""
    _, c = pair
    for tok in (LOOKUP_A, NODE_A):
        assert (
            "cache_salts"
            in assert_error(c.get("/directory/stats", headers=bearer(tok)), 403)["detail"]
        )
    assert c.get("/directory/stats", headers=bearer(LOOKUP_ALL)).status_code == 200


def _rows(c: httpx.Client, tok: str) -> dict[str, dict[str, object]]:
    r = c.get("/instances", headers=bearer(tok))
    assert r.status_code == 200, r.text
    return {row["instance_id"]: row for row in r.json()["instances"]}


def test_instances_scoped_to_the_tokens_tenants(
    pair: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, c = pair
    rows = _rows(c, NODE_A)
    assert set(rows) == {"node-a", "node-a2"}  # node-b serves another tenant
    assert rows["node-a"]["metadata"] == {"secret": "node-a-internal", **LAYOUT}  # its own, in full
    assert rows["node-a"]["last_seq"] == 1
    peer = rows["node-a2"]
    assert peer["p2p_advertised_url"] == "http://node-a2.internal:9400"  # what a fetch needs
    assert peer["alive"] is True
    # of the metadata, only the KV layout (a peer of another layout is never asked)
    assert peer["metadata"] == LAYOUT and peer["ip"] == "" and peer["last_seq"] is None
    assert set(_rows(c, LOOKUP_A)) == {"node-a", "node-a2"}
    assert all(row["metadata"] == LAYOUT for row in _rows(c, LOOKUP_A).values())
    everything = _rows(c, ADMIN)
    assert {"node-a", "node-a2", "node-b"} <= set(everything)
    assert everything["node-b"]["metadata"] == {"secret": "node-b-internal", **LAYOUT}
