"""``POST /directory/blend-lookup`` answers alike on two servers of the one request stack
(``kvatlas.dispatch``): same handler, same bytes, same errors, whichever server answers."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvatlas.coordinator.app import CoordinatorApp, create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.coordinator.helpers import fast_and_routed

TOKENS = list(range(100, 108))


def _app(fast_path: bool) -> CoordinatorApp:
    service = CoordinatorService(CoordinatorConfig(chunk_size=4, enable_blend_lookup=True))
    key = ObjectKey(chunk_hashes(TOKENS, 4)[0], "m", pack_kv_rank(1, 0, 1, 0))
    entry = CacheEntry(key, 10, TOKENS[:4], 0)
    service.ingest([EventBatch("a", 1, 1, "store", "l1", "dram", entries=(entry,))])
    return create_app(service)


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with fast_and_routed(_app) as both:
        yield both


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": [7, *TOKENS], "model_name": "m"},
        {"token_ids": []},
        {"token_ids": [1]},
        {"token_ids": [1], "tokens_b64": "AQAAAA==", "model_name": "m"},
        {"token_ids": [1], "model_name": "m", "world_size": 0},
        [1],
    ],
)
def test_route_and_fast_path_reply_alike(
    clients: tuple[httpx.Client, httpx.Client], body: object
) -> None:
    fast, routed = (c.post("/directory/blend-lookup", json=body) for c in clients)
    assert (routed.status_code, routed.content) == (fast.status_code, fast.content)
    assert routed.headers.get("x-kvatlas-blend") == fast.headers.get("x-kvatlas-blend")
