"""Bearer-token auth (coordinator.md §4): 401 without/with a bad token, 403 outside the role,
emit tokens bound to instance ids, lookup tokens bound to cache salts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.coordinator.server import BackgroundServer
from tests.coordinator.helpers import (
    Emitter,
    b64,
    fresh_tokens,
    holders,
    running,
    wire_batch,
)
from tests.helpers import write_tokens

EMIT_X = "emit-token-for-x-0123456789abcdef0123456789abcdef"
EMIT_ANY = "emit-token-for-any-0123456789abcdef0123456789abcdef"
LOOKUP_A = "lookup-token-salt-a-0123456789abcdef0123456789abcdef"
LOOKUP_ALL = "lookup-token-all-salts-0123456789abcdef0123456789abcdef"
LOOKUP_NONE = "lookup-token-no-salts-0123456789abcdef0123456789abcdef"
ADMIN = "admin-token-0000-0123456789abcdef0123456789abcdef"
SALT_A, SALT_B = "tenant-a", "tenant-b"


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def auth_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    path = write_tokens(
        tmp_path_factory.mktemp("auth") / "tokens.json",
        {"token": EMIT_X, "role": "emit", "instance_ids": ["node-x"]},
        {"token": EMIT_ANY, "role": "emit"},
        {"token": LOOKUP_A, "role": "lookup", "cache_salts": [SALT_A]},
        {"token": LOOKUP_ALL, "role": "lookup"},
        {"token": LOOKUP_NONE, "role": "lookup", "cache_salts": []},
        {"token": ADMIN, "role": "admin"},
    )
    with running(auth_token_file=path, enable_blend_lookup=True) as pair:
        yield pair


@pytest.fixture(scope="module")
def c(auth_server: tuple[BackgroundServer, httpx.Client]) -> httpx.Client:
    return auth_server[1]


@pytest.fixture(scope="module")
def stored(c: httpx.Client) -> dict[str, list[int]]:
    """One chunk stored under salt A and one under salt B (by an admin)."""
    out = {}
    for salt in (SALT_A, SALT_B):
        em, tokens = Emitter(), fresh_tokens(1)
        r = c.post("/instances", json={"instance_id": em.instance_id}, headers=_h(ADMIN))
        assert r.status_code == 200, r.text  # with auth on, only registered instances emit
        r = c.post(
            "/events", json={"batches": [em.store_chunks(tokens, salt=salt)]}, headers=_h(ADMIN)
        )
        assert r.status_code == 200, r.text
        out[salt] = tokens
    return out


def _requests(instance: str = "node-x") -> list[tuple[str, str, Any]]:
    return [
        ("POST", "/events", {"batches": [wire_batch(instance, 1, 1)]}),
        ("POST", "/directory/lookup", {"token_ids": [1, 2, 3, 4], "model_name": "m"}),
        ("POST", "/directory/blend-lookup", {"tokens_b64": b64([1, 2, 3, 4]), "model_name": "m"}),
        ("GET", "/directory/stats", None),
        ("GET", "/directory/keys", None),
        ("POST", "/instances", {"instance_id": instance}),
        ("PUT", f"/instances/{instance}/heartbeat", None),
        ("DELETE", f"/instances/{instance}", None),
        ("GET", "/instances", None),
    ]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        _h("wrong-token-123"),
        {"Authorization": EMIT_X},  # no scheme
        {"Authorization": f"Basic {EMIT_X}"},
        {"Authorization": "Bearer"},
    ],
)
def test_401_without_or_with_bad_token(c: httpx.Client, headers: dict[str, str]) -> None:
    before = c.get("/directory/stats", headers=_h(ADMIN)).json()
    for method, path, body in _requests():
        r = c.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert r.json()["detail"]
        assert r.headers.get("www-authenticate", "").lower().startswith("bearer")
    assert c.get("/directory/stats", headers=_h(ADMIN)).json() == before


@pytest.mark.parametrize("second", [ADMIN, "wrong-token-123"])
def test_two_authorization_headers_are_refused(c: httpx.Client, second: str) -> None:
    """Which of two credentials a caller meant is a guess (and a proxy in front may read the
    other one): refused as no credential is, whichever comes first, even both the admin's."""
    for first, then in ((ADMIN, second), (second, ADMIN)):
        headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {then}")]
        r = c.get("/directory/stats", headers=headers)
        assert r.status_code == 401, r.text
        assert "Authorization" in r.json()["detail"]
    assert c.get("/directory/stats", headers=_h(ADMIN)).status_code == 200


def test_open_endpoints_need_no_token(c: httpx.Client) -> None:
    for path in ("/healthz", "/readyz"):  # /metrics and the docs: test_security_exposure.py
        assert c.get(path).status_code == 200, path


def test_emit_token_acts_for_its_instance(c: httpx.Client) -> None:
    h = _h(EMIT_X)
    r = c.post("/instances", json={"instance_id": "node-x"}, headers=h)
    assert r.status_code == 200, r.text
    r = c.post("/events", json={"batches": [wire_batch("node-x", 1, 1)]}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == 1
    assert c.put("/instances/node-x/heartbeat", headers=h).status_code == 200
    assert c.get("/instances", headers=h).status_code == 200
    assert c.delete("/instances/node-x", headers=h).status_code == 204


def test_emit_token_refused_for_other_instance(c: httpx.Client) -> None:
    h = _h(EMIT_X)
    assert (
        c.post("/instances", json={"instance_id": "node-y"}, headers=_h(ADMIN)).status_code == 200
    )
    before = c.get("/directory/stats", headers=_h(ADMIN)).json()
    for method, path, body in [
        ("POST", "/events", {"batches": [wire_batch("node-y", 1, 1)]}),
        # one foreign batch poisons the whole body: nothing applied
        ("POST", "/events", {"batches": [wire_batch("node-x", 2, 1), wire_batch("node-y", 1, 1)]}),
        ("POST", "/instances", {"instance_id": "node-y"}),
        ("POST", "/instances", {"ip": "10.0.0.1"}),  # an assigned id is not node-x
        ("PUT", "/instances/node-y/heartbeat", None),
        ("DELETE", "/instances/node-y", None),
    ]:
        r = c.request(method, path, json=body, headers=h)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
        assert r.json()["detail"]
    assert c.get("/directory/stats", headers=_h(ADMIN)).json() == before
    rows = {r["instance_id"]: r for r in c.get("/instances", headers=_h(ADMIN)).json()["instances"]}
    assert rows["node-y"]["alive"] is True  # not deregistered
    assert rows.get("node-x", {}).get("incarnation") != 2


def test_emit_token_cannot_query(c: httpx.Client, stored: dict[str, list[int]]) -> None:
    for token in (EMIT_X, EMIT_ANY):
        for method, path, body in _requests()[1:5]:
            r = c.request(method, path, json=body, headers=_h(token))
            assert r.status_code == 403, (token, path, r.status_code, r.text)


def test_emit_token_cannot_blend_lookup_even_empty(c: httpx.Client) -> None:
    """The role check must not depend on the query being non-empty."""
    r = c.post(
        "/directory/blend-lookup", json={"tokens_b64": "", "model_name": "m"}, headers=_h(EMIT_X)
    )
    assert r.status_code == 403, r.text


def test_unbound_emit_token_any_instance(c: httpx.Client) -> None:
    r = c.post("/instances", json={"instance_id": "node-z"}, headers=_h(EMIT_ANY))
    assert r.status_code == 200, r.text
    r = c.post("/events", json={"batches": [wire_batch("node-z", 1, 1)]}, headers=_h(EMIT_ANY))
    assert r.status_code == 200, r.text


def test_lookup_token_cannot_emit_or_manage(c: httpx.Client) -> None:
    before = c.get("/directory/stats", headers=_h(ADMIN)).json()
    for token in (LOOKUP_A, LOOKUP_ALL):
        for method, path, body in [_requests("node-l")[i] for i in (0, 4, 5, 6, 7)]:
            r = c.request(method, path, json=body, headers=_h(token))
            assert r.status_code == 403, (token, method, path, r.status_code, r.text)
    assert c.get("/directory/stats", headers=_h(ADMIN)).json() == before


def test_lookup_token_bound_to_salt(c: httpx.Client, stored: dict[str, list[int]]) -> None:
    h = _h(LOOKUP_A)
    ta, tb = stored[SALT_A], stored[SALT_B]
    # own salt: sees its chunk in both lookup forms and blend
    r = c.post(
        "/directory/lookup",
        json={"token_ids": ta, "model_name": "m", "cache_salt": SALT_A},
        headers=h,
    )
    assert r.status_code == 200, r.text
    assert list(holders(r.json()).values()) == [1]
    blend = {"tokens_b64": b64([0, *ta]), "model_name": "m", "cache_salt": SALT_A}
    r = c.post("/directory/blend-lookup", json=blend, headers=h)
    assert r.status_code == 200, r.text
    assert len(r.json()["matches"]) == 1
    key_a = r.json()["matches"][0]["chunk_hash"]
    wire_a = {
        "chunk_hash_hex": key_a,
        "model_name": "m",
        "kv_rank": 1 << 24 | 1 << 8,
        "cache_salt": SALT_A,
    }
    r = c.post("/directory/lookup", json={"keys": [wire_a]}, headers=h)
    assert r.status_code == 200, r.text
    assert len(r.json()["results"][0]["placements"]) == 1
    # foreign salt: 403 and nothing in the body, on every form
    for path, body in [
        ("/directory/lookup", {"token_ids": tb, "model_name": "m", "cache_salt": SALT_B}),
        ("/directory/lookup", {"tokens_b64": b64(tb), "model_name": "m", "cache_salt": SALT_B}),
        ("/directory/lookup", {"keys": [{**wire_a, "cache_salt": SALT_B}]}),
        ("/directory/lookup", {"keys": [wire_a, {**wire_a, "cache_salt": SALT_B}]}),
        ("/directory/lookup", {"token_ids": tb, "model_name": "m"}),  # default salt "" too
        (
            "/directory/blend-lookup",
            {"tokens_b64": b64(tb), "model_name": "m", "cache_salt": SALT_B},
        ),
        ("/directory/blend-lookup", {"token_ids": tb, "model_name": "m", "cache_salt": SALT_B}),
    ]:
        r = c.post(path, json=body, headers=h)
        assert r.status_code == 403, (path, body, r.status_code, r.text)
        assert set(r.json()) <= {"detail"}, r.text
    # an unbound lookup token sees salt B
    r = c.post(
        "/directory/lookup",
        json={"token_ids": tb, "model_name": "m", "cache_salt": SALT_B},
        headers=_h(LOOKUP_ALL),
    )
    assert r.status_code == 200
    assert list(holders(r.json()).values()) == [1]


def test_a_token_bound_to_no_salts_looks_up_under_none(
    c: httpx.Client, stored: dict[str, list[int]]
) -> None:
    """``"cache_salts": []`` binds the token to no salt at all (not: unbound)."""
    for salt in (SALT_A, SALT_B, ""):
        body = {"token_ids": stored[SALT_A], "model_name": "m", "cache_salt": salt}
        r = c.post("/directory/lookup", json=body, headers=_h(LOOKUP_NONE))
        assert r.status_code == 403, (salt, r.text)
        blend = {"tokens_b64": b64(stored[SALT_A]), "model_name": "m", "cache_salt": salt}
        r = c.post("/directory/blend-lookup", json=blend, headers=_h(LOOKUP_NONE))
        assert r.status_code == 403, (salt, r.text)
    assert c.get("/directory/stats", headers=_h(LOOKUP_NONE)).status_code == 403


def test_lookup_token_can_read_stats_and_instances(c: httpx.Client) -> None:
    for token in (LOOKUP_A, LOOKUP_ALL):
        assert c.get("/instances", headers=_h(token)).status_code == 200
    assert c.get("/directory/stats", headers=_h(LOOKUP_ALL)).status_code == 200
    # global figures are every tenant's: not for a salt-bound token (test_security_exposure)
    assert c.get("/directory/stats", headers=_h(LOOKUP_A)).status_code == 403


def test_admin_can_do_everything(c: httpx.Client, stored: dict[str, list[int]]) -> None:
    h = _h(ADMIN)
    assert c.post("/instances", json={"instance_id": "node-admin"}, headers=h).status_code == 200
    for method, path, body in _requests("node-admin"):
        r = c.request(method, path, json=body, headers=h)
        assert r.status_code == (204 if method == "DELETE" else 200), (method, path, r.text)
    r = c.post(
        "/directory/lookup",
        json={"token_ids": stored[SALT_B], "model_name": "m", "cache_salt": SALT_B},
        headers=h,
    )
    assert list(holders(r.json()).values()) == [1]
    r = c.get("/directory/keys", headers=h)
    assert r.status_code == 200 and len(r.json()["keys"]) >= 2


def test_bad_token_file_refused(tmp_path: Path) -> None:
    from kvatlas.auth import TokenAuth

    for doc in (
        "not json",
        "{}",
        '{"tokens": []}',
        '{"tokens": [{"token": "short", "role": "admin"}]}',
        '{"tokens": [{"token": "longenough", "role": "root"}]}',
    ):
        path = tmp_path / "t.json"
        path.write_text(doc)
        with pytest.raises(ValueError):
            TokenAuth.from_file(path)
