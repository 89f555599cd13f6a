"""``POST /directory/blend-lookup`` over HTTP: the stored chunk found inside a longer query,
an empty query answered empty, and each bad body a 422 naming what is wrong."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvatlas.coordinator.app import CoordinatorApp, create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.coordinator.helpers import serving

TOKENS = list(range(100, 108))


def _app() -> CoordinatorApp:
    service = CoordinatorService(CoordinatorConfig(chunk_size=4, enable_blend_lookup=True))
    key = ObjectKey(chunk_hashes(TOKENS, 4)[0], "m", pack_kv_rank(1, 0, 1, 0))
    entry = CacheEntry(key, 10, TOKENS[:4], 0)
    service.ingest([EventBatch("a", 1, 1, "store", "l1", "dram", entries=(entry,))])
    return create_app(service)


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with serving(_app()) as c:
        yield c


STORED = chunk_hashes(TOKENS, 4)[0].hex()


@pytest.mark.parametrize(
    ("body", "status", "reply"),
    [
        ({"token_ids": [7, *TOKENS], "model_name": "m"}, 200,
         {"matches": [{"chunk_hash": STORED, "old_st": 0, "cur_st": 1}],
          "enable_blend_lookup": True}),
        ({"token_ids": []}, 200, {"matches": [], "enable_blend_lookup": True}),
        ({"token_ids": [1]}, 422, "model_name is required"),
        ({"token_ids": [1], "tokens_b64": "AQAAAA==", "model_name": "m"}, 422, "not both"),
        ({"token_ids": [1], "model_name": "m", "world_size": 0}, 422, "world_size"),
        ([1], 422, "Expected `object`"),
    ],
)  # fmt: skip
def test_blend_lookup_replies(
    client: httpx.Client, body: object, status: int, reply: dict[str, object] | str
) -> None:
    r = client.post("/directory/blend-lookup", json=body)
    assert r.status_code == status, r.text
    if isinstance(reply, str):
        assert reply in r.json()["detail"]
        assert "x-kvatlas-blend" not in r.headers
    else:
        assert r.json() == reply
        assert r.headers["x-kvatlas-blend"] == "enabled"
