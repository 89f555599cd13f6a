"""Issue 16 item 10: a producer with access to the Redis stream gets no more than an emitter
over HTTP. Entries over --max-batch-entries, and (auth on) entries from instances that are not
registered, are refused, counted by reason in /metrics and never applied. Real redis-server."""

from __future__ import annotations

import re
from pathlib import Path

import redis

from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.stream_format import encode_stream_fields
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.conftest import RedisServer, wait_for
from tests.coordinator.helpers import fresh, running
from tests.coordinator.security_support import ADMIN, bearer, write_tokens


def _store(inst: str, seq: int, n: int, tag: int) -> EventBatch:
    entries = tuple(
        CacheEntry(ObjectKey(bytes([tag, i]) * 16, "m", pack_kv_rank(1, 0, 1, 0)), 10)
        for i in range(n)
    )
    return EventBatch(inst, 1, seq, "store", "l1", "dram", entries=entries)


def _rejected(metrics: str) -> dict[str, float]:
    pattern = r'kvatlas_stream_rejected_entries_total\{reason="([a-z_]+)"\} ([0-9.e+]+)'
    return {reason: float(v) for reason, v in re.findall(pattern, metrics)}


def test_stream_entries_pass_the_same_gate(redis_server: RedisServer, tmp_path: Path) -> None:
    stream = fresh("security-stream")
    tokens = write_tokens(tmp_path / "t.json", {"token": ADMIN, "role": "admin"})
    with running(
        event_transport="redis",
        redis_url=redis_server.url,
        event_stream=stream,
        auth_token_file=tokens,
        max_batch_entries=4,
    ) as (_, c):
        h = bearer(ADMIN)
        assert c.post("/instances", json={"instance_id": "node-s"}, headers=h).status_code == 200
        r = redis.Redis.from_url(redis_server.url)
        r.xadd(stream, encode_stream_fields([_store("node-s", 1, 5, 1)]))  # over the limit
        r.xadd(stream, encode_stream_fields([_store("intruder", 1, 1, 2)]))  # not registered
        r.xadd(stream, encode_stream_fields([_store("node-s", 2, 4, 3)]))  # fine
        assert wait_for(lambda: c.get("/directory/stats", headers=h).json()["keys"] == 4)
        assert wait_for(
            lambda: (
                _rejected(c.get("/metrics", headers=h).text)
                == {"too_large": 1.0, "unregistered": 1.0}
            )
        ), c.get("/metrics", headers=h).text
        rows = {row["instance_id"] for row in c.get("/instances", headers=h).json()["instances"]}
        assert "intruder" not in rows
        keys = c.get("/directory/keys", headers=h).json()["keys"]
        assert {k["key"]["chunk_hash_hex"][:2] for k in keys} == {"03"}  # only the good entry
