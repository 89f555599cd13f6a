"""``POST /events`` replies alike on two servers of the one request stack — status, bytes,
content type — for valid bodies (JSON and msgpack, replays), broken ones (422 naming the field,
413), and refusals (401, 403), and leaves the same directory behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvatlas.coordinator.app import CoordinatorApp, create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.events import CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.coordinator.helpers import serving
from tests.helpers import write_tokens

ADMIN = "admin-token-0123456789abcdef0123456789"
EMIT_A = "emit-a-token-0123456789abcdef0123456789"
RANK = pack_kv_rank(1, 0, 1, 0)


def _store(seq: int, n: int = 2, instance: str = "a", salt: str = "") -> dict[str, Any]:
    tokens = list(range(seq * 100, seq * 100 + 4 * n))
    entries = [
        {
            "key": {
                "chunk_hash_hex": h.hex(),
                "model_name": "m",
                "kv_rank": RANK,
                "object_group_id": 0,
                "cache_salt": salt,
            },
            "size_bytes": 10,
            "token_ids": tokens[4 * i : 4 * i + 4],
            "token_offset": 4 * i,
        }
        for i, h in enumerate(chunk_hashes(tokens, 4))
    ]
    return {
        "instance_id": instance,
        "incarnation": 1,
        "seq": seq,
        "event_type": "store",
        "tier": "l1",
        "backend": "dram",
        "entries": entries,
    }


def _app(tokens: Path) -> CoordinatorApp:
    config = CoordinatorConfig(
        chunk_size=4, enable_blend_lookup=True, auth_token_file=tokens, max_batch_entries=8
    )
    return create_app(CoordinatorService(config))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("auth") / "tokens.json",
        {"token": ADMIN, "roles": ["admin", "emit", "lookup"]},
        {"token": EMIT_A, "roles": ["emit"], "instance_ids": ["a"], "cache_salts": [""]},
    )
    with serving(_app(tokens)) as c:
        reg = {"instance_id": "a", "ip": "127.0.0.1", "port": 1}
        c.post("/instances", json=reg, headers=_auth(ADMIN)).raise_for_status()
        yield c


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _msgpack_store(seq: int) -> bytes:
    tokens = list(range(7000 + seq * 8, 7000 + seq * 8 + 8))
    entries = tuple(
        CacheEntry(ObjectKey(h, "m", RANK), 10, tokens[4 * i : 4 * i + 4], 4 * i)
        for i, h in enumerate(chunk_hashes(tokens, 4))
    )
    return encode_msgpack([EventBatch("a", 1, seq, "store", "l1", "dram", entries=entries)])


JSON = "application/json"
CASES: list[tuple[str, str, bytes | None]] = [
    (EMIT_A, JSON, msgspec.json.encode({"batches": [_store(1)]})),
    (EMIT_A, JSON, msgspec.json.encode({"batches": [_store(1)]})),  # a replay: duplicates
    (EMIT_A, "application/msgpack", _msgpack_store(2)),
    (EMIT_A, JSON, msgspec.json.encode({"batches": [_store(3, n=9)]})),  # 413: 9 > 8 entries
    (EMIT_A, JSON, msgspec.json.encode({"batches": [_store(4, instance="b")]})),  # 403
    (EMIT_A, JSON, msgspec.json.encode({"batches": [_store(4, salt="s")]})),  # 403: salt
    (ADMIN, JSON, msgspec.json.encode({"batches": [_store(4, instance="c")]})),  # 403: unknown
    ("wrong-token-0123456789abcdef", JSON, msgspec.json.encode({"batches": [_store(4)]})),  # 401
    (EMIT_A, JSON, b'{"batches": [{"instance_id": "a"}]}'),  # 422: missing field
    (EMIT_A, JSON, b"not json"),
    (EMIT_A, "application/msgpack", b"\xc1"),
    (EMIT_A, JSON, msgspec.json.encode({"batches": [{**_store(5), "tier": "l9"}]})),
    (EMIT_A, JSON, None),  # a body whose token list is broken: 422 naming the entry
    (EMIT_A, JSON, msgspec.json.encode({"batches": [_store(6)]})),
]


STATUSES = [200, 200, 200, 413, 403, 403, 403, 401, 422, 422, 422, 422, 422, 200]


def test_each_batch_gets_its_status_and_the_applied_ones_count(client: httpx.Client) -> None:
    seen = []
    for token, content_type, body in CASES:
        if body is None:
            broken = _store(5)
            broken["entries"][1]["token_ids"] = [1, -2]
            body = msgspec.json.encode({"batches": [broken]})
        r = client.post(
            "/events", content=body, headers={**_auth(token), "Content-Type": content_type}
        )
        assert r.headers["content-type"] == JSON, body[:80]
        if r.status_code >= 400:
            assert r.json()["detail"], body[:80]
        seen.append(r.status_code)
    assert seen == STATUSES
    stats = client.get("/directory/stats", headers=_auth(ADMIN)).json()["batches"]
    assert stats == {"applied": 3, "duplicate": 1, "stale": 0}
