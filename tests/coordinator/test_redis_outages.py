"""Start order and Redis outages for a coordinator on the Redis transport (issue 11;
docs/coordinator.md, "Durability and transports").

A coordinator started before Redis serves its snapshot (``waiting_for_redis``) and joins its
group when Redis appears — the twin check included; a Redis restarted mid-run with persistence
loses nothing and applies nothing twice; one restarted without persistence (stream, group and
unread entries gone) turns the replica to ``resyncing`` until the nodes' digests repaired it;
a node's sink rides through the restart. Real ``kvatlas coordinator`` processes (paused with
SIGSTOP where entries must arrive unread), real redis-server restarts, real HTTP; no
wall-clock assertion.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from kvatlas.asgi_thread import free_port
from kvatlas.client import EventSink, RedisStreamTransport
from kvatlas.coordinator.consumer_group import GroupHeld, ensure_group_free, group_consumers
from kvatlas.events import STORE, CacheEntry
from kvatlas.node.server import NodeProcess
from kvatlas.processes import is_healthy
from tests.conftest import HTTP, RedisServer, wait_for
from tests.coordinator.helpers import CS, wire_key
from tests.coordinator.test_retention import key, node_config, store

STREAM = "kvatlas:events"
_runs = itertools.count()


class Coordinator:
    """One ``kvatlas coordinator`` process on the Redis transport; its output goes to a log
    file that failures show."""

    def __init__(self, tmp_path: Path, redis_url: str, *flags: str) -> None:
        self.port = free_port()
        self.log = tmp_path / "coordinator.log"
        self.argv = [
            sys.executable, "-m", "kvatlas.cli", "coordinator", "--port", str(self.port),
            "--chunk-size", str(CS), "--event-transport", "redis", "--redis-url", redis_url,
            "--event-stream", STREAM, "--snapshot-path", str(tmp_path / "c.snap"),
            "--snapshot-interval", "3600", "--consumer-heartbeat-s", "2", *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Coordinator:
        with self.log.open("ab") as out:
            out.write(f"--- run {next(_runs)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        if not wait_for(lambda: self.exited() or is_healthy(self.url, HTTP), timeout=60):
            pytest.fail(f"the coordinator did not come up:\n{self.output()}")
        if self.exited():
            pytest.fail(f"the coordinator exited ({self.proc.returncode}):\n{self.output()}")
        return self

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def output(self) -> str:
        return self.log.read_text()

    def readiness(self) -> dict[str, Any]:
        reply: dict[str, Any] = HTTP.get(f"{self.url}/readyz", timeout=10).json()
        return reply

    def state(self) -> str:
        return str(self.readiness()["state"])

    def metric(self, line_prefix: str) -> float:
        text = HTTP.get(f"{self.url}/metrics", timeout=10).text
        values = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line_prefix)]
        return values[0] if values else 0.0

    def batches(self) -> dict[str, int]:
        """Batches applied, dropped as duplicates, stale (since this process started)."""
        reply = HTTP.get(f"{self.url}/directory/stats", timeout=10).json()
        return {k: int(reply["batches"].get(k, 0)) for k in ("applied", "duplicate", "stale")}

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.output()

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[Any]]:
    """Coordinators, Redis servers and sinks a test makes; all gone after it."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Coordinator):
            thing.cleanup()
        elif isinstance(thing, RedisServer):
            thing.stop()
        else:
            thing.close()


def fleet(
    tmp_path: Path, made: list[Any], *, persistent: bool
) -> tuple[RedisServer, Coordinator, NodeProcess]:
    """Redis, a coordinator on it (instances live for the whole test) and a node emitting
    through its stream, all started; the test heartbeats and exchanges digests by hand."""
    server = RedisServer(tmp_path, persistent=persistent)
    made.append(server)
    server.start()
    coordinator = Coordinator(tmp_path, server.url, "--instance-timeout", "600")
    made.append(coordinator)
    coordinator.start()
    # nor digest exchanges on a timer: one after a loss would repair it before the test looks
    config = replace(node_config(coordinator.url, server.url, STREAM), digest_interval_s=3600.0)
    node = NodeProcess(config)
    made.append(node)
    assert node.coordinator is not None and node.sink is not None
    node.coordinator.stop_heartbeat()
    return server, coordinator, node


def visible(url: str, *ns: int) -> bool:
    """Every ``key(n)`` has a placement at the coordinator."""
    reply = HTTP.post(
        f"{url}/directory/lookup", json={"keys": [wire_key(key(n).chunk_hash) for n in ns]}
    )
    return all(r["placements"] for r in reply.json()["results"])


def emit(sink: EventSink, *ns: int) -> None:
    for n in ns:
        sink.emit(STORE, "l1", "dram", [CacheEntry(key(n), 1)])


def lines(text: str, pattern: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.search(pattern, ln)]


# ------------------------------------------------------------------ start order


def test_a_coordinator_started_before_redis_serves_its_snapshot_then_joins(
    tmp_path: Path, made: list[Any]
) -> None:
    server = RedisServer(tmp_path)
    made.append(server)
    coordinator = Coordinator(tmp_path, server.url)
    made.append(coordinator)
    server.start()
    sink = EventSink("n1", RedisStreamTransport(server.url, STREAM), incarnation=1)
    made.append(sink)
    emit(sink, 1)
    coordinator.start()
    assert wait_for(lambda: coordinator.readiness()["ready"] and visible(coordinator.url, 1))
    coordinator.stop()  # its snapshot holds key 1
    server.stop()

    coordinator.start()  # Redis is down
    assert wait_for(lambda: coordinator.state() == "waiting_for_redis"), coordinator.output()
    assert coordinator.readiness() == {"ready": False, "state": "waiting_for_redis"}
    assert visible(coordinator.url, 1)  # it serves what it restored
    emit(sink, 2)  # queued by the sink while Redis is down
    # many attempts, few lines: one per new wait length (0.1, 0.2, 0.4, then the 0.5 cap)
    assert wait_for(lambda: coordinator.metric('kvatlas_stream_errors_total{kind="redis"}') >= 8)
    assert len(lines(coordinator.output(), "unavailable")) <= 4, coordinator.output()

    server.start()
    assert wait_for(lambda: coordinator.readiness()["ready"], timeout=30), coordinator.output()
    assert wait_for(lambda: visible(coordinator.url, 1, 2))
    assert sink.flush(30)
    assert coordinator.batches() == {"applied": 1, "duplicate": 0, "stale": 0}


def test_a_twin_waiting_for_redis_stays_out_of_a_group_a_live_replica_holds(
    tmp_path: Path, made: list[Any]
) -> None:
    """Redis comes back with the group of replica ``r1`` and its live consumer; a second
    ``r1`` started while Redis was down must not join it when Redis appears."""
    server = RedisServer(tmp_path)
    made.append(server)
    server.start()
    client = redis.Redis.from_url(server.url)
    made.append(client)
    client.xgroup_create(STREAM, "kvatlas-r1", id="0", mkstream=True)
    client.xadd(STREAM, {"fmt": "json", "data": "{}"})
    # read, not yet acknowledged: the AOF keeps the consumer (one with nothing pending is
    # not kept, and would be a race with the twin)
    client.xreadgroup("kvatlas-r1", "live-one", {STREAM: ">"}, count=1)
    server.stop()

    twin = Coordinator(tmp_path, server.url, "--replica-id", "r1")
    made.append(twin)
    twin.start()
    assert wait_for(lambda: twin.state() == "waiting_for_redis"), twin.output()
    done = threading.Event()

    def live_one() -> None:  # the live replica reads its group as soon as Redis is back
        while not done.wait(0.05):
            with contextlib.suppress(redis.RedisError):
                client.xreadgroup("kvatlas-r1", "live-one", {STREAM: "0"}, count=1)

    reader = threading.Thread(target=live_one, daemon=True)
    reader.start()
    try:
        server.start()
        assert wait_for(lambda: twin.state() == "group_held", timeout=30), twin.output()
        assert twin.metric('kvatlas_stream_errors_total{kind="group_held"}') == 1
        assert [name for name, _ in group_consumers(client, STREAM, "kvatlas-r1")] == ["live-one"]
        assert lines(twin.output(), "held by live consumer 'live-one'"), twin.output()
    finally:
        done.set()
        reader.join(timeout=5)


def test_right_after_a_redis_restart_a_consumer_idle_for_the_outage_is_watched(
    tmp_path: Path, made: list[Any]
) -> None:
    """Restored from an RDB file, a live replica's consumer looks idle for the whole outage
    (it could not show itself): a twin must watch it, not take the group over at once."""
    server = RedisServer(tmp_path, persistent=False)
    made.append(server)
    server.start()
    client = redis.Redis.from_url(server.url)
    made.append(client)
    client.xgroup_create(STREAM, "g", id="0", mkstream=True)
    client.xadd(STREAM, {"fmt": "json", "data": "{}"})
    client.xreadgroup("g", "live-one", {STREAM: ">"}, count=1)
    assert wait_for(lambda: group_consumers(client, STREAM, "g")[0][1] >= 2000, timeout=30)
    client.save()
    server.restart()  # from dump.rdb: the consumer keeps its last-seen time
    assert group_consumers(client, STREAM, "g")[0][1] >= 2000  # idle past the heartbeat

    def live_one_reads(_seconds: float) -> None:  # the live replica is back, reading
        client.xreadgroup("g", "live-one", {STREAM: "0"}, count=1)

    with pytest.raises(GroupHeld, match="live-one"):
        ensure_group_free(client, STREAM, "g", 2.0, sleep=live_one_reads)


def test_a_redis_that_refuses_the_credentials_still_stops_start_up(
    tmp_path: Path, made: list[Any]
) -> None:
    """Not an outage to wait out: a misconfiguration, refused at once (exit 1)."""
    server = RedisServer(tmp_path)
    made.append(server)
    server.start()
    client = redis.Redis.from_url(server.url)
    client.config_set("requirepass", "s3cret")
    client.close()
    coordinator = Coordinator(tmp_path, server.url)
    done = subprocess.run(coordinator.argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "refused this coordinator's credentials" in done.stdout + done.stderr


def test_a_redis_that_appears_refusing_the_credentials_stops_a_waiting_coordinator(
    tmp_path: Path, made: list[Any]
) -> None:
    """The same refusal met by a coordinator started before Redis: it retried for ever,
    ``waiting_for_redis`` although Redis answered. It stops as at start-up (exit 1), having
    served what it restored and taken its shutdown snapshot."""
    server = RedisServer(tmp_path)  # not started yet
    made.append(server)
    # a user this Redis does not have (a wrong password for the default user is no refusal:
    # without requirepass, Redis takes any)
    wrong = f"redis://kvatlas-coordinator:s3cret@127.0.0.1:{server.port}/0"
    coordinator = Coordinator(tmp_path, wrong)
    made.append(coordinator)
    coordinator.start()
    assert wait_for(lambda: coordinator.state() == "waiting_for_redis"), coordinator.output()
    server.start()
    assert wait_for(coordinator.exited, timeout=60), coordinator.output()
    assert coordinator.proc is not None and coordinator.proc.returncode == 1, coordinator.output()
    assert lines(coordinator.output(), "refused this coordinator's credentials")


# ------------------------------------------------------------------ Redis restarts mid-run


def test_a_redis_restart_with_persistence_loses_nothing_and_applies_nothing_twice(
    tmp_path: Path, made: list[Any]
) -> None:
    server = RedisServer(tmp_path)
    made.append(server)
    server.start()
    coordinator = Coordinator(tmp_path, server.url)
    made.append(coordinator)
    coordinator.start()
    sink = EventSink("n1", RedisStreamTransport(server.url, STREAM), incarnation=1)
    made.append(sink)
    emit(sink, *range(1, 6))
    assert wait_for(lambda: visible(coordinator.url, *range(1, 6)))
    coordinator.signal(signal.SIGSTOP)  # entries 6..10 arrive unread (6 may be read already)
    emit(sink, *range(6, 11))
    assert sink.flush(30)
    server.restart()  # AOF: stream, group and the unread entries survive
    coordinator.signal(signal.SIGCONT)
    emit(sink, *range(11, 16))  # the sink rides through the restart
    assert sink.flush(30)
    assert wait_for(lambda: visible(coordinator.url, *range(1, 16)), timeout=30)
    assert coordinator.batches() == {"applied": 15, "duplicate": 0, "stale": 0}
    assert coordinator.readiness() == {"ready": True, "state": "serving"}
    assert coordinator.metric('kvatlas_stream_errors_total{kind="lost"}') == 0


def test_a_redis_restart_without_persistence_resyncs_from_the_nodes(
    tmp_path: Path, made: list[Any]
) -> None:
    server, coordinator, node = fleet(tmp_path, made, persistent=False)
    assert node.coordinator is not None
    first = store(node, 100, 2)
    assert wait_for(lambda: coordinator.readiness()["ready"] and holds(coordinator, first))
    coordinator.stop()  # a snapshot covering `first`, then back
    coordinator.start()
    assert wait_for(lambda: coordinator.readiness()["ready"])
    health = httpx.get(f"{coordinator.url}/healthz").json()
    covered, group = health["stream_position"], health["consumer_group"]
    # The node's digest exchange at registration (retried with backoff while it failed, e.g.
    # across the restart above) must be done: one still pending would repair what this test
    # expects missing until its heartbeat (a suspected cause of the failure below, twice in
    # full runs under load, never reproduced alone)
    resync = node.resync
    assert resync is not None
    assert wait_for(lambda: resync.exchanges >= 1 and not resync.wanted.is_set(), timeout=30)
    coordinator.signal(signal.SIGSTOP)
    # Its pending blocking read takes the next entry into its socket (applied on SIGCONT);
    # what follows stays unread in the stream, then goes with Redis.
    delivered = store(node, 200, 1)
    lost = store(node, 300, 2)
    server.restart()  # empty: stream, group, retention registry, the unread entries
    coordinator.signal(signal.SIGCONT)
    assert wait_for(lambda: coordinator.state() == "resyncing", timeout=30), coordinator.output()
    exchanges = f"node digest exchanges {resync.exchanges}, failed {resync.failures}\n"
    assert holds(coordinator, first + delivered), exchanges + coordinator.output()
    assert not holds(coordinator, lost), exchanges + coordinator.output()
    assert coordinator.metric('kvatlas_stream_errors_total{kind="lost"}') == 1
    # its need is back in the (lost) retention registry: no other replica trims past it
    client = redis.Redis.from_url(server.url)
    made.append(client)
    assert client.hget(f"{STREAM}:replicas", group) == covered.encode()
    node.coordinator.heartbeat()  # the reply asks for a digest exchange
    assert wait_for(lambda: holds(coordinator, first + lost), timeout=30), coordinator.output()
    assert wait_for(lambda: coordinator.readiness()["ready"], timeout=30), coordinator.output()
    later = store(node, 700, 1)  # and it goes on consuming the new stream
    assert wait_for(lambda: holds(coordinator, later))


def test_a_node_keeps_serving_through_a_redis_outage_and_its_events_arrive(
    tmp_path: Path, made: list[Any]
) -> None:
    server, coordinator, node = fleet(tmp_path, made, persistent=False)
    assert node.sink is not None
    assert wait_for(lambda: coordinator.readiness()["ready"])
    server.stop()
    tracker_tokens = list(range(900, 900 + 3 * CS))
    held = store_unflushed(node, tracker_tokens)  # the node stores and serves meanwhile
    assert node.node.lookup(node.node.tracker(token_ids=tracker_tokens)) == 3 * CS
    assert node.sink.pending > 0
    server.start()  # empty
    assert node.sink.flush(30)
    assert wait_for(lambda: holds(coordinator, held), timeout=30), coordinator.output()
    assert node.sink.stats().dropped_batches == 0


def test_batches_a_node_dropped_during_the_outage_are_repaired_by_a_resync(
    tmp_path: Path, made: list[Any]
) -> None:
    server, coordinator, node = fleet(tmp_path, made, persistent=True)
    assert node.sink is not None
    assert wait_for(lambda: coordinator.readiness()["ready"])
    server.stop()
    node.sink.max_outbox = 2  # a small outbox: the outage overflows it
    held = [h for first in (100, 300, 500, 700) for h in store_unflushed(node, [first] * CS)]
    assert node.sink.stats().dropped_batches >= 2
    server.start()
    assert wait_for(lambda: holds(coordinator, held), timeout=60), coordinator.output()


def store_unflushed(process: NodeProcess, tokens: list[int]) -> list[bytes]:
    node = process.node
    tracker = node.tracker(token_ids=tokens)
    kv = np.zeros(node.layout.shape, dtype=node.layout.numpy_dtype())
    n = len(tokens) // CS
    assert node.store(tracker, [kv] * n) == n
    node.flush_events()
    return list(tracker.chunk_hashes())


def holds(coordinator: Coordinator, hashes: list[bytes]) -> bool:
    reply = HTTP.post(
        f"{coordinator.url}/directory/lookup", json={"keys": [wire_key(h) for h in hashes]}
    )
    return all(
        {p["instance_id"] for p in r["placements"]} == {"n1"} for r in reply.json()["results"]
    )
