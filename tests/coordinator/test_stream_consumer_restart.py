"""Found by ``kvatlas soak`` (seed 0: a Redis restart left replica soak-r2 with two ghost
placements for good): entries a replica had read (``XREADGROUP >``, so delivered and past
the group's last-delivered id) but not yet applied when Redis went away are never applied —
the read fails at the next ``XACK``, the rest of the read is dropped, and after the restart
``>`` only serves newer entries. The replica's directory then misses those batches for good
(a node pinned to the other replica never repairs this one by digest).

Real redis-server (append-only file, fsynced on every write), stopped from inside the first
``ingest`` and started again 2 s later: every entry was delivered before the stop, none
acknowledged but the first.
Failed on the code before the Redis-restart work (``[1] == [1, 2, 3, 4, 5]``); the consumer now
rewinds to its last applied id after any Redis error."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.stream_consumer import StreamConsumer
from kvatlas.events import ColumnBatch, EventBatch
from kvatlas.events.stream_format import encode_stream_fields
from tests.conftest import RedisServer, wait_for

STREAM = "kvatlas:restart-test"


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)  # not the session server: this test restarts it
    server.start()
    yield server
    server.stop()


def test_entries_read_before_a_redis_restart_are_applied_after_it(
    own_redis: RedisServer,
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    for seq in range(1, 6):
        batch = EventBatch("node-a", 1, seq, "access", "l1", "dram")
        client.xadd(STREAM, encode_stream_fields([batch]))  # type: ignore[arg-type]
    client.close()
    applied: list[int] = []
    stop = threading.Event()
    registry = CollectorRegistry()

    def ingest(_who: object, batches: Sequence[ColumnBatch]) -> None:
        applied.extend(b.header.seq for b in batches)
        if len(applied) == 1:  # all five were delivered by one read; Redis goes away now,
            own_redis.stop()  # for longer than the client's own retries, then comes back
            threading.Timer(2.0, own_redis.start).start()

    consumer = StreamConsumer(
        CoordinatorConfig(
            event_transport="redis", redis_url=own_redis.url, event_stream=STREAM,
            consumer_heartbeat_s=1.0,
        ),
        attribute=lambda fields: None, ingest=ingest, position=None, on_position=lambda position: None,
        set_readiness=lambda state: None, stop=stop,
        errors=Counter("errors", "stream errors", ["kind"], registry=registry),
        rejected=Counter("rejected", "refused entries", ["reason"], registry=registry),
    )  # fmt: skip
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        # generous: the consumer backs off up to 5 s between attempts while Redis is down
        wait_for(lambda: set(applied) == {1, 2, 3, 4, 5}, timeout=15, interval=0.1)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert sorted(set(applied)) == [1, 2, 3, 4, 5], applied
