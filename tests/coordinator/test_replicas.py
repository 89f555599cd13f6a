"""Coordinator replicas on one Redis stream (docs/coordinator.md "Replicas", convergence.md §1).

Each replica has its own consumer group, named from a replica id, never from the bind address;
two replicas fed the same stream hold identical directories; a replica refuses a group that
another live replica consumes (and the live one loses nothing); a restart with the same id
is let in once the old consumer left (clean stop) or went idle past the heartbeat (crash).
Real redis-server, real ``kvatlas coordinator`` processes, real HTTP on loopback; no
wall-clock assertion (liveness is read from Redis's own idle times).
"""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from kvatlas.client import EventSink, RedisStreamTransport
from kvatlas.coordinator.config import CoordinatorConfig, parse_config
from kvatlas.coordinator.consumer_group import GroupHeld, ensure_group_free, group_consumers
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.directory import KeyDirectory, load_snapshot
from kvatlas.events import CacheEntry, EventBatch, decode_stream_fields
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, RedisServer, wait_for

C = 16
RANK = pack_kv_rank(1, 0, 1, 0)

# ------------------------------------------------------------------ group names (no Redis)


def test_replicas_bound_to_the_same_address_on_two_hosts_get_different_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old name, ``kvatlas-coordinator-{host}-{port}``, was one group for both."""
    groups = []
    for host in ("host-a", "host-b"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        config = CoordinatorConfig(
            host="0.0.0.0", port=9300, snapshot_path=Path("/var/lib/kvatlas/directory.snap")
        )
        groups.append(config.group_name)
    assert groups[0] != groups[1], groups


def test_group_name_comes_from_the_replica_id(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "h1")
    monkeypatch.chdir(tmp_path)
    a = CoordinatorConfig(snapshot_path=tmp_path / "a.snap")
    assert (
        a.resolved_replica_id.startswith("h1-")
        and a.group_name == f"kvatlas-{a.resolved_replica_id}"
    )
    # stable across restarts and bind addresses; a relative path names the same file
    same_file = CoordinatorConfig(host="0.0.0.0", port=9400, snapshot_path=Path("a.snap"))
    assert same_file.group_name == a.group_name
    # two replicas on one host with their own snapshot files are two replicas
    assert CoordinatorConfig(snapshot_path=tmp_path / "b.snap").group_name != a.group_name
    explicit = CoordinatorConfig(replica_id="r1", snapshot_path=tmp_path / "a.snap")
    assert (explicit.resolved_replica_id, explicit.group_name) == ("r1", "kvatlas-r1")
    assert CoordinatorConfig(replica_id="r1", consumer_group="g").group_name == "g"
    assert parse_config([], {"KVATLAS_REPLICA_ID": "r9"}).group_name == "kvatlas-r9"
    flag_wins = parse_config(["--replica-id", "r8"], {"KVATLAS_REPLICA_ID": "r9"})
    assert flag_wins.group_name == "kvatlas-r8"
    assert parse_config(["--consumer-heartbeat-s", "2.5"]).consumer_heartbeat_s == 2.5
    with pytest.raises(ValueError, match="consumer-heartbeat"):
        CoordinatorConfig(consumer_heartbeat_s=0)


def test_watch_tells_a_live_consumer_from_a_crashed_one(rclient: redis.Redis, stream: str) -> None:
    """``ensure_group_free`` on a real Redis: a consumer that reads again while it is watched
    is live (refused); one that never does is free once idle past the heartbeat."""
    rclient.xgroup_create(stream, "g", id="0", mkstream=True)
    rclient.xreadgroup("g", "live-one", {stream: "0"}, count=1)
    watches: list[float] = []

    def live_one_reads(seconds: float) -> None:  # the other replica reads while we wait
        watches.append(seconds)
        rclient.xreadgroup("g", "live-one", {stream: "0"}, count=1)

    with pytest.raises(GroupHeld, match=r"'g'.*'live-one'.*--replica-id"):
        ensure_group_free(rclient, stream, "g", 3600, sleep=live_one_reads)
    assert watches and set(watches) == {360}  # it watched, a tenth of the heartbeat a time
    ensure_group_free(rclient, stream, "g", 3600, own="live-one", sleep=live_one_reads)

    rclient.xreadgroup("g", "crashed", {stream: "0"}, count=1)  # and never again
    ensure_group_free(rclient, stream, "g", 0.2, own="live-one")  # returns: it is dead
    assert "crashed" in consumers(rclient, stream, "g")  # removed by the joiner, not here


# ------------------------------------------------------------------ processes


class Replica:
    """One ``kvatlas coordinator`` process on the Redis transport, blend lookup on."""

    def __init__(self, redis_url: str, stream: str, snapshot: Path, *flags: str) -> None:
        self.port = free_port()
        self.snapshot = snapshot
        self.flags = [
            "--event-transport", "redis", "--redis-url", redis_url, "--event-stream", stream,
            "--chunk-size", str(C), "--enable-blend-lookup", "--snapshot-path", str(snapshot),
            "--snapshot-interval", "3600", *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, port: int | None = None) -> list[str]:
        port = self.port if port is None else port
        return ["-m", "kvatlas.cli", "coordinator", "--port", str(port), *self.flags]

    def start(self) -> Replica:
        self.proc = spawn_service(self.argv(), self.url)
        return self

    def run_to_exit(self, port: int | None = None) -> subprocess.CompletedProcess[str]:
        """Run these flags as a second process (expected to refuse), to its exit."""
        return subprocess.run(
            [sys.executable, *self.argv(port)], capture_output=True, text=True, timeout=120
        )

    def health(self) -> dict[str, Any]:
        reply: dict[str, Any] = HTTP.get(f"{self.url}/healthz", timeout=10).json()
        return reply

    def position(self) -> str | None:
        position: str | None = self.health()["stream_position"]
        return position

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def full_listing(url: str) -> list[dict[str, Any]]:
    """Every key and its placements, exactly as ``GET /directory/keys`` pages them."""
    out: list[dict[str, Any]] = []
    cursor = None
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            params: dict[str, Any] = {"limit": 200}
            if cursor:
                params["cursor"] = cursor
            reply = client.get("/directory/keys", params=params).json()
            out += reply["keys"]
            cursor = reply["next_cursor"]
            if cursor is None:
                return out


def as_rows(listing: list[dict[str, Any]]) -> set[Any]:
    return {
        (
            ObjectKey.from_wire(item["key"]),
            tuple(
                (p["instance_id"], p["tier"], p["backend"], p["size_bytes"])
                for p in item["placements"]
            ),
        )
        for item in listing
    }


def stream_batches(client: redis.Redis, stream: str) -> list[EventBatch]:
    return [b for _, fields in client.xrange(stream) for b in decode_stream_fields(fields)]  # type: ignore[union-attr]


def oracle(batches: list[EventBatch]) -> KeyDirectory:
    directory = KeyDirectory(C, enable_blend_lookup=True)
    for batch in batches:
        directory.consume(batch)
    return directory


def oracle_rows(directory: KeyDirectory) -> set[Any]:
    rows: set[Any] = set()
    cursor = None
    while True:
        page = directory.list_keys(cursor=cursor, limit=500)
        rows |= {
            (kp.key, tuple((p.instance_id, p.tier, p.backend, p.size_bytes) for p in kp.placements))
            for kp in page.items
        }
        cursor = page.next_cursor
        if cursor is None:
            return rows


def last_id(client: redis.Redis, stream: str) -> str:
    newest: Any = client.xrevrange(stream, count=1)
    return str(newest[0][0].decode())


def caught_up(client: redis.Redis, stream: str, *replicas: Replica) -> bool:
    end = last_id(client, stream)
    return all(r.position() == end for r in replicas)


class Workload:
    """Three nodes emitting through ``EventSink`` on the Redis transport: stores with token
    ids (blend-indexed) in L1 and L2, deletes, accesses; deterministic from ``seed``."""

    def __init__(self, redis_url: str, stream: str, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.docs = [self.rng.integers(0, 5000, C * 4).astype(np.uint32) for _ in range(30)]
        self.sinks = [
            EventSink(f"node-{seed}-{i}", RedisStreamTransport(redis_url, stream), incarnation=1)
            for i in range(3)
        ]
        self.held: list[list[CacheEntry]] = [[] for _ in self.sinks]

    def doc_entries(self, doc: np.ndarray) -> list[CacheEntry]:
        salt = ["", "tenant-b"][int(self.rng.integers(2))]
        return [
            CacheEntry(ObjectKey(h, "m", RANK, 0, salt), 4096, doc[c * C : (c + 1) * C], c * C)
            for c, h in enumerate(chunk_hashes(doc, C))
        ]

    def step(self) -> None:
        i = int(self.rng.integers(len(self.sinks)))
        sink, held = self.sinks[i], self.held[i]
        roll = self.rng.random()
        if held and roll < 0.25:
            victims = [
                held.pop(int(self.rng.integers(len(held)))) for _ in range(min(2, len(held)))
            ]
            sink.emit("delete", "l1", "dram", victims)
        elif held and roll < 0.4:
            sink.emit("access", "l1", "dram", held[: int(self.rng.integers(1, len(held) + 1))])
        else:
            entries = self.doc_entries(self.docs[int(self.rng.integers(len(self.docs)))])
            if roll < 0.55:
                sink.emit("store", "l2", "fs", entries)
            else:
                sink.emit("store", "l1", "dram", entries)
                held.extend(entries)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        assert all(s.flush(60) for s in self.sinks)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close(timeout=5)


@pytest.fixture
def stream(request: pytest.FixtureRequest, rclient: redis.Redis) -> str:
    """The test's stream. The oracles read it whole, so a reader registered at ``0-0`` keeps
    the replicas' retention (``MINID`` to the slowest registered reader) from trimming it."""
    name = f"kvatlas:replicas:{request.node.name}"
    rclient.hset(f"{name}:replicas", "test-oracle", "0-0")
    return name


@pytest.fixture
def replicas(redis_server: RedisServer, stream: str, tmp_path: Path) -> Iterator[Any]:
    """``replicas(name, *flags)`` makes a :class:`Replica` (snapshot ``<name>.snap`` in the
    test's directory); none outlives the test."""
    made: list[Replica] = []

    def make(name: str, *flags: str) -> Replica:
        made.append(Replica(redis_server.url, stream, tmp_path / f"{name}.snap", *flags))
        return made[-1]

    yield make
    for replica in made:
        replica.cleanup()


@pytest.fixture
def workload(redis_server: RedisServer, stream: str) -> Iterator[Any]:
    """``workload(seed)`` makes a :class:`Workload` on the test's stream, closed afterwards."""
    made: list[Workload] = []

    def make(seed: int) -> Workload:
        made.append(Workload(redis_server.url, stream, seed))
        return made[-1]

    yield make
    for work in made:
        work.close()


@pytest.fixture
def rclient(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def consumers(client: redis.Redis, stream: str, group: str) -> list[str]:
    return [name for name, _ in group_consumers(client, stream, group)]


def blend_answers(url: str, queries: list[tuple[np.ndarray, BlendNamespace]]) -> list[Any]:
    out = []
    for query, ns in queries:
        reply = httpx.post(
            f"{url}/directory/blend-lookup",
            json={
                "token_ids": query.tolist(),
                "model_name": ns.model_name,
                "cache_salt": ns.cache_salt,
            },
            timeout=30,
        ).json()
        out.append([(m["chunk_hash"], m["old_st"], m["cur_st"]) for m in reply["matches"]])
    return out


def test_two_replicas_fed_one_stream_hold_identical_directories(
    replicas: Any, workload: Any, rclient: redis.Redis, stream: str
) -> None:
    # Default replica ids: the same host, each its own snapshot file -> each its own group.
    a = replicas("a/directory.snap").start()
    work = workload(seed=3)
    work.run(150)  # b joins later: it replays the history, then follows
    b = replicas("b/directory.snap").start()
    work.run(150)
    groups = {a.health()["consumer_group"], b.health()["consumer_group"]}
    assert len(groups) == 2 and all(g.startswith("kvatlas-") for g in groups)
    assert wait_for(lambda: caught_up(rclient, stream, a, b), timeout=120)

    listing_a, listing_b = full_listing(a.url), full_listing(b.url)
    assert listing_a == listing_b  # every field, in listing order
    expected = oracle(stream_batches(rclient, stream))
    assert as_rows(listing_a) == oracle_rows(expected)
    assert len(listing_a) > 50  # not vacuous: deletes did not empty it

    prefix = np.array([7, 8, 9], np.uint32)
    queries = [
        (np.concatenate([prefix, doc]), BlendNamespace("m", salt))
        for doc in work.docs[:10]
        for salt in ("", "tenant-b")
    ]
    answers = blend_answers(a.url, queries)
    assert answers == blend_answers(b.url, queries)
    want = [
        [(m.chunk_hash.hex(), m.old_st, m.cur_st) for m in expected.blend_match(q, ns)]
        for q, ns in queries
    ]
    assert answers == want and any(want)
    assert a.stop() == 0 and b.stop() == 0


def test_second_replica_with_the_same_id_is_refused_and_the_first_loses_nothing(
    replicas: Any, workload: Any, rclient: redis.Redis, stream: str
) -> None:
    first = replicas("a", "--replica-id", "twin").start()
    second = replicas("b", "--replica-id", "twin")
    work = workload(seed=4)
    work.run(60)
    assert wait_for(lambda: caught_up(rclient, stream, first), timeout=60)
    [live] = consumers(rclient, stream, "kvatlas-twin")

    refused = second.run_to_exit()
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0, out
    assert "kvatlas-twin" in out and live in out and "--replica-id" in out, out
    assert consumers(rclient, stream, "kvatlas-twin") == [live]  # it never joined
    assert not second.snapshot.exists()

    work.run(60)
    assert wait_for(lambda: caught_up(rclient, stream, first), timeout=60)
    assert as_rows(full_listing(first.url)) == oracle_rows(oracle(stream_batches(rclient, stream)))
    assert first.stop() == 0


def test_the_same_id_restarts_after_a_clean_stop_and_after_a_crash(
    replicas: Any, workload: Any, rclient: redis.Redis, stream: str
) -> None:
    group = "kvatlas-phoenix"
    replica = replicas("d", "--replica-id", "phoenix", "--consumer-heartbeat-s", "1").start()
    work = workload(seed=5)
    work.run(40)
    assert wait_for(lambda: caught_up(rclient, stream, replica), timeout=60)
    assert replica.stop() == 0
    assert consumers(rclient, stream, group) == []  # a clean stop leaves the group

    replica.start()  # at once
    work.run(40)
    assert wait_for(lambda: caught_up(rclient, stream, replica), timeout=60)
    [crashed] = consumers(rclient, stream, group)
    replica.stop(signal.SIGKILL)  # its consumer stays behind in the group
    # The restart watches the crashed consumer, which is never seen again: once it is idle
    # past the heartbeat (1 s here), the restart takes the group over and removes it.
    replica.start()
    work.run(40)
    assert wait_for(lambda: caught_up(rclient, stream, replica), timeout=60)
    assert crashed not in consumers(rclient, stream, group)
    assert len(consumers(rclient, stream, group)) == 1
    assert as_rows(full_listing(replica.url)) == oracle_rows(
        oracle(stream_batches(rclient, stream))
    )
    assert replica.stop() == 0


def test_duplicate_with_the_same_flags_on_redis_transport_is_refused_before_joining(
    replicas: Any, workload: Any, rclient: redis.Redis, stream: str
) -> None:
    """Issue 10 item 11 on the Redis transport: the live coordinator misses nothing while a
    duplicate (same port, or same snapshot path) tries to start, and no snapshot is written."""
    live = replicas("directory").start()
    group = live.health()["consumer_group"]
    work = workload(seed=6)
    feeding = threading.Event()
    feeding.set()

    def feed() -> None:  # events flow all along, never faster than the live one applies them
        while feeding.is_set():
            work.run(10)
            wait_for(lambda: not feeding.is_set() or caught_up(rclient, stream, live))

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert wait_for(
            lambda: rclient.xlen(stream) > 0 and live.position() is not None, timeout=60
        )
        [consumer] = consumers(rclient, stream, group)
        same_port = live.run_to_exit()
        assert same_port.returncode != 0
        assert str(live.port) in same_port.stdout + same_port.stderr
        other_port = live.run_to_exit(free_port())
        assert other_port.returncode != 0
        assert "lock" in (other_port.stdout + other_port.stderr).lower()
        assert consumers(rclient, stream, group) == [consumer]
        assert not live.snapshot.exists(), "a refused coordinator wrote a snapshot"
    finally:
        feeding.clear()
        feeder.join(timeout=120)
    assert wait_for(lambda: caught_up(rclient, stream, live), timeout=60)
    expected = oracle_rows(oracle(stream_batches(rclient, stream)))
    assert as_rows(full_listing(live.url)) == expected
    assert live.stop() == 0
    restored = KeyDirectory(C)
    load_snapshot(restored, live.snapshot)
    assert oracle_rows(restored) == expected


# ------------------------------------------------------------------ in-process BackgroundServer


def test_background_server_claims_snapshot_and_group_like_the_cli(
    redis_server: RedisServer, stream: str, tmp_path: Path
) -> None:
    def config(**kw: Any) -> CoordinatorConfig:
        return CoordinatorConfig(port=free_port(), chunk_size=C, **kw)

    redis_flags = {
        "event_transport": "redis",
        "redis_url": redis_server.url,
        "event_stream": stream,
    }
    with (
        BackgroundServer(config(snapshot_path=tmp_path / "s.snap")),
        pytest.raises(OSError, match="lock"),
    ):
        BackgroundServer(config(snapshot_path=tmp_path / "s.snap")).start()
    with BackgroundServer(config(snapshot_path=tmp_path / "s.snap")):  # released on stop
        pass
    with BackgroundServer(config(replica_id="bg", **redis_flags)) as first:
        assert wait_for(lambda: first.service.state == "serving", timeout=30)
        with pytest.raises(GroupHeld, match="kvatlas-bg"):
            BackgroundServer(config(replica_id="bg", **redis_flags)).start()
    with BackgroundServer(config(replica_id="bg", **redis_flags)) as again:  # left on stop
        assert wait_for(lambda: again.service.state == "serving", timeout=30)


def test_a_replica_on_a_quiet_stream_still_shows_itself_alive(
    redis_server: RedisServer, rclient: redis.Redis, stream: str
) -> None:
    """No entry arrives, yet the consumer exists and its idle time keeps being reset (Redis
    7.0 refreshes it only when a read returns something, so the consumer shows itself)."""
    config = CoordinatorConfig(
        port=free_port(),
        chunk_size=C,
        replica_id="quiet",
        consumer_heartbeat_s=2.0,
        event_transport="redis",
        redis_url=redis_server.url,
        event_stream=stream,
    )
    idles: list[int] = []

    def refreshed() -> bool:
        idles.extend(idle for _, idle in group_consumers(rclient, stream, "kvatlas-quiet"))
        return any(later < earlier for earlier, later in itertools.pairwise(idles))

    with BackgroundServer(config):
        assert wait_for(refreshed, timeout=60, interval=0.05), idles
        assert rclient.xlen(stream) == 0


# ------------------------------------------------------------------ departed emitters


def store_in_l1(redis_url: str, stream: str, instance: str, doc: np.ndarray) -> None:
    """``doc``'s chunks stored in ``instance``'s L1, through the stream as a node emits."""
    sink = EventSink(instance, RedisStreamTransport(redis_url, stream), incarnation=1)
    entries = [
        CacheEntry(ObjectKey(h, "m", RANK, 0, ""), 4096, doc[c * C : (c + 1) * C], c * C)
        for c, h in enumerate(chunk_hashes(doc, C))
    ]
    sink.emit("store", "l1", "dram", entries)
    assert sink.flush(30)
    sink.close(timeout=5)


def test_an_emitter_registered_with_another_replica_is_not_forgotten_as_departed(
    redis_server: RedisServer, stream: str
) -> None:
    """A node registers with one replica, its batches reach both. A quiet node past
    ``--emitter-retention-s`` was forgotten by the replica it is not registered with (its
    cursor and L1 copies dropped there, its cache-control commands failed for every replica);
    now only once no replica has it registered (``<stream>:instances``)."""

    def config(replica: str) -> CoordinatorConfig:
        return CoordinatorConfig(
            port=free_port(), chunk_size=C, replica_id=replica, event_transport="redis",
            redis_url=redis_server.url, event_stream=stream, emitter_retention_s=3.0,
            instance_timeout=1e6,
        )  # fmt: skip

    with BackgroundServer(config("a")) as a, BackgroundServer(config("b")) as b:
        assert httpx.post(f"{b.url}/instances", json={"instance_id": "n1"}).status_code == 200
        store_in_l1(redis_server.url, stream, "n1", np.arange(C * 2, dtype=np.uint32) + 100_000)
        for replica in (a, b):
            assert wait_for(lambda r=replica: "n1" in r.service.directory.emitters(), timeout=30)
        quiet_since = time.monotonic()
        # twice the retention, both sweepers running: n1 stays on both replicas
        assert wait_for(lambda: time.monotonic() - quiet_since > 6.0, timeout=30)
        a.service.forget_departed()  # (rate-limited: may do nothing; the sweepers ran)
        assert "n1" in a.service.directory.emitters()
        assert "n1" in b.service.directory.emitters()
        # negative control: deregistered everywhere, it is forgotten by both
        assert httpx.delete(f"{b.url}/instances/n1").status_code == 204
        for replica in (a, b):
            assert wait_for(
                lambda r=replica: "n1" not in r.service.directory.emitters(), timeout=30
            )


def test_a_node_registered_with_another_replica_is_scored_as_its_engine_and_a_peer(
    redis_server: RedisServer, stream: str
) -> None:
    """A node registered with replica B serving engine ``e1`` (``engine_id``): replica A (or
    a router's replica, which knows no registrations) scores the node's copies as ``e1``'s and
    the node as a live peer of the others. (The old code: A knew neither, ``e1`` had no
    reuse.) Negative control: deregistered, A stops within seconds."""

    def config(replica: str) -> CoordinatorConfig:
        return CoordinatorConfig(
            port=free_port(), chunk_size=C, replica_id=replica, event_transport="redis",
            redis_url=redis_server.url, event_stream=stream, instance_timeout=1e6,
        )  # fmt: skip

    with BackgroundServer(config("a")) as a, BackgroundServer(config("b")) as b:
        reg = {"instance_id": "n1", "engine_id": "e1"}
        assert httpx.post(f"{b.url}/instances", json=reg).status_code == 200
        doc = np.arange(C * 2, dtype=np.uint32) + 200_000
        store_in_l1(redis_server.url, stream, "n1", doc)
        body = {"token_ids": doc.tolist(), "model_name": "m", "instances": ["e1", "e2"]}

        def scored() -> dict[str, tuple[int, int]]:
            reply = HTTP.post(f"{a.url}/route/score", json=body, timeout=30).json()
            return {
                r["instance_id"]: (r["prefix_tokens"], r["by_tier"]["peer"])
                for r in reply["instances"]
            }

        # e1: the node's copies as its own (prefix); e2: the node's L1 as a live peer's
        expected = {"e1": (2 * C, 0), "e2": (0, 2 * C)}
        assert wait_for(lambda: scored() == expected, timeout=30), scored()
        assert httpx.delete(f"{b.url}/instances/n1").status_code == 204
        assert wait_for(lambda: scored() == {"e1": (0, 0), "e2": (0, 0)}, timeout=30)
