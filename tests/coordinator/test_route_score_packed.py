"""``POST /route/score`` in msgpack (``RouteScorePacked``: tokens as little-endian uint32 bytes,
what ``kvatlas router`` sends): the same reply as the JSON body on random fleets (the JSON path
is the oracle), and over HTTP each refusal the JSON body gets, with the same status."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvatlas.api import RouteScoresReply
from kvatlas.auth import ANONYMOUS_ADMIN
from kvatlas.client.route_client import AsyncRouteClient, packed_score_body, score_body
from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.route_score import RouteScoring
from kvatlas.coordinator.service import CoordinatorService
from tests.coordinator.helpers import serving
from tests.coordinator.test_route_score_oracle import INSTANCES, MODEL, Fleet, build_service, fleets
from tests.helpers import write_tokens

MSGPACK = {"Content-Type": "application/msgpack"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_packed_body_scores_as_the_json_body(
    case: tuple[Fleet, np.ndarray[Any, Any], dict[str, float]],
) -> None:
    fleet, query, overrides = case
    scoring = RouteScoring(build_service(fleet), ThreadPoolExecutor(1))
    for instances in (list(INSTANCES), None):  # named, and every live instance and engine
        options: dict[str, Any] = {"world_size": fleet.ws, "instances": instances}
        options["weights"] = overrides
        as_json = scoring.answer(score_body(query, MODEL, **options), ANONYMOUS_ADMIN)
        listed = {"token_ids": query.tolist(), "model_name": MODEL, **options}
        as_list = scoring.answer(json.dumps(listed).encode(), ANONYMOUS_ADMIN)
        packed = scoring.answer(packed_score_body(query, MODEL, **options), ANONYMOUS_ADMIN, True)
        assert packed == as_json == as_list  # byte for byte: ranking, scores, tiers
        assert json.loads(packed)["query_tokens"] == len(query)


ADMIN = "admin-token-0123456789abcdef0123456789"
SALTED = "salted-token-0123456789abcdef0123456789"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("auth") / "tokens.json",
        {"token": ADMIN, "roles": ["admin", "emit", "lookup"]},
        {"token": SALTED, "roles": ["lookup"], "cache_salts": ["s"]},
    )
    config = CoordinatorConfig(
        chunk_size=4,
        enable_blend_lookup=True,
        auth_token_file=Path(tokens),
        max_query_tokens=64,
        max_instances=3,
    )
    with serving(create_app(CoordinatorService(config))) as c:
        reg = {"instance_id": "a", "ip": "127.0.0.1", "port": 1}
        c.post("/instances", json=reg, headers=_auth(ADMIN)).raise_for_status()
        yield c


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


TOKENS = np.arange(16, dtype="<u4").tobytes()
QUERY: dict[str, Any] = {"tokens": TOKENS, "model_name": "m"}
CASES: list[tuple[str, Any, int, str]] = [
    (ADMIN, QUERY, 200, ""),
    (ADMIN, {**QUERY, "instances": ["a", "b"]}, 200, ""),
    (ADMIN, {**QUERY, "instances": None, "weights": None}, 200, ""),
    (ADMIN, {"model_name": "m"}, 200, ""),  # no tokens: nothing to reuse
    (ADMIN, {**QUERY, "tokens": TOKENS[:-1]}, 422, "multiple of 4"),
    (ADMIN, {**QUERY, "tokens": np.zeros(65, "<u4").tobytes()}, 413, "--max-query-tokens"),
    (ADMIN, {"tokens": TOKENS}, 422, "model_name is required"),
    (ADMIN, {**QUERY, "instances": ["a", "b", "c", "d"]}, 413, "--max-instances 3"),
    (ADMIN, {**QUERY, "instances": [""] * 20_000}, 413, "20000 instances"),  # array 16
    (ADMIN, {**QUERY, "instances": "a"}, 422, "instances"),
    (ADMIN, {**QUERY, "instances": [1]}, 422, "instances"),
    (ADMIN, {**QUERY, "instances": ["a/b"]}, 422, "instances[0]"),
    (ADMIN, {**QUERY, "weights": {"nvme": 1.0}}, 422, "unknown tier"),
    (ADMIN, {**QUERY, "weights": {str(i): 1.0 for i in range(9)}}, 422, "length <= 4"),
    (ADMIN, {**QUERY, "tokens": "AAAA"}, 422, "tokens"),  # a string, not bytes
    (ADMIN, {**QUERY, "world_size": 0}, 422, "world_size"),
    (ADMIN, {"token_ids": [1, 2, 3], "model_name": "m"}, 422, "token_ids"),  # JSON's name
    (ADMIN, {**QUERY, "instnaces": ["a"]}, 422, "instnaces"),
    (ADMIN, [1], 422, "body"),
    (SALTED, QUERY, 403, "salt"),  # another tenant's salt
    (SALTED, {**QUERY, "cache_salt": "s"}, 200, ""),
]


@pytest.mark.parametrize(("token", "body", "status", "detail"), CASES)
def test_packed_route_score_replies(
    client: httpx.Client, token: str, body: Any, status: int, detail: str
) -> None:
    raw = msgspec.msgpack.encode(body)
    r = client.post("/route/score", content=raw, headers={**_auth(token), **MSGPACK})
    assert r.status_code == status, r.text
    if status != 200:
        assert detail in r.json()["detail"], r.text
        return
    reply = r.json()
    asked = body.get("instances") or ["a"]
    assert [i["instance_id"] for i in reply["instances"]] == asked
    assert reply["query_tokens"] == len(body.get("tokens", b"")) // 4
    # the same body in JSON gets the same reply
    fields = {k: v for k, v in body.items() if k != "tokens"}
    if "tokens" in body:
        fields["tokens_b64"] = base64.b64encode(body["tokens"]).decode()
    same = client.post("/route/score", json=fields, headers=_auth(token))
    assert same.status_code == 200 and same.content == r.content


def test_a_msgpack_body_without_the_content_type_is_refused_as_json(client: httpx.Client) -> None:
    """Negative control: the format is the Content-Type's, never guessed from the bytes."""
    raw = msgspec.msgpack.encode(QUERY)
    r = client.post("/route/score", content=raw, headers=_auth(ADMIN))
    assert r.status_code == 422 and "JSON" in r.json()["detail"]


def test_the_router_client_scores_in_msgpack(client: httpx.Client) -> None:
    """``AsyncRouteClient`` (the router's) sends msgpack and reads the same rows."""

    async def score() -> RouteScoresReply:
        route = AsyncRouteClient(str(client.base_url), token=ADMIN)
        try:
            return await route.score(np.arange(16, dtype=np.uint32), "m", instances=["a", "b"])
        finally:
            await route.aclose()

    got = asyncio.run(score())
    assert [r.instance_id for r in got.instances] == ["a", "b"] and got.query_tokens == 16
