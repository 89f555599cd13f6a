"""``POST /route/score`` over HTTP: scores, validation errors, role and salt refusals, each
with its status and, for a refusal, a detail naming why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kvatlas.coordinator.app import CoordinatorApp, create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from tests.coordinator.helpers import serving
from tests.helpers import write_tokens

ADMIN = "admin-token-0123456789abcdef0123456789"
EMIT = "emit-token-0123456789abcdefgh0123456789"
SALTED = "salted-token-0123456789abcdef0123456789"


def _app(tokens: Path) -> CoordinatorApp:
    config = CoordinatorConfig(chunk_size=4, enable_blend_lookup=True, auth_token_file=tokens)
    return create_app(CoordinatorService(config))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("auth") / "tokens.json",
        {"token": ADMIN, "roles": ["admin", "emit", "lookup"]},
        {"token": EMIT, "roles": ["emit"]},
        {"token": SALTED, "roles": ["lookup"], "cache_salts": ["s"]},
    )
    with serving(_app(tokens)) as c:
        reg = {"instance_id": "a", "ip": "127.0.0.1", "port": 1}
        c.post("/instances", json=reg, headers=_auth(ADMIN)).raise_for_status()
        yield c


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


QUERY = {"token_ids": list(range(16)), "model_name": "m"}
CASES: list[tuple[str, object, int]] = [
    (ADMIN, QUERY, 200),
    (ADMIN, {**QUERY, "instances": ["a", "b"]}, 200),
    (ADMIN, {**QUERY, "weights": {"nvme": 1.0}}, 422),
    (ADMIN, {"token_ids": [-1], "model_name": "m"}, 422),
    (ADMIN, [1], 422),
    (EMIT, QUERY, 403),  # no lookup role
    (SALTED, QUERY, 403),  # another tenant's salt
    ("wrong-token-0123456789abcdef", QUERY, 401),
]


@pytest.mark.parametrize(("token", "body", "status"), CASES)
def test_route_score_replies(client: httpx.Client, token: str, body: object, status: int) -> None:
    r = client.post("/route/score", content=msgspec.json.encode(body), headers=_auth(token))
    assert r.status_code == status, r.text
    if status == 200:  # every instance named (else the registered ones), nothing cached
        asked = body.get("instances", ["a"]) if isinstance(body, dict) else []
        reply = r.json()
        assert [i["instance_id"] for i in reply["instances"]] == asked
        assert reply["query_tokens"] == 16 and all(i["score"] == 0 for i in reply["instances"])
    else:
        assert r.json()["detail"]
