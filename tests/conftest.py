"""Shared fixtures: a real redis-server started by the suite itself on a free port."""

from __future__ import annotations

import gc
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.numba_cache import use_keyed_cache, wait_until_warm, warm_for_workers

use_keyed_cache()  # before anything imports numba (tests/numba_cache.py says why)

from kvatlas import http_guard  # noqa: E402
from kvatlas.asgi_thread import free_port  # noqa: E402
from kvatlas.processes import stop  # noqa: E402
from tests.torch_support import torch_import_error, torch_status  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """A run on several workers (``-n``) warms the numba cache once for all of them, while
    they start (tests/numba_cache.py, ``warm_for_workers``)."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        warm_for_workers()


@pytest.fixture(scope="session", autouse=True)
def _kernels_warm() -> None:
    """A worker's first test waits until the run's warm-up compiled the kernels."""
    wait_until_warm()


def pytest_report_header() -> str:
    """Say up front whether the torch-path tests run (they never skip silently)."""
    return torch_status()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test has its own id. pytest-xdist schedules tests by id, so tests sharing one
    would run once: schemathesis names each operation's test ``name[METHOD /path]`` but leaves
    them all the id of the function (tests/coordinator/test_fuzz.py, 19 operations)."""
    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.parent is not None:
            # pytest 9 builds an item's id from its function name and parametrization, not
            # from its name: give it the id its name says (``test[POST /events]``)
            base, _, params = item.name.partition("[")
            item._id = item.parent.id.child(base).with_params(params.removesuffix("]") or None)
    shared = [nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1]
    if shared:
        raise pytest.UsageError(f"tests sharing an id would run once under xdist: {shared}")
    # the longest files first (each file's tests in their order): xdist hands out files in
    # this order, so neither worker is left with a long file at the end while the other idles
    first = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


LONG_FILES = (
    "tests/coordinator/test_replicas.py",  # 60 s
    "tests/soak/test_soak.py",  # 45
    "tests/test_security_connections.py",  # 45
    "tests/test_status_page.py",  # 44
    "tests/coordinator/test_redis_outages.py",  # 35
    "tests/coordinator/test_cache_control_delivery.py",  # 35
    "tests/coordinator/test_cache_control_replicas.py",  # 34
    "tests/coordinator/test_cache_control_journal.py",  # 34
    "tests/directory/test_directory_oracle.py",  # 31
    "tests/coordinator/test_fuzz.py",  # 28
    "tests/bench/test_fleet_agreement.py",  # 28
    "tests/bench/test_fleet_live.py",  # 26
    "tests/coordinator/test_cache_control_moves.py",  # 26
    "tests/test_security_one_rule.py",  # 25
    "tests/node/test_fetch_security.py",  # 25
    "tests/test_fleet_docs.py",  # 25
    "tests/router/test_router_replica.py",  # 24
    "tests/bench/test_service_lmcache.py",  # 22
    "tests/directory/test_key_groups.py",  # 20
    "tests/node/test_peer_credentials.py",  # 20
    "tests/kv_events/test_vllm_interop.py",  # 20
    "tests/router/test_bench_router.py",  # 19
    "tests/test_signal_shutdown.py",  # 19
    "tests/node/test_bf16.py",  # 18
    "tests/coordinator/test_redis_transport.py",  # 18
    "tests/kv_events/test_zmq_security.py",  # 17
    "tests/directory/test_fence_columns.py",  # 17
    "tests/kv_events/test_engine_node_link.py",  # 16
    "tests/connector/test_vllm_connector.py",  # 16
    "tests/directory/test_columnar_ingest.py",  # 16
    "tests/lmcache_mp/test_lmcache_server.py",  # 16
    "tests/router/test_router_fleet.py",  # 15
    "tests/directory/test_snapshot_restore.py",  # 15
)
"""Files of 15 s and more (each file's tests, setup and teardown together; the mean of three
runs' `--junitxml` on 2 busy cores), started first, longest first. The others follow in
collection order, where the root's `tests/test_*.py` come after every subdirectory but
`workloads`: left there, the 45 s of `test_security_connections.py` were the run's last file."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, hypothesis, the web stack: millions of objects) lives
    for the whole run: frozen out of the cycle collector's sight, as the coordinator freezes its
    long-lived state (kvatlas/coordinator/runtime.py). A test's ``gc.collect()``, and every
    automatic full collection, then walks what the tests made, not the interpreter (0.5 s per
    full collection before); what a test drops is collected exactly as before."""
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Repeat a missing torch at the end, where ``pytest -q`` (no header) still shows it."""
    if torch_import_error() is not None:
        terminalreporter.write_line(f"warning: {torch_status()}", yellow=True, bold=True)


class RedisServer:
    """A throwaway redis-server process; ``restart`` keeps the port and, with ``persistent``
    (AOF), the data; without, a restart comes back empty. It is only ever stopped with SIGTERM,
    on which Redis writes and syncs its AOF before exiting: so the AOF is synced once a second
    (not after every write, which costs each write a disk flush on a loaded machine) and a
    restart still keeps every acknowledged write."""

    def __init__(self, workdir: Path, *, persistent: bool = True) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not found: `make test` installs it (scripts/ensure-redis.sh)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.workdir),
                "--save", "",
                "--appendonly", "yes" if self.persistent else "no",
                "--appendfsync", "everysec",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each body the guard considered reading straight into its ``bytes`` was."""
    taken: list[bool] = []

    def counted(*args: Any) -> bool:
        taken.append(real(*args))
        return taken[-1]

    real = http_guard.read_rest_directly
    monkeypatch.setattr(http_guard, "read_rest_directly", counted)
    return taken


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts (append them): every one still running is stopped after it."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        stop([p for p in started if p.poll() is None])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


HTTP = httpx.Client(limits=httpx.Limits(keepalive_expiry=1.0))
"""The one HTTP client the tests poll services with (``wait_for(lambda: HTTP.get(...))``):
``httpx.get`` builds a client and its TLS context on every call, ≈40–60 ms of CPU, which a
poll every 10 ms turns into a busy core while services start (a request on this one: ≈0.4 ms).
Same defaults as ``httpx.get`` (5 s timeout, no redirects followed). It drops a connection
idle for 1 s, well before a server closes it (uvicorn: after 5 s idle): a request never
races a server's close of the connection it reuses."""


def wait_for(predicate: object, timeout: float = 30.0, interval: float = 0.01) -> bool:
    """Poll ``predicate()`` until it is truthy or ``timeout`` passes (no sleeps as sync).
    ``timeout`` only guards against a hang: it returns as soon as the predicate holds, and a
    shared 2-core machine can take seconds to run what takes milliseconds when it is quiet."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
