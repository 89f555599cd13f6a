"""Stream retention (convergence.md §2) on a real Redis: the stream is trimmed by ``MINID`` to
the slowest registered replica's snapshot position, emitters cap it with ``MAXLEN``, and a
replica whose position was trimmed away says ``resyncing`` until the nodes resynced it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from kvatlas.client import EventSink, RedisStreamTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.retention import StreamRetention, unread_trimmed
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.stream_consumer import LAG_PERIOD_S
from kvatlas.coordinator.views import Readiness
from kvatlas.events import STORE, CacheEntry
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.config import NodeConfig
from kvatlas.node.server import NodeProcess
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, RedisServer, wait_for
from tests.coordinator.helpers import CS, metric_value, wire_key
from tests.helpers import TINY
from tests.helpers import node_config as toy_config

_names = itertools.count()


@pytest.fixture
def stream() -> str:
    return f"retention-{next(_names)}"


@pytest.fixture
def rclient(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@contextmanager
def replica(
    redis_server: RedisServer, stream: str, group: str, snap: Path, port: int = 0, **kw: Any
) -> Iterator[tuple[BackgroundServer, httpx.Client]]:
    # the tests with a node heartbeat by hand: no timer fences it (instance_timeout; node_config
    # turns off its timed digest exchanges), as a slow run's 30 s defaults did before a "still
    # missing" assertion
    config = CoordinatorConfig(
        port=port or free_port(), chunk_size=CS, event_transport="redis",
        redis_url=redis_server.url, event_stream=stream, consumer_group=group,
        snapshot_path=snap, **{"instance_timeout": 3600.0, **kw},
    )  # fmt: skip
    with (
        BackgroundServer(config) as server,
        httpx.Client(base_url=server.url, timeout=30.0) as client,
    ):
        yield server, client


def key(n: int) -> ObjectKey:
    return ObjectKey(bytes([n]) * 32, "m", pack_kv_rank(1, 0, 1, 0))


def applied(server: BackgroundServer, n: int) -> bool:
    return server.service.directory.stats().batches.get("applied", 0) >= n


def test_the_stream_is_trimmed_to_the_slowest_replicas_snapshot_position(
    redis_server: RedisServer, rclient: redis.Redis, stream: str, tmp_path: Path
) -> None:
    sink = EventSink("e1", RedisStreamTransport(redis_server.url, stream), incarnation=1)
    try:
        with replica(redis_server, stream, "fast", tmp_path / "fast") as (fast, _):
            with replica(redis_server, stream, "slow", tmp_path / "slow") as (slow, _):
                for n in range(5):
                    sink.emit(STORE, "l1", "dram", [CacheEntry(key(n), 1)])
                assert sink.flush(10)
                assert wait_for(lambda: applied(slow, 5) and applied(fast, 5))
                slow_info = slow.service.take_snapshot()
                assert slow_info is not None
            slow_position = slow.service.stream_position  # its stop() snapshot: same position
            assert slow_position is not None
            for n in range(5, 10):
                sink.emit(STORE, "l1", "dram", [CacheEntry(key(n), 1)])
            assert sink.flush(10)
            assert wait_for(lambda: applied(fast, 10))
            assert fast.service.take_snapshot() is not None
            registry = rclient.hgetall(f"{stream}:replicas")
            assert registry == {
                b"slow": slow_position.encode(),
                b"fast": fast.service.stream_position.encode(),  # type: ignore[union-attr]
            }
            ids = [entry_id.decode() for entry_id, _ in rclient.xrange(stream)]
            # trimmed up to, not past, what the slow replica will replay after a restart
            assert ids[0] == slow_position and len(ids) > 1
            # the slow replica retired: the next snapshot trims to the fast one's position
            rclient.hdel(f"{stream}:replicas", "slow")
            assert fast.service.take_snapshot() is not None
            assert [i.decode() for i, _ in rclient.xrange(stream)] == [ids[-1]]
    finally:
        sink.close()


def test_emitters_cap_the_stream_with_an_approximate_maxlen(
    redis_server: RedisServer, rclient: redis.Redis, stream: str
) -> None:
    sink = EventSink(
        "e1", RedisStreamTransport(redis_server.url, stream, maxlen=100), incarnation=1
    )
    try:
        for n in range(1000):
            sink.emit(STORE, "l1", "dram", [CacheEntry(key(n % 256), 1)])
            assert sink.flush(30)  # one stream entry per batch
    finally:
        sink.close()
    assert rclient.xlen(stream) < 1000  # approximate: whole macro nodes go, never too many


def node_config(url: str, redis_url: str, stream: str) -> NodeConfig:
    return toy_config(
        model_name="m", **TINY, chunk_size=CS, coordinator_url=url, port=free_port(),
        coordinator_event_reporting=True, instance_id="n1", event_transport="redis",
        redis_url=redis_url, event_stream=stream, digest_interval_s=3600,
    )  # fmt: skip


def store(process: NodeProcess, first_token: int, n: int) -> list[bytes]:
    node = process.node
    tracker = node.tracker(token_ids=list(range(first_token, first_token + n * CS)))
    kv = np.zeros(node.layout.shape, dtype=node.layout.numpy_dtype())
    assert node.store(tracker, [kv] * n) == n
    node.flush_events()
    assert process.sink is not None and process.sink.flush(10)
    return list(tracker.chunk_hashes())


def holders(client: httpx.Client, hashes: list[bytes]) -> list[set[str]]:
    reply = client.post("/directory/lookup", json={"keys": [wire_key(h) for h in hashes]})
    return [{p["instance_id"] for p in r["placements"]} for r in reply.json()["results"]]


def visible(client: httpx.Client, hashes: list[bytes]) -> bool:
    return all(held == {"n1"} for held in holders(client, hashes))


def trimmed_away(client: httpx.Client) -> float:
    return metric_value(client, "kvatlas_stream_errors_total", kind="trimmed")


def test_a_replica_behind_the_trim_says_resyncing_then_converges(
    redis_server: RedisServer, rclient: redis.Redis, stream: str, tmp_path: Path
) -> None:
    snap, port = tmp_path / "b", free_port()
    with replica(redis_server, stream, "b", snap, port) as (server, client):
        process = NodeProcess(node_config(server.url, redis_server.url, stream))
        assert process.coordinator is not None
        process.coordinator.stop_heartbeat()  # the test heartbeats by hand
        first = store(process, 100, 2)
        assert wait_for(lambda: visible(client, first))
        assert trimmed_away(client) == 0  # negative control: read from where it started
    try:
        # while the replica is down: more chunks, and the stream is cut past its position
        lost = store(process, 300, 2)
        last = store(process, 700, 1)
        newest = rclient.xrevrange(stream, count=1)[0][0]
        rclient.xtrim(stream, minid=newest, approximate=False)
        with replica(redis_server, stream, "b", snap, port) as (server, client):
            assert wait_for(lambda: server.service.state != "catching_up")
            assert client.get("/readyz").json() == {"ready": False, "state": "resyncing"}
            assert trimmed_away(client) == 1  # counted, not only logged
            assert wait_for(lambda: visible(client, last)) and not visible(client, lost)
            process.coordinator.heartbeat()  # the reply asks for a digest exchange
            assert wait_for(lambda: visible(client, first + lost + last))
            assert wait_for(lambda: client.get("/readyz").status_code == 200)
    finally:
        process.close()


def test_a_replica_that_crashed_before_its_first_snapshot_is_not_trimmed_past(
    redis_server: RedisServer, rclient: redis.Redis, stream: str, tmp_path: Path
) -> None:
    """Found by ``kvatlas soak``: a replica whose first snapshot could not record its position
    (Redis was away) had no entry in the registry, so the other replica trimmed past what it
    had not snapshotted; killed then, it came back behind the trim and could not rebuild
    everything by resync (nodes pinned to the other replica, shared pools). A replica now
    registers what it restored ("0-0": nothing) when it starts, unless its previous run
    recorded a position, so the other replica's trims keep what it still needs."""
    port = free_port()
    slow = spawn_service(
        ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(CS),
         "--event-transport", "redis", "--redis-url", redis_server.url, "--event-stream", stream,
         "--replica-id", "slow", "--snapshot-path", str(tmp_path / "slow.snap"),
         "--snapshot-interval", "3600", "--log-level", "warning"],
        f"http://127.0.0.1:{port}",
    )  # fmt: skip
    sink = EventSink("e1", RedisStreamTransport(redis_server.url, stream), incarnation=1)
    try:
        with replica(redis_server, stream, "fast", tmp_path / "fast.snap") as (fast, _):
            for n in range(5):
                sink.emit(STORE, "l1", "dram", [CacheEntry(key(n), 1)])
                assert sink.flush(10)  # one entry per batch
            slow_stats = f"http://127.0.0.1:{port}/directory/stats"
            assert wait_for(lambda: HTTP.get(slow_stats).json()["batches"]["applied"] >= 5)
            assert wait_for(lambda: applied(fast, 5))
            slow.kill()  # kill -9 before its first snapshot
            slow.wait(timeout=30)
            assert fast.service.take_snapshot() is not None  # records and trims
            assert rclient.xlen(stream) == 5  # the slow replica needs them all after a restart
    finally:
        sink.close()
        if slow.poll() is None:
            slow.kill()
            slow.wait(timeout=30)


def test_a_replica_behind_the_trim_is_repaired_by_nodes_registered_with_another(
    redis_server: RedisServer, rclient: redis.Redis, stream: str, tmp_path: Path
) -> None:
    """Found by ``kvatlas soak`` (seed 1): a replica restarted behind the stream's trim asked
    only its own nodes for digest exchanges, so what it missed of a node registered with the
    other replica (stores and deletes alike) stayed missing or a ghost for good. It now asks
    the whole fleet: the other replica's heartbeat replies ask its nodes to list everything
    they hold (``list_all``), through the stream that every replica reads."""
    b_port = free_port()
    with replica(redis_server, stream, "a", tmp_path / "a") as (a, a_client):
        process = NodeProcess(node_config(a.url, redis_server.url, stream))
        try:
            assert process.coordinator is not None
            process.coordinator.stop_heartbeat()  # the test heartbeats by hand
            with replica(redis_server, stream, "b", tmp_path / "b", b_port) as (_, b_client):
                first = store(process, 100, 2)
                assert wait_for(lambda: visible(b_client, first))
            # while b is down: the first chunks go, others come, the stream is cut past b
            assert process.node.clear_l1(force=True)
            process.node.flush_events()
            assert process.sink is not None and process.sink.flush(10)
            lost = store(process, 300, 2)
            last = store(process, 700, 1)  # the one entry left after the cut
            # a has read them before the cut (a loaded run's cut came first once: a, live, had
            # them trimmed away unread, as b has, and no heartbeat asked for a digest exchange)
            assert wait_for(lambda: visible(a_client, lost + last))
            newest = rclient.xrevrange(stream, count=1)[0][0]
            rclient.xtrim(stream, minid=newest, approximate=False)
            with replica(redis_server, stream, "b", tmp_path / "b", b_port) as (_, b_client):
                assert wait_for(lambda: visible(b_client, last))
                assert holders(b_client, first) == [{"n1"}, {"n1"}]  # ghosts, before
                assert holders(b_client, lost) == [set(), set()]  # missing, before

                def repaired() -> bool:
                    process.coordinator.heartbeat()  # type: ignore[union-attr]
                    return holders(b_client, first + lost) == [set(), set(), {"n1"}, {"n1"}]

                assert wait_for(repaired, timeout=30, interval=0.2)
                assert holders(a_client, first + lost) == [set(), set(), {"n1"}, {"n1"}]
        finally:
            process.close()


def test_a_trim_past_the_restored_position_after_joining_the_stream_is_no_loss(
    redis_server: RedisServer, rclient: redis.Redis, stream: str
) -> None:
    """Whether the stream was trimmed past the restored position is asked when the consumer
    joins, before it reads. A trim after that loses nothing (while it catches up, the
    replica's own snapshots record newer positions, and another replica may then trim past
    the restored one): not counted, ``serving``. Found by the ACL fleet test, where a replica
    restarted with snapshots every 0.3 s counted such a trim. A trim before joining is a
    loss: counted, ``resyncing`` (the negative control)."""
    ids = [rclient.xadd(stream, {"n": str(n)}).decode() for n in range(4)]

    def restored_at(position: str) -> CoordinatorService:
        service = CoordinatorService(CoordinatorConfig(chunk_size=CS))  # not started
        service.snapshots.retention = StreamRetention.connect(redis_server.url, stream, "g")
        service._restored_position = position
        return service

    def trims(service: CoordinatorService) -> float | None:
        return service.metrics.registry.get_sample_value(
            "kvatlas_stream_errors_total", {"kind": "trimmed"}
        )

    later = restored_at(ids[0])
    later._stream_readiness(Readiness.CATCHING_UP)  # joined: nothing trimmed yet
    rclient.xtrim(stream, minid=ids[2], approximate=False)  # after its snapshot at ids[2]
    later._stream_readiness(Readiness.SERVING)  # read to the end
    assert later.readiness.state is Readiness.SERVING and not trims(later)

    before = restored_at(ids[0])  # restored before the trim, joins after it
    before._stream_readiness(Readiness.CATCHING_UP)
    assert before.readiness.state is Readiness.RESYNCING and trims(before) == 1
    before._stream_readiness(Readiness.SERVING)
    assert before.readiness.state is Readiness.RESYNCING  # until the nodes resynced it


def test_entries_trimmed_before_a_live_replica_read_them_are_counted_and_resynced(
    redis_server: RedisServer,
    rclient: redis.Redis,
    stream: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by black-box probing: a running replica that fell behind (paused, slow, a burst
    above the cap) had entries it had not read trimmed away by the emitters' ``MAXLEN ~``
    cap or an ``XTRIM``, and stayed ``serving``, counted nothing and logged nothing: the
    stream was checked for a trim only when the consumer joined. Redis 7 counts what was
    added and what the group read: the loss is now counted, logged and resynced. A trim of
    what the replica has read (retention's ``MINID``) is none (the negative control)."""
    caplog.set_level("WARNING", logger="kvatlas.coordinator.stream_consumer")
    sink = EventSink("n1", RedisStreamTransport(redis_server.url, stream), incarnation=1)

    def emit(numbers: range) -> None:
        for n in numbers:
            sink.emit(STORE, "l1", "dram", [CacheEntry(key(n), 1)])
            assert sink.flush(30)  # one stream entry per batch

    try:
        with replica(redis_server, stream, "live", tmp_path / "s") as (server, client):
            assert wait_for(lambda: client.get("/readyz").status_code == 200)
            emit(range(3))
            assert wait_for(lambda: applied(server, 3))
            newest = rclient.xrevrange(stream, count=1)[0][0]
            assert rclient.xtrim(stream, minid=newest, approximate=False) == 2  # read: no loss
            emit(range(3, 4))
            assert wait_for(lambda: applied(server, 4))
            consumer = server.service.stream_consumer
            assert consumer is not None
            gate, ingest = threading.Event(), consumer._ingest

            def held(who: Any, batches: Any) -> object:
                gate.wait(30)  # the replica falls behind
                return ingest(who, batches)

            consumer._ingest = held
            emit(range(4, 20))
            assert rclient.xtrim(stream, maxlen=2, approximate=False) > 0  # the cap, past it
            gate.set()
            assert wait_for(lambda: trimmed_away(client) == 1)
            assert client.get("/readyz").json() == {"ready": False, "state": "resyncing"}
            assert "trimmed before this replica read them" in caplog.text
            assert wait_for(lambda: rclient.xinfo_groups(stream)[0]["lag"] == 0)
            emit(range(20, 22))  # counted once: the group's counter was set right
            assert wait_for(lambda: rclient.xinfo_groups(stream)[0]["lag"] == 0)
            time.sleep(2 * LAG_PERIOD_S)  # the consumer asked again
            assert trimmed_away(client) == 1
    finally:
        sink.close()


STREAM_AT_9 = {"entries-added": 9, "length": 2, "last-generated-id": b"9-0"}


@pytest.mark.parametrize(
    ("stream_info", "group", "found"),
    [
        # read to the end: what the counters lack was trimmed unread (the probe's 19/4/2 case)
        (STREAM_AT_9, {"last-delivered-id": b"9-0", "entries-read": 5}, (4, 9)),
        (STREAM_AT_9, {"last-delivered-id": b"9-0", "entries-read": 9}, None),
        # behind, the stream's first entry after its position: all of it is unread
        ({**STREAM_AT_9, "recorded-first-entry-id": b"8-0"},
         {"last-delivered-id": b"3-0", "entries-read": 3}, (4, 7)),
        ({**STREAM_AT_9, "recorded-first-entry-id": b"8-0"},
         {"last-delivered-id": b"7-0", "entries-read": 7}, None),
        # the stream still holds what follows its position: nothing was trimmed past it
        ({**STREAM_AT_9, "first-entry": (b"3-0", {})},
         {"last-delivered-id": b"3-0", "entries-read": 1}, None),
        # a counter Redis cannot tell (after XGROUP SETID): the first entry after it counts
        ({**STREAM_AT_9, "first-entry": (b"8-0", {})},
         {"last-delivered-id": b"3-0", "entries-read": None}, (None, 7)),
        ({**STREAM_AT_9, "first-entry": (b"8-0", {})},
         {"last-delivered-id": b"9-0", "entries-read": None}, None),
        # an emptied stream past its position
        ({"entries-added": 9, "length": 0, "last-generated-id": b"9-0"},
         {"last-delivered-id": b"5-0", "entries-read": 5}, (4, 9)),
        # Redis < 7 counts nothing
        ({"length": 2, "last-generated-id": b"9-0"}, {"last-delivered-id": b"9-0"}, None),
    ],
)  # fmt: skip
def test_unread_trimmed_counts_what_the_group_never_read(
    stream_info: dict[str, Any], group: dict[str, Any], found: object
) -> None:
    assert unread_trimmed(stream_info, group) == found
