"""Cache control shared by coordinator replicas through Redis (docs/cache-control.md,
"Replicas"; issue 30 item 2): with the Redis transport, pins, quotas and commands are kept in
Redis, so every replica answers the same; one replica at a time delivers a command (a lease),
and a replica killed while it held one has it taken over once the lease expires.

Real redis-server, real coordinators on loopback (in this process, and one ``kvatlas
coordinator`` process where it must die by ``kill -9``), and a counting MP server on a real
port (``fake_mp_server.py``). Each test uses its own stream name, so its own Redis keys. On a
coordinator that keeps cache control in each process's memory every test here fails but the
negative control, which states that behaviour where Redis is not configured."""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvatlas.api.cache_control import TokenFields
from kvatlas.client import CacheControlClient, CoordinatorError, MPServerClient
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from tests.conftest import RedisServer, wait_for
from tests.coordinator.fake_mp_server import FakeMpServer
from tests.coordinator.helpers import CS, cache_commands
from tests.helpers import spawn_coordinator

_streams = itertools.count()
LEASE_S = 2.0
DOC = list(range(100, 100 + 2 * CS))  # two chunks
SALT = "tenant-a"


def tokens(doc: list[int] = DOC, **more: Any) -> dict[str, Any]:
    return {"model_name": "m", "world_size": 1, "token_ids": doc, "cache_salt": SALT, **more}


def mp_servers(url: str) -> MPServerClient:
    return MPServerClient(url, timeout=5)


@pytest.fixture
def stream(redis_server: RedisServer) -> str:
    return f"kvatlas:cc-test-{next(_streams)}-{free_port()}"


def redis_config(
    redis_server: RedisServer, stream: str, replica: str, **kw: Any
) -> CoordinatorConfig:
    return CoordinatorConfig(
        port=free_port(), chunk_size=CS, event_transport="redis", redis_url=redis_server.url,
        event_stream=stream, replica_id=replica, cache_command_lease_s=LEASE_S,
        instance_timeout=120.0, **kw,
    )  # fmt: skip


@contextmanager
def replicas(*configs: CoordinatorConfig) -> Iterator[list[httpx.Client]]:
    with ExitStack() as stack:
        clients = []
        for config in configs:
            server = stack.enter_context(BackgroundServer(config, mp_servers=mp_servers))
            clients.append(stack.enter_context(httpx.Client(base_url=server.url, timeout=30)))
        yield clients


def pins(client: httpx.Client) -> list[int]:
    r = client.get("/cache/pins", params={"cache_salt": SALT})
    assert r.status_code == 200, r.text
    return [row["pin_count"] for row in r.json()["pins"]]


def commands(client: httpx.Client) -> dict[tuple[str, str], float]:
    return cache_commands(client.get("/metrics").text)


def register(client: httpx.Client, instance_id: str, port: int) -> None:
    body = {"instance_id": instance_id, "ip": "127.0.0.1", "http_port": port}
    assert client.post("/instances", json=body).status_code == 200


# ------------------------------------------------------------------ pins and quotas


def test_pins_and_quotas_set_through_one_replica_are_every_replicas(
    redis_server: RedisServer, stream: str
) -> None:
    a_config = redis_config(redis_server, stream, "a")
    with replicas(a_config, redis_config(redis_server, stream, "b")) as (a, b):
        assert a.post("/cache/pins", json=tokens()).json()["affected"] == 2
        assert pins(b) == [1, 1]  # pinned through A, seen through B
        assert b.post("/cache/pins", json=tokens(DOC[:CS])).status_code == 200
        assert pins(a) == [2, 1]  # one reference count per key, whoever counted
        assert b.request("DELETE", "/cache/pins", json=tokens()).status_code == 200
        assert pins(a) == [1]  # floors at 0: the second key is gone for both
        assert a.put(f"/quota/{SALT}", json={"limit_gb": 1.5}).status_code == 200
        assert b.get(f"/quota/{SALT}").json()["quota_limit_gb"] == 1.5
        assert b.put("/quota/config", json={"default_limit_gb": 0.0}).status_code == 200
        assert a.get("/quota/config").json() == {"default_limit_gb": 0.0}
        assert b.delete(f"/quota/{SALT}").status_code == 200
        assert a.get(f"/quota/{SALT}").json()["quota_exists"] is False
        assert a.delete(f"/quota/{SALT}").json()["status"] == "not_found"  # B removed it
        # a delete without force through B skips the key pinned through A
        node = FakeMpServer()
        node.start()
        try:
            register(b, "n1", node.port)
            r = b.post("/cache/delete", json=tokens(instance_id="n1"))
            assert (r.json()["affected"], r.json()["skipped"]) == (1, 1), r.text
            assert [len(body["keys"]) for _m, _p, body in node.calls] == [1]
        finally:
            node.stop()

    # a replica restarted (no snapshot) answers from Redis
    with replicas(a_config) as (a,):
        assert pins(a) == [1]
        assert a.get("/quota/config").json() == {"default_limit_gb": 0.0}


def test_without_redis_each_replica_keeps_its_own(tmp_path: Path) -> None:
    """The negative control (documented): on the HTTP transport nothing is shared."""

    def http_config() -> CoordinatorConfig:
        return CoordinatorConfig(port=free_port(), chunk_size=CS)

    with replicas(http_config(), http_config()) as (a, b):
        assert a.post("/cache/pins", json=tokens()).status_code == 200
        assert a.put(f"/quota/{SALT}", json={"limit_gb": 1.5}).status_code == 200
        assert (pins(a), pins(b)) == ([1, 1], [])
        assert b.get(f"/quota/{SALT}").json()["quota_exists"] is False


# ------------------------------------------------------------------ commands


def test_a_delete_queued_while_the_node_is_down_is_delivered_once_by_two_replicas(
    redis_server: RedisServer, stream: str
) -> None:
    node = FakeMpServer()  # registered, not listening yet: down
    configs = [redis_config(redis_server, stream, r) for r in ("a", "b")]
    try:
        with replicas(*configs) as (a, b):
            for client in (a, b):
                register(client, "n1", node.port)
            r = a.post("/cache/delete", json=tokens(instance_id="n1"))
            assert r.status_code == 502, r.text  # LMCache's answer; the command is kept
            assert commands(b)[("delete", "pending")] == 1  # and B knows it
            # back, and slow: a delivery is in flight for 1.5 s, three passes of each replica,
            # while the command is still pending (without the lease the other replica sends too)
            node.delay_s = 1.5
            node.start()  # each replica hears of it and finds the command due
            for client in (a, b):
                register(client, "n1", node.port)
            assert wait_for(lambda: commands(b)[("delete", "completed")] == 1, timeout=30)
            assert node.count("DELETE", "/cache/objects") == 1
            # and not again: both replicas keep passing over the finished command
            assert not wait_for(lambda: node.count("DELETE", "/cache/objects") > 1, timeout=2)
            assert commands(a)[("delete", "completed")] == 1
    finally:
        node.stop()


def test_a_command_through_either_replica_reaches_a_node_registered_with_one(
    redis_server: RedisServer, stream: str
) -> None:
    """docs/cache-control.md, "Replicas": every replica answers the same. ``n1`` registered
    with replica A only: a delete sent to B was a 404 ("no MP server registered"), though B
    lists it (``registered: false``) and A delivers B's commands for it. Now B records it
    and A delivers it."""
    node = FakeMpServer()
    node.start()
    configs = [redis_config(redis_server, stream, r) for r in ("a", "b")]
    try:
        with replicas(*configs) as (a, b):
            register(a, "n1", node.port)  # with A only
            # B learns of it through <stream>:instances (shared once a second)
            assert wait_for(lambda: b.post("/cache/delete", json=tokens(instance_id="n1"))
                            .status_code != 404, timeout=30)  # fmt: skip
            assert wait_for(lambda: node.count("DELETE", "/cache/objects") >= 1, timeout=30)
            r = b.post("/cache/delete", json=tokens(instance_id="nobody"))
            assert r.status_code == 404, r.text  # registered nowhere: still unknown
    finally:
        node.stop()


def test_a_replica_killed_while_it_holds_a_command_has_it_taken_over(
    redis_server: RedisServer, stream: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    node = FakeMpServer()
    port_a = free_port()
    procs.append(spawn_coordinator(
        port_a, "--chunk-size", str(CS), "--event-transport", "redis", "--redis-url",
        redis_server.url, "--event-stream", stream, "--replica-id", "a",
        "--cache-command-lease-s", str(LEASE_S), "--instance-timeout", "120",
    ))  # fmt: skip
    try:
        with (
            replicas(redis_config(redis_server, stream, "b")) as (b,),
            httpx.Client(base_url=f"http://127.0.0.1:{port_a}", timeout=30) as a,
        ):
            for client in (a, b):
                register(client, "n1", node.port)
            r = a.post("/cache/prefetches", json=tokens(instance_id="n1"))
            assert r.status_code == 502, r.text  # A holds the command (its lease)
            request_id = r.json()["request_id"]
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(timeout=30)
            node.start()
            register(b, "n1", node.port)  # due now; B may take it once A's lease lapsed
            status = f"/cache/prefetches/n1/{request_id}"
            assert b.get(status).json() == {"status": "pending"}  # B knows A's command
            assert wait_for(lambda: b.get(status).json()["status"] == "completed", timeout=30)
            assert node.count("POST", "/cache/prefetches") == 1
            assert b.get(status).json() == {"status": "completed", "found_keys": 0, "total_keys": 2}
    finally:
        node.stop()


def test_a_replica_restarted_after_kill_9_takes_its_own_leases_at_once(
    redis_server: RedisServer, stream: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A replica killed (-9) while it holds a command's lease, restarted under the same
    replica id: once it holds its consumer group again, its previous run is known gone, and
    the leases that run held are its own — the command is delivered at once, not after the
    lease lapses (here 120 s; the old code waited it out)."""
    node = FakeMpServer()
    port = free_port()
    flags = ["--chunk-size", str(CS), "--event-transport", "redis", "--redis-url",
             redis_server.url, "--event-stream", stream, "--replica-id", "a",
             "--cache-command-lease-s", "120", "--consumer-heartbeat-s", "1",
             "--instance-timeout", "120"]  # fmt: skip
    procs.append(spawn_coordinator(port, *flags))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as a:
            register(a, "n1", node.port)
            r = a.post("/cache/prefetches", json=tokens(instance_id="n1"))
            assert r.status_code == 502, r.text  # the run holds the command's lease
            status = f"/cache/prefetches/n1/{r.json()['request_id']}"
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(timeout=30)
            node.start()
            procs.append(spawn_coordinator(port, *flags))
            register(a, "n1", node.port)  # back: its commands are due now
            assert wait_for(lambda: a.get(status).json()["status"] == "completed", timeout=60)
            assert node.count("POST", "/cache/prefetches") == 1
    finally:
        node.stop()


def test_prefetch_502_names_the_command_that_is_kept(stream: str) -> None:
    """Item 2 of the brief: LMCache's 502 (status and ``detail``) plus the ``request_id`` of
    the command kept for retry, whose status reads ``pending`` until it is delivered."""
    node = FakeMpServer()
    try:
        with replicas(CoordinatorConfig(port=free_port(), chunk_size=CS)) as (c,):
            register(c, "n1", node.port)
            r = c.post("/cache/prefetches", json=tokens(instance_id="n1"))
            assert r.status_code == 502, r.text
            body = r.json()
            assert body["detail"].startswith("prefetch submit to 'n1' failed")
            status = f"/cache/prefetches/n1/{body['request_id']}"
            assert c.get(status).json() == {"status": "pending"}
            # the typed client (and `kvatlas cache prefetch`) says which command was kept
            kept = r"kept for retry: request_id [0-9a-f]{32}"
            with (
                CacheControlClient(str(c.base_url)) as client,
                pytest.raises(CoordinatorError, match=kept),
            ):
                client.prefetch(
                    "n1", TokenFields(model_name="m", world_size=1, token_ids=DOC, cache_salt=SALT)
                )
            node.start()
            register(c, "n1", node.port)
            assert wait_for(lambda: c.get(status).json()["status"] == "completed", timeout=30)
            assert wait_for(lambda: commands(c)[("prefetch", "completed")] == 2, timeout=30)
            assert node.count("POST", "/cache/prefetches") == 2  # each command, once
    finally:
        node.stop()


# ------------------------------------------------------------------ restart: Redis wins


def test_the_snapshot_seeds_an_empty_redis_and_never_overrides_it(
    redis_server: RedisServer, stream: str, tmp_path: Path
) -> None:
    snapshot = tmp_path / "a.snap"
    # a coordinator on the HTTP transport pins a document and writes its snapshot
    with replicas(CoordinatorConfig(port=free_port(), chunk_size=CS, snapshot_path=snapshot)) as (
        c,
    ):
        assert c.post("/cache/pins", json=tokens()).status_code == 200
        assert c.put(f"/quota/{SALT}", json={"limit_gb": 2.0}).status_code == 200
    # moved to Redis: the snapshot seeds the empty Redis
    a_config = redis_config(redis_server, stream, "a", snapshot_path=snapshot)
    with replicas(a_config, redis_config(redis_server, stream, "b")) as (a, b):
        assert wait_for(lambda: pins(b) == [1, 1], timeout=30)
        assert b.get(f"/quota/{SALT}").json()["quota_limit_gb"] == 2.0
    # A's snapshot (written as it stopped) still holds the pins and the quota; meanwhile
    # the fleet unpins and removes the quota through B: A restarts with Redis's state
    with replicas(redis_config(redis_server, stream, "b")) as (b,):
        assert b.request("DELETE", "/cache/pins", json=tokens()).status_code == 200
        assert b.delete(f"/quota/{SALT}").status_code == 200
    with replicas(a_config) as (a,):
        assert pins(a) == []
        assert a.get(f"/quota/{SALT}").json()["quota_exists"] is False
    admin = redis.Redis.from_url(redis_server.url)
    try:
        assert admin.hget(f"{stream}:cache:meta", "seeded") is not None
    finally:
        admin.close()


def metric(client: httpx.Client, name: str) -> float:
    """A counter or gauge without labels on ``client``'s ``/metrics`` (0 when absent)."""
    found = re.search(rf"^{name} ([0-9.e+]+)$", client.get("/metrics").text, re.M)
    return float(found[1]) if found else 0.0


def test_a_redis_that_loses_the_state_while_the_replicas_run_is_seeded_again(
    tmp_path: Path, stream: str
) -> None:
    """docs/cache-control.md, "Restart and snapshots": Redis loses its data (FLUSHALL) while
    both replicas run. The old code seeded Redis only at start-up: pins, quotas and the
    pending delete were gone for good (the replicas' next snapshots copied the empty state).
    Now the first replica to notice seeds Redis again from its last copy (read from Redis at
    its last snapshot before the loss; a snapshot every 0.2 s, so several are taken between
    the loss and the seed and must keep that copy), counted once across the replicas."""
    server = RedisServer(tmp_path)  # this test's own: it is flushed mid-test
    server.start()
    node = FakeMpServer()  # registered, never listening: the delete stays unfinished
    admin = redis.Redis.from_url(server.url)
    configs = [
        redis_config(server, stream, r, snapshot_path=tmp_path / f"{r}.snap",
                     snapshot_interval=0.2)
        for r in ("a", "b")
    ]  # fmt: skip
    try:
        with replicas(*configs) as (a, b):
            for client in (a, b):
                register(client, "n1", node.port)
            assert a.post("/cache/pins", json=tokens()).status_code == 200
            assert a.put(f"/quota/{SALT}", json={"limit_gb": 1.5}).status_code == 200
            assert b.put("/quota/config", json={"default_limit_gb": 4.0}).status_code == 200
            r = b.post("/cache/delete", json=tokens(instance_id="n1", force=True))
            assert r.status_code == 502, r.text  # kept for retry

            def unfinished(client: httpx.Client) -> float:
                return sum(n for (kind, state), n in commands(client).items()
                           if kind == "delete" and state in ("pending", "sent"))  # fmt: skip

            assert unfinished(a) == 1
            # each replica's copy: a snapshot begun after the changes (the second from now)
            taken = {c: metric(c, "kvatlas_snapshots_total") for c in (a, b)}
            assert wait_for(
                lambda: all(metric(c, "kvatlas_snapshots_total") >= n + 2
                            for c, n in taken.items()), timeout=30,
            )  # fmt: skip
            admin.flushall()  # the data lost while both replicas run
            assert wait_for(lambda: pins(b) == [1, 1], timeout=30), pins(b)
            assert pins(a) == [1, 1]
            assert a.get(f"/quota/{SALT}").json()["quota_limit_gb"] == 1.5
            assert a.get("/quota/config").json() == {"default_limit_gb": 4.0}
            assert unfinished(b) == 1
            reseeds = [metric(c, "kvatlas_cache_store_reseeds_total") for c in (a, b)]
            assert sorted(reseeds) == [0.0, 1.0], reseeds  # one replica seeded, once
            assert admin.hget(f"{stream}:cache:meta", "seeded") is not None
    finally:
        admin.close()
        node.stop()
        server.stop()


# ------------------------------------------------------------------ Redis away


def test_while_redis_is_away_cache_control_answers_503_and_nothing_else_breaks(
    tmp_path: Path, stream: str
) -> None:
    """Pins are refused with a clear 503 while Redis is down (nothing applied), a node still
    registers, /metrics still answers; when Redis is back (with its data) the pins are there."""
    server = RedisServer(tmp_path)  # this test's own: it is stopped mid-test
    server.start()
    try:
        with replicas(redis_config(server, stream, "a")) as (a,):
            assert a.post("/cache/pins", json=tokens()).status_code == 200
            server.stop()
            r = a.post("/cache/pins", json=tokens())
            assert r.status_code == 503 and "cache-control store" in r.json()["detail"], r.text
            assert a.get("/cache/pins", params={"cache_salt": SALT}).status_code == 503
            register(a, "n1", free_port())  # a registration does not need cache control
            metrics = a.get("/metrics")
            assert metrics.status_code == 200 and "kvatlas_cache_commands" not in metrics.text
            server.start()
            assert wait_for(
                lambda: a.get("/cache/pins", params={"cache_salt": SALT}).status_code == 200
            )
            assert pins(a) == [1, 1]  # the one acknowledged pin, not the refused one
    finally:
        server.stop()
