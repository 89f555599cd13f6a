"""Issue 16 items 4 and 11, coordinator side: every route's roles are checked from the
headers (the table is complete); a salt-bound token sees only its tenants' instances, without
their metadata, and no global statistics; /metrics and the docs need a token unless made
public. Over real loopback HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.asgi import DOCS_PATHS, METRICS_PATH, ROUTE_TABLE
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.routes import ROUTERS
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.coordinator.service import CoordinatorService
from tests.coordinator.helpers import assert_error, running, wire_batch
from tests.coordinator.security_support import ADMIN, LOOKUP_ALL, bearer, token, write_tokens

NODE_A, NODE_A2, NODE_B = token("node-a"), token("node-a2"), token("node-b")
LOOKUP_A = token("lookup-a")
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
        _node(NODE_A, "node-a", "a"),
        _node(NODE_A2, "node-a2", "a"),
        _node(NODE_B, "node-b", "b"),
    )


@pytest.fixture(scope="module")
def pair(tokens: Path) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    with running(auth_token_file=tokens) as pair:
        c = pair[1]
        for tok, inst in ((NODE_A, "node-a"), (NODE_A2, "node-a2"), (NODE_B, "node-b")):
            body = {
                "instance_id": inst,
                "ip": f"10.0.0.{len(inst)}",
                "metadata": {"secret": f"{inst}-internal"},
                "p2p_advertised_url": f"http://{inst}.internal:9400",
            }
            assert c.post("/instances", json=body, headers=bearer(tok)).status_code == 200
            r = c.post("/events", json={"batches": [wire_batch(inst, 1, 1)]}, headers=bearer(tok))
            assert r.status_code == 200, r.text
        yield pair


def test_every_route_is_in_the_access_table() -> None:
    """A new route must say who may call it (checked before its body is read) and how much
    body it takes: every route of every router is in the table, and the table lists no route
    that is not served."""
    create_app(CoordinatorService(CoordinatorConfig()))  # mounts ROUTERS
    served = {
        (method, route.path)
        for router in ROUTERS
        for route in router.routes
        if isinstance(route, APIRoute) and route.path not in DOCS_PATHS | {METRICS_PATH}
        for method in route.methods
    }
    assert len(served) > 15
    assert served == set(ROUTE_TABLE), served ^ set(ROUTE_TABLE)


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
    assert rows["node-a"]["metadata"] == {"secret": "node-a-internal"}  # its own, in full
    assert rows["node-a"]["last_seq"] == 1
    peer = rows["node-a2"]
    assert peer["p2p_advertised_url"] == "http://node-a2.internal:9400"  # what a fetch needs
    assert peer["alive"] is True
    assert peer["metadata"] == {} and peer["ip"] == "" and peer["last_seq"] is None
    assert set(_rows(c, LOOKUP_A)) == {"node-a", "node-a2"}
    assert all(row["metadata"] == {} for row in _rows(c, LOOKUP_A).values())
    everything = _rows(c, ADMIN)
    assert {"node-a", "node-a2", "node-b"} <= set(everything)
    assert everything["node-b"]["metadata"] == {"secret": "node-b-internal"}
