"""The coordinator's cache-control routes over real HTTP (``docs/cache-control.md``,
``docs/security.md``): who may (``admin``, or a ``cache`` token bound to the salts it acts on:
403 otherwise, nothing recorded), bad input a clear 4xx that changes nothing, and what
``/metrics`` shows. The MP servers themselves: ``test_cache_control_delivery.py``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvatlas.coordinator.server import BackgroundServer
from tests.coordinator.helpers import (
    assert_error,
    cache_control_state,
    post_batches,
    running,
    wire_batch,
    wire_entry,
    wire_key,
)
from tests.coordinator.security_support import bearer, token
from tests.helpers import write_tokens

ADMIN, TENANT_A, ANY_CACHE, NODE, NODE_B = (
    token(n) for n in ("admin", "cache-a", "cache-any", "node", "node-b")
)
TOKENS = list(range(100, 148))  # three chunks of 16


def fields(salt: str = "tenant-a", **more: Any) -> dict[str, Any]:
    return {"model_name": "m", "world_size": 1, "token_ids": TOKENS, "cache_salt": salt, **more}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    path = write_tokens(
        tmp_path_factory.mktemp("cc") / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": TENANT_A, "roles": ["cache"], "cache_salts": ["tenant-a"]},
        {"token": ANY_CACHE, "roles": ["cache"]},
        {"token": NODE, "roles": ["emit", "lookup"], "instance_ids": ["n1", "n2"],
         "cache_salts": ["tenant-a"]},
        {"token": NODE_B, "roles": ["emit", "lookup"], "instance_ids": ["n3"],
         "cache_salts": ["tenant-b"]},
    )  # fmt: skip
    with running(chunk_size=16, auth_token_file=path) as (server, client):
        for inst, node in (("n1", NODE), ("n2", NODE), ("n3", NODE_B)):
            r = client.post(  # MP servers at a port where nothing listens
                "/instances", json={"instance_id": inst, "ip": "127.0.0.1", "http_port": 9},
                headers=bearer(node),
            )  # fmt: skip
            assert r.status_code == 200, r.text
        yield server, client


def test_a_salt_bound_token_acts_on_its_salts_only_and_nothing_else_is_applied(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    server, c = served
    a = bearer(TENANT_A)
    r = c.post("/cache/pins", json=fields(), headers=a)
    assert (r.status_code, r.json()["affected"]) == (200, 3), r.text
    assert c.get("/cache/pins", params={"cache_salt": "tenant-a"}, headers=a).json()["total"] == 3
    before = cache_control_state(server)
    foreign = fields("tenant-b")
    refused = [
        c.post("/cache/pins", json=foreign, headers=a),
        c.request("DELETE", "/cache/pins", json=foreign, headers=a),
        c.get("/cache/pins", params={"cache_salt": "tenant-b"}, headers=a),
        c.get("/cache/pins", headers=a),  # every salt's
        c.post("/cache/delete", json={**foreign, "instance_id": "n1", "force": True}, headers=a),
        c.post("/cache/prefetches", json={**foreign, "instance_id": "n1"}, headers=a),
        c.post(
            "/cache/moves",
            json={**foreign, "source_instance_id": "n1", "target_instance_id": "n2"},
            headers=a,
        ),
        c.put("/quota/tenant-b", json={"limit_gb": 0}, headers=a),
        c.get("/quota/tenant-b", headers=a),
        c.delete("/quota/tenant-b", headers=a),
        c.put("/quota/_default", json={"limit_gb": 0}, headers=a),  # the empty salt
        c.put("/quota/config", json={"default_limit_gb": 0}, headers=a),  # every salt's
        c.get("/quota", headers=a),  # every salt's usage
    ]
    for r in refused:
        assert_error(r, 403)
    assert cache_control_state(server) == before  # nothing pinned, recorded or set
    # its own salt: a quota, and a delete recorded (its MP server unreachable: LMCache's 502)
    assert c.put("/quota/tenant-a", json={"limit_gb": 1.5}, headers=a).status_code == 200
    r = c.post("/cache/delete", json={**fields(), "instance_id": "n1", "force": True}, headers=a)
    assert r.status_code == 502 and "n1" in r.json()["detail"]
    assert server.service.cache_control.commands.counts() == {("delete", "pending"): 1}
    # a token not bound to salts, and admin, may act on every salt
    for who in (ANY_CACHE, ADMIN):
        assert c.get("/quota", headers=bearer(who)).status_code == 200
        assert c.get("/cache/pins", headers=bearer(who)).json()["total"] == 3


def test_other_roles_and_no_token_are_refused(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    server, c = served
    before = cache_control_state(server)
    assert_error(c.post("/cache/pins", json=fields()), 401)
    # a node's token (emit, lookup) bound to the salt may not touch the cache of its fleet
    for r in (
        c.post("/cache/pins", json=fields(), headers=bearer(NODE)),
        c.post("/cache/delete", json={**fields(), "instance_id": "n1"}, headers=bearer(NODE)),
        c.get("/quota/tenant-a", headers=bearer(NODE)),
    ):
        assert_error(r, 403)
    assert cache_control_state(server) == before


BAD: list[tuple[str, str, Any, int]] = [
    ("POST", "/cache/delete", {**fields(), "instance_id": "nobody"}, 404),
    ("POST", "/cache/prefetches", {**fields(), "instance_id": "nobody"}, 404),
    ("POST", "/cache/delete", {**fields(), "instance_id": "n1", "tier": "l3"}, 422),
    ("POST", "/cache/delete", {**fields(), "instance_id": "n1", "tokens": [1]}, 422),
    (
        "POST",
        "/cache/delete",
        {**fields(), "instance_id": "n1", "token_ids": list(range(1_000_001))},
        400,
    ),
    ("POST", "/cache/pins", {**fields(), "world_size": 0}, 422),
    ("POST", "/cache/pins", {**fields(), "token_ids": [-1] * 16}, 400),
    ("POST", "/cache/pins", fields("a@b"), 400),
    (
        "POST",
        "/cache/moves",
        {**fields(), "source_instance_id": "n1", "target_instance_id": "n1"},
        400,
    ),
    (
        "POST",
        "/cache/moves",
        {**fields(), "source_instance_id": "n1", "target_instance_id": "nobody"},
        404,
    ),
    (
        "POST",
        "/cache/moves",
        {**fields(), "source_instance_id": "n1", "target_instance_id": "n2", "keep_sorce": True},
        422,
    ),
    ("PUT", "/quota/tenant-a", {"limit_gb": -1}, 422),
    ("PUT", "/quota/tenant-a", {"limit_gb": 1, "tier": "l9"}, 422),
    ("PUT", "/quota/a@b", {"limit_gb": 1}, 400),
    ("PUT", "/quota/config", {"default_limit_gb": -0.5}, 422),
    # an infinite limit (or one whose bytes are): the status page's int() of it was a 500
    ("PUT", "/quota/tenant-a", {"limit_gb": "inf"}, 422),
    ("PUT", "/quota/tenant-a", {"limit_gb": 1e300}, 422),
    ("PUT", "/quota/tenant-a", {"limit_gb": 2.0**33 * 1.0001}, 422),
    ("PUT", "/quota/config", {"default_limit_gb": "inf"}, 422),
    ("PUT", "/quota/config", {"default_limit_gb": 1e300}, 422),
    ("GET", "/cache/pins?limit=0", None, 422),
    ("GET", "/cache/pins?limit=10001", None, 422),
    ("GET", "/cache/pins?offset=-1", None, 422),
    ("GET", "/cache/moves/nope", None, 404),
    ("GET", "/cache/prefetches/nobody/r1", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD)
def test_bad_input_is_a_clear_4xx_that_changes_nothing(
    served: tuple[BackgroundServer, httpx.Client],
    method: str,
    path: str,
    body: Any,
    status: int,
) -> None:
    server, c = served
    before = cache_control_state(server)
    r = c.request(method, path, json=body, headers=bearer(ADMIN))
    assert_error(r, status)
    assert cache_control_state(server) == before


def test_removing_a_quota_that_does_not_exist_is_lmcaches_200_not_found(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """LMCache 0.5.6 answers ``DELETE /quota/{salt}`` of a salt without a quota 200 ``status:
    "not_found"``; its CLI (``lmcache quota delete``) exits 1 on any other status (found
    driving it against kvatlas, which answered 404). Nothing changes."""
    server, c = served
    before = cache_control_state(server)
    r = c.delete("/quota/never-set", headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    assert r.json() == {"cache_salt": "never-set", "limit_gb": 0.0, "status": "not_found"}
    assert cache_control_state(server) == before


def test_metrics_show_commands_by_kind_and_state_and_pins(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    server, c = served
    text = c.get("/metrics", headers=bearer(ADMIN)).text
    counts = server.service.cache_control.commands.counts()
    for kind in ("delete", "evict", "prefetch", "move"):
        for st in ("pending", "sent", "completed", "failed"):
            line = f'kvatlas_cache_commands{{kind="{kind}",state="{st}"}} '
            assert f"{line}{float(counts.get((kind, st), 0))}" in text
    pinned = re.search(r"^kvatlas_pinned_keys (\S+)$", text, re.M)
    assert pinned is not None
    assert float(pinned.group(1)) == len(server.service.cache_control.pins.rows())
    assert re.search(r"^kvatlas_pinned_bytes \S+$", text, re.M)


def test_a_move_is_recorded_and_its_status_kept(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    _, c = served
    body = {**fields(), "source_instance_id": "n1", "target_instance_id": "n2"}
    r = c.post("/cache/moves", json=body, headers=bearer(ADMIN))
    assert r.status_code == 200, r.text
    reply = r.json()
    assert (reply["requested"], reply["status"]) == (3, "pending")
    status = c.get(f"/cache/moves/{reply['move_id']}", headers=bearer(TENANT_A)).json()
    # the delivery loop may have started it meanwhile (its target's port answers nothing,
    # so it stays pending, loading, retried)
    assert status["status"] == "pending" and status["phase"] in ("queued", "loading")
    assert (status["source_instance_id"], status["target_instance_id"]) == ("n1", "n2")


def test_another_salts_command_status_is_answered_as_an_unknown_id(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """A token bound to tenant-a asking for the status of tenant-b's move or prefetch by its
    id learns nothing of it: the answer is an unknown id's (a move: 404; a prefetch: the 403
    of one this coordinator did not record), never naming tenant-b (the 403 said "this token
    may not use cache_salt 'tenant-b'": another tenant's salt echoed to whoever held the id)."""
    _, c = served
    admin, a = bearer(ADMIN), bearer(TENANT_A)
    b = fields("tenant-b")
    move = c.post(  # n3 serves tenant-b
        "/cache/moves", json={**b, "source_instance_id": "n1", "target_instance_id": "n3"},
        headers=admin,
    ).json()["move_id"]  # fmt: skip
    prefetch = c.post("/cache/prefetches", json={**b, "instance_id": "n3"}, headers=admin)
    assert prefetch.status_code == 502, prefetch.text  # recorded (n3's MP server is down)
    request_id = prefetch.json()["request_id"]
    assert c.get(f"/cache/moves/{move}", headers=admin).status_code == 200
    unknown_move = assert_error(c.get("/cache/moves/0123abcd", headers=a), 404)
    theirs = assert_error(c.get(f"/cache/moves/{move}", headers=a), 404)
    assert "tenant-b" not in theirs["detail"]
    assert theirs["detail"] == unknown_move["detail"].replace("0123abcd", move)
    unknown = assert_error(c.get("/cache/prefetches/n3/0123abcd", headers=a), 403)
    theirs = assert_error(c.get(f"/cache/prefetches/n3/{request_id}", headers=a), 403)
    assert theirs == unknown and "tenant-b" not in theirs["detail"]
    # its own salt's are answered
    mine = c.post(
        "/cache/moves", json={**fields(), "source_instance_id": "n1", "target_instance_id": "n2"},
        headers=a,
    ).json()["move_id"]  # fmt: skip
    assert c.get(f"/cache/moves/{mine}", headers=a).status_code == 200


def test_an_instance_is_never_asked_to_load_a_salt_its_token_may_not_store(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """A prefetch onto, or a move to, an instance registered by a token bound to other salts
    is a 409 that records nothing, for a tenant's cache token and admin alike. The keys it
    loaded would be store events its token may not send: the coordinator refuses the whole
    batch (403) and the node's event sink retries it forever, so one prefetch by tenant-a's
    cache operator onto tenant-b's node (a shared L2 pool, or a source it can fetch from)
    stopped that node's event reporting (found on real processes: tenant-b's later stores
    never reached the directory). Its own salt's are recorded as before."""
    server, c = served
    before = cache_control_state(server)
    for who in (TENANT_A, ADMIN):
        for r in (
            c.post(
                "/cache/prefetches", json={**fields(), "instance_id": "n3"}, headers=bearer(who)
            ),
            c.post(
                "/cache/moves",
                json={**fields(), "source_instance_id": "n1", "target_instance_id": "n3"},
                headers=bearer(who),
            ),
        ):
            assert "n3" in assert_error(r, 409)["detail"]
    assert cache_control_state(server) == before
    r = c.post(
        "/cache/prefetches", json={**fields(), "instance_id": "n2"}, headers=bearer(TENANT_A)
    )
    assert r.status_code == 502 and r.json()["request_id"], r.text  # recorded, n2 down
    move = {**fields(), "source_instance_id": "n3", "target_instance_id": "n1"}  # any source
    assert c.post("/cache/moves", json=move, headers=bearer(TENANT_A)).status_code == 200


def test_quota_usage_counts_the_directorys_l2_bytes_per_salt() -> None:
    """The bytes of L2 copies per salt, as LMCache reports a salt's usage (L1 not counted)."""
    with running(chunk_size=16) as (_, c):
        keys = [wire_key(bytes([i + 1]) * 32, salt="t") for i in range(3)]
        l2 = wire_batch(
            "i1", 1, 1, "store", "l2", "fs", [wire_entry(k, size=1 << 20) for k in keys]
        )
        l1 = wire_batch("i1", 1, 2, "store", entries=[wire_entry(keys[0], size=1 << 30)])
        assert post_batches(c, l2, l1).json()["applied"] == 2
        c.put("/quota/t", json={"limit_gb": 1.0})
        got = c.get("/quota/t").json()
        assert got == {"cache_salt": "t", "quota_limit_gb": 1.0, "quota_exists": True,
                       "usage_gb": 3 / 1024}  # fmt: skip
        listed = c.get("/quota").json()
        assert listed["total_gb"] == 3 / 1024 and [
            r["cache_salt"] for r in listed["by_cache_salt"]
        ] == ["t"]


def test_a_node_reads_its_own_pins_in_its_salts_only(
    served: tuple[BackgroundServer, httpx.Client],
) -> None:
    """``GET /instances/{id}/pins`` (issue 30 item 3: the node learns its pins): a node token
    reads, for an instance it is bound to, the pins of its salts and no other's; another
    instance's, a token without ``emit`` or none: refused; nothing changes."""
    server, c = served
    admin = bearer(ADMIN)
    other = [t + 1000 for t in TOKENS]
    for salt in ("tenant-a", "tenant-b"):
        assert c.post("/cache/pins", json=fields(salt, token_ids=other), headers=admin).is_success
    try:
        before = cache_control_state(server)
        r = c.get("/instances/n1/pins", params={"model_name": "m"}, headers=bearer(NODE))
        assert r.status_code == 200, r.text
        salts = {row["key"]["cache_salt"] for row in r.json()["pins"]}
        assert salts == {"tenant-a"} and r.json()["total"] >= 3
        everything = c.get("/instances/n1/pins", headers=admin).json()
        assert {row["key"]["cache_salt"] for row in everything["pins"]} >= {"tenant-a", "tenant-b"}
        paged = c.get("/instances/n1/pins", params={"limit": 1, "offset": 1}, headers=admin)
        assert paged.json()["pins"] == everything["pins"][1:2]
        assert_error(c.get("/instances/n3/pins", headers=bearer(NODE)), 403)
        assert_error(c.get("/instances/n1/pins", headers=bearer(ANY_CACHE)), 403)
        assert_error(c.get("/instances/n1/pins"), 401)
        assert_error(c.get("/instances/n1/pins", params={"limit": 0}, headers=admin), 422)
        assert_error(c.get("/cache/pins", headers=bearer(NODE)), 403)  # still cache's route
        assert cache_control_state(server) == before
    finally:
        for salt in ("tenant-a", "tenant-b"):
            c.request("DELETE", "/cache/pins", json=fields(salt, token_ids=other), headers=admin)
