"""Issue 16 item 10: a producer with access to the Redis stream gets no more than an emitter
over HTTP. Entries over --max-batch-entries, and (auth on) unsigned entries or entries for an
instance the signer may not act for (issue 25 item 7), are refused, counted by reason in
/metrics and never applied. Real redis-server."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import redis

from kvatlas.auth import stream_key
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.stream_format import encode_stream_fields, sign_stream_fields
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.conftest import RedisServer, wait_for
from tests.coordinator.helpers import fresh, running
from tests.coordinator.security_support import ADMIN, bearer, token, write_tokens

NODE_S = token("node-s")


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
    tokens = write_tokens(
        tmp_path / "t.json",
        {"token": ADMIN, "role": "admin"},
        {"token": NODE_S, "roles": ["emit"], "instance_ids": ["node-s"]},
    )
    key = stream_key(NODE_S)

    def signed(batch: EventBatch) -> dict[bytes, bytes]:
        return sign_stream_fields(encode_stream_fields([batch]), stream, key.key_id, key.secret)

    with running(
        event_transport="redis",
        redis_url=redis_server.url,
        event_stream=stream,
        auth_token_file=tokens,
        max_batch_entries=4,
    ) as (_, c):
        h = bearer(ADMIN)
        reg = c.post("/instances", json={"instance_id": "node-s"}, headers=bearer(NODE_S))
        assert reg.status_code == 200
        r = redis.Redis.from_url(redis_server.url)
        r.xadd(stream, signed(_store("node-s", 1, 5, 1)))  # type: ignore[arg-type]  # too large
        r.xadd(stream, encode_stream_fields([_store("intruder", 1, 1, 2)]))  # unsigned
        r.xadd(stream, signed(_store("intruder", 1, 1, 4)))  # type: ignore[arg-type]  # not node-s
        r.xadd(stream, signed(_store("node-s", 2, 4, 3)))  # type: ignore[arg-type]  # fine
        assert wait_for(lambda: c.get("/directory/stats", headers=h).json()["keys"] == 4)
        assert wait_for(
            lambda: (
                _rejected(c.get("/metrics", headers=h).text)
                == {"too_large": 1.0, "unsigned": 1.0, "forbidden": 1.0}
            )
        ), c.get("/metrics", headers=h).text
        rows = {row["instance_id"] for row in c.get("/instances", headers=h).json()["instances"]}
        assert "intruder" not in rows
        keys = c.get("/directory/keys", headers=h).json()["keys"]
        assert {k["key"]["chunk_hash_hex"][:2] for k in keys} == {"03"}  # only the good entry


def test_undecodable_and_over_capacity_entries_are_refused_and_counted(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A signed entry whose data is not msgpack is a stream decode error; a signed entry that
    would add an emitter beyond ``--max-instances`` is refused as ``emitter_cap``; neither is
    applied, the good entry between them is."""
    stream = fresh("security-stream-reasons")
    tokens = write_tokens(
        tmp_path / "t.json",
        {"token": ADMIN, "role": "admin"},
        {"token": NODE_S, "roles": ["emit"], "instance_ids": ["node-s", "node-t"]},
    )
    key = stream_key(NODE_S)

    def signed(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
        return sign_stream_fields(fields, stream, key.key_id, key.secret)

    with running(
        event_transport="redis",
        redis_url=redis_server.url,
        event_stream=stream,
        auth_token_file=tokens,
        max_instances=1,
    ) as (_, c):
        h = bearer(ADMIN)
        r = redis.Redis.from_url(redis_server.url)
        garbage = {**encode_stream_fields([_store("node-s", 1, 1, 1)]), b"data": b"\xc1"}
        r.xadd(stream, signed(garbage))  # type: ignore[arg-type]  # not a batch
        r.xadd(stream, signed(encode_stream_fields([_store("node-s", 1, 2, 2)])))  # type: ignore[arg-type]
        r.xadd(stream, signed(encode_stream_fields([_store("node-t", 1, 1, 3)])))  # type: ignore[arg-type]
        assert wait_for(lambda: c.get("/directory/stats", headers=h).json()["keys"] == 2)
        assert wait_for(
            lambda: _rejected(c.get("/metrics", headers=h).text) == {"emitter_cap": 1.0}
        ), c.get("/metrics", headers=h).text
        assert 'kvatlas_stream_errors_total{kind="decode"} 1.0' in c.get("/metrics", headers=h).text
        keys = c.get("/directory/keys", headers=h).json()["keys"]
        assert {k["key"]["chunk_hash_hex"][:2] for k in keys} == {"02"}


def test_a_flood_of_refused_entries_is_logged_once_a_minute_a_reason(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who can write to the stream can add entries the coordinator refuses (unsigned,
    say): each is counted, but the log says so once a minute a reason, with the count, not
    once an entry (a flood of forged entries must not flood the log)."""
    stream = fresh("security-stream-flood")
    tokens = write_tokens(
        tmp_path / "t.json",
        {"token": ADMIN, "role": "admin"},
        {"token": NODE_S, "roles": ["emit"], "instance_ids": ["node-s"]},
    )
    with (
        caplog.at_level(logging.WARNING, logger="kvatlas.coordinator.stream_consumer"),
        running(
            event_transport="redis",
            redis_url=redis_server.url,
            event_stream=stream,
            auth_token_file=tokens,
        ) as (_, c),
    ):
        h = bearer(ADMIN)
        r = redis.Redis.from_url(redis_server.url)
        for n in range(40):
            r.xadd(stream, encode_stream_fields([_store("intruder", n + 1, 1, 2)]))  # unsigned
        assert wait_for(
            lambda: _rejected(c.get("/metrics", headers=h).text) == {"unsigned": 40.0}
        ), c.get("/metrics", headers=h).text
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]
