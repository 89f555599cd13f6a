"""The soak's fleet as real processes: a redis-server, two coordinator replicas on the Redis
transport and four cache nodes (three with a small private fs L2, one on a shared fs pool),
each of which can be killed (``SIGKILL``), restarted with the same identity and state
directories, paused (``SIGSTOP``) and resumed (``SIGCONT``)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from kvatlas.asgi_thread import free_port
from kvatlas.node import NodeConfig
from kvatlas.processes import spawn_service

LAYOUT_FLAGS: dict[str, Any] = dict(
    model_name="soak-model", num_layers=2, num_kv_heads=2, head_dim=32, chunk_size=64,
    dtype="float32",
)  # fmt: skip
STREAM = "kvatlas:soak"
POOL = "soak-pool"  # the node on the shared pool
PRIVATE_NODES = ("soak-n1", "soak-n2", "soak-n3")
REPLICAS = ("soak-r1", "soak-r2")
L2_BACKENDS = {False: "fs", True: "fs-shared"}
START_TIMEOUT_S = 180.0  # a loaded 2-core machine starting seven processes at once is slow  # the node's L2 backend names (node/server.py)


@dataclass(frozen=True)
class FleetSettings:
    """Timings and caps of the run (short, so that a fault is repaired within seconds)."""

    heartbeat: float = 1.0
    digest_interval: float = 2.0
    instance_timeout: float = 3.0
    snapshot_interval: float = 5.0
    stream_max_len: int = 2000
    l1_chunks: int = 24
    l2_chunks: int = 40

    @property
    def chunk_bytes(self) -> int:
        return NodeConfig(**LAYOUT_FLAGS).layout.chunk_bytes

    @property
    def l2_max_bytes(self) -> int:
        return self.l2_chunks * self.chunk_bytes

    @property
    def convergence_target(self) -> float:
        """2x the heartbeat/digest interval (issue 11's target)."""
        return 2 * max(self.heartbeat, self.digest_interval)


class RedisProcess:
    """redis-server from the distribution's package, on a free port, with an append-only file
    fsynced on every write: a restart (even after ``SIGKILL``) keeps every acknowledged
    stream entry, consumer group and retention record, as a deployment that treats the stream
    as the directory's durable log must."""

    def __init__(self, workdir: Path, log: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found (install the distribution's package)")
        self.binary, self.workdir, self.log = binary, workdir, log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)

    def start(self) -> None:
        with open(self.log, "ab") as sink:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--dir", str(self.workdir), "--save", "", "--appendonly", "yes",
                 "--appendfsync", "always"],
                stdout=sink, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


class Service:
    """One kvatlas process (a replica or a node) with a fixed command line."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path) -> None:
        self.name, self.argv, self.port, self.log = name, argv, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = spawn_service(
            ["-m", "kvatlas.cli", *self.argv], self.url, timeout=START_TIMEOUT_S, log=self.log
        )

    def kill(self) -> None:
        """``kill -9``: no shutdown path runs (no flush, no deregistration)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


class SoakFleet:
    """The processes of one run under ``root`` (redis data, snapshots, L2 directories, logs).
    Nodes ``soak-n1``/``soak-n2`` talk to replica ``soak-r1``, ``soak-n3`` and the pool node
    to ``soak-r2``; every node emits on the one stream, so both replicas see every event."""

    def __init__(self, root: Path, settings: FleetSettings) -> None:
        self.root, self.settings = root, settings
        (root / "logs").mkdir(parents=True, exist_ok=True)
        self.redis = RedisProcess(root / "redis", root / "logs" / "redis.log")
        self.l2_root = root / "l2"
        self.pool_dir = root / "pool"
        s = settings
        self.replicas: dict[str, Service] = {}
        for rid in REPLICAS:
            port = free_port()
            argv = [
                "coordinator", "--port", str(port), "--chunk-size", str(LAYOUT_FLAGS["chunk_size"]),
                "--event-transport", "redis", "--redis-url", self.redis.url,
                "--event-stream", STREAM, "--replica-id", rid,
                "--snapshot-path", str(root / rid / "directory.snap"),
                "--snapshot-interval", str(s.snapshot_interval),
                "--instance-timeout", str(s.instance_timeout), "--consumer-heartbeat-s", "1",
                "--log-level", "warning",
            ]  # fmt: skip
            (root / rid).mkdir(exist_ok=True)
            self.replicas[rid] = Service(rid, argv, port, root / "logs" / f"{rid}.log")
        layout = [f"--{k.replace('_', '-')}={v}" for k, v in LAYOUT_FLAGS.items()]
        self.nodes: dict[str, Service] = {}
        for i, name in enumerate((*PRIVATE_NODES, POOL)):
            port = free_port()
            replica = self.replicas[REPLICAS[0] if i < 2 else REPLICAS[1]]
            if name == POOL:
                l2 = ["--l2", "fs", "--l2-shared", "--l2-path", str(self.pool_dir)]
            else:
                l2 = ["--l2", "fs", "--l2-path", str(self.l2_root),
                      "--l2-max-bytes", str(s.l2_max_bytes)]  # fmt: skip
            argv = [
                "node", "--port", str(port), "--instance-id", name,
                "--coordinator-url", replica.url, "--coordinator-event-reporting",
                "--event-transport", "redis", "--redis-url", self.redis.url,
                "--event-stream", STREAM, "--stream-max-len", str(s.stream_max_len),
                "--digest-interval-s", str(s.digest_interval),
                "--heartbeat-interval-s", str(s.heartbeat), "--coordinator-retry-max-s", "1",
                "--l1-bytes", str(s.l1_chunks * s.chunk_bytes), "--peer-fetch-deadline-s", "1",
                "--log-level", "warning", *l2, *layout,
            ]  # fmt: skip
            self.nodes[name] = Service(name, argv, port, root / "logs" / f"{name}.log")

    def l2_dir(self, node: str) -> Path:
        """Where a node's files are: its private fs L2, or the shared pool."""
        return self.pool_dir if node == POOL else self.l2_root / node

    def start(self) -> None:
        """Redis, then the replicas, then the nodes (each group started side by side)."""
        self.redis.start()
        for group in (self.replicas, self.nodes):
            with ThreadPoolExecutor(len(group)) as pool:
                list(pool.map(Service.start, group.values()))

    def stop(self) -> None:
        """The nodes, then the replicas (each group stopped side by side), then Redis."""
        for group in (self.nodes, self.replicas):
            with ThreadPoolExecutor(len(group)) as pool:
                list(pool.map(Service.stop, group.values()))
        self.redis.kill()
