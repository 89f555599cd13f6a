"""Start order does not matter (issue 11): a node started before its coordinator serves its
local tiers, retries with capped, jittered backoff (logged once per step, counted), registers
when the coordinator appears and re-reports what it holds; the compatibility check still runs
at first contact, and a mismatch then still stops the node with a clear error (exit 2)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvatlas.api import HealthReply
from kvatlas.client import CoordinatorClient, CoordinatorError, HttpTransport
from kvatlas.coordinator.server import free_port
from kvatlas.errors import Conflict
from kvatlas.keys import KeyScheme, ObjectKey, RequestTracker
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.server import Registrar, follow_coordinator_format
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import is_healthy, spawn_service, stop
from tests.conftest import HTTP, wait_for

C = 16
MODEL_FLAGS = [
    "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
    "--chunk-size", str(C), "--dtype", "float32", "--log-level", "info",
]  # fmt: skip
CONFIG = NodeConfig(
    model_name="toy", num_layers=2, num_kv_heads=2, head_dim=16, chunk_size=C, dtype="float32"
)


def keys_of(tokens: np.ndarray) -> list[ObjectKey]:
    tracker = RequestTracker(tokens, (), scheme=KeyScheme("blake3", C))
    return [ObjectKey(h, "toy", CONFIG.kv_rank, 0, "") for h in tracker.chunk_hashes()]


def node_args(port: int, coord_port: int, l2_path: Path) -> list[str]:
    return [
        sys.executable, "-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "n1",
        "--coordinator-url", f"http://127.0.0.1:{coord_port}", "--coordinator-event-reporting",
        "--l2", "fs", "--l2-path", str(l2_path), "--coordinator-retry-max-s", "0.5", *MODEL_FLAGS,
    ]  # fmt: skip


def coordinator_args(port: int, chunk_size: int = C) -> list[str]:
    return ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size",
            str(chunk_size), "--log-level", "warning"]  # fmt: skip


def test_node_first_serves_locally_then_registers_and_reports_its_placements(
    tmp_path: Path,
) -> None:
    port, coord_port = free_port(), free_port()
    url, coord = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{coord_port}"
    log_file = (tmp_path / "node.log").open("wb")
    node = subprocess.Popen(node_args(port, coord_port, tmp_path), stdout=log_file, stderr=log_file)
    procs: list[subprocess.Popen[bytes]] = [node]
    client = NodeEngineClient(url, CONFIG.layout, timeout=60)
    try:
        assert wait_for(lambda: is_healthy(url, HTTP) or node.poll() is not None, timeout=60)
        assert node.poll() is None, (tmp_path / "node.log").read_text()
        model = ToyRopeModel(CONFIG.layout)
        tokens = np.random.default_rng(3).integers(0, 500, 3 * C).astype(np.uint32)
        assert client.store(tokens, model.kv_chunks(tokens)) == 3  # no coordinator yet
        assert client.lookup(tokens) == 3 * C
        kv, sources = client.retrieve(tokens)
        assert sources == {"local_l1": 3} and len(kv) == 3

        procs.append(spawn_service(coordinator_args(coord_port), coord))  # now it appears
        keys = keys_of(tokens)

        def placements() -> set[tuple[ObjectKey, str]]:
            with CoordinatorClient(coord) as c:
                found = [r.placements for r in c.lookup_keys(keys).results]
            return {
                (k, p.tier) for k, pls in zip(keys, found, strict=True) for p in pls
                if p.instance_id == "n1"
            }  # fmt: skip

        assert wait_for(lambda: placements() == {(k, t) for k in keys for t in ("l1", "l2")},
                        timeout=60)  # fmt: skip
        instances = httpx.get(f"{coord}/instances").json()["instances"]
        assert [i["instance_id"] for i in instances] == ["n1"]
        # the digest exchange after registering may show the placements first: wait for the
        # inventory report itself (3 chunks x (L1, L2))
        assert wait_for(lambda: client.stats().get("inventory_reported") == 6, timeout=60)
        assert client.stats()["coordinator_contact_failures"] >= 1
        assert client.retrieve(tokens)[1] == {"local_l1": 3}  # still served
    finally:
        client.close()
        stop(procs)
        log_file.close()
    text = (tmp_path / "node.log").read_text()
    assert "registered with" in text and node.returncode == 0, text


def test_a_mismatch_found_at_late_first_contact_stops_the_node(tmp_path: Path) -> None:
    port, coord_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    node = subprocess.Popen(
        node_args(port, coord_port, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    coordinator = None
    try:
        assert wait_for(lambda: is_healthy(url, HTTP) or node.poll() is not None, timeout=60)
        assert node.poll() is None
        coordinator = spawn_service(
            coordinator_args(coord_port, chunk_size=2 * C), f"http://127.0.0.1:{coord_port}"
        )
        try:
            out, _ = node.communicate(timeout=120)  # a wide bound: the bug is "runs on"
        except subprocess.TimeoutExpired:
            node.kill()
            out, _ = node.communicate()
            pytest.fail(f"node kept running despite the chunk size mismatch:\n{out.decode()}")
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
        if coordinator is not None:
            stop([coordinator])
    text = out.decode()
    assert node.returncode == 2, text
    assert "key scheme mismatch" in text and "blake3/16" in text and "blake3/32" in text, text


def test_registrar_backs_off_capped_and_logs_once_per_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = CoordinatorClient(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    registered: list[bool] = []
    registrar = Registrar(
        dead, CONFIG, "n1", on_registered=lambda: registered.append(True),
        on_fatal=lambda exc: None, initial=0.01, retry_max=0.04, jitter=lambda: 0.0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvatlas.node.server"):
        registrar.start()
        try:
            assert wait_for(lambda: registrar.attempts >= 10, timeout=60)
        finally:
            registrar.stop()
            dead.close()
    warnings = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    # steps 0.01, 0.02, 0.04 (the cap): one line each, however many attempts
    assert len(warnings) == 3, warnings
    assert ["0.01 s" in warnings[0], "0.02 s" in warnings[1], "0.04 s" in warnings[2]] == [True] * 3
    assert registrar.counters["coordinator_contact_failures"] == registrar.attempts
    assert not registered and not registrar.registered.is_set()


class _Refusing:
    """A coordinator that answers, and says no (401: a bad token)."""

    def health(self) -> HealthReply:
        raise CoordinatorError("GET /healthz: 401 unknown bearer token", 401)


class _LMCacheLike:
    """A coordinator that answers like LMCache's: no key scheme in /healthz."""

    def __init__(self) -> None:
        self.registered = False

    def health(self) -> HealthReply:
        return HealthReply(status="healthy")

    def register(self, instance_id: str | None, **_fields: object) -> str:
        self.registered = True
        return instance_id or "n1"


def test_a_refusal_reached_late_stops_the_node_like_one_at_start() -> None:
    """A coordinator reached only after start-up that answers 4xx (bad token, refused id or
    chunk size) is a mismatch, as at start (exit 2), not "not up yet" retried for ever."""
    fatal: list[Conflict] = []
    registrar = Registrar(
        _Refusing(), CONFIG, "n1", on_registered=lambda: None,  # type: ignore[arg-type]
        on_fatal=fatal.append, initial=0.01, retry_max=0.02, jitter=lambda: 0.0,
    )  # fmt: skip
    registrar.start()
    try:
        assert wait_for(lambda: bool(fatal), timeout=30), "a 401 was retried, never refused"
    finally:
        registrar.stop()
    assert "401" in str(fatal[0]) and registrar.fatal is fatal[0]
    assert registrar.attempts == 1


class _BusyOnce(_LMCacheLike):
    """A coordinator that first answers "not now" (408: the request was too slow to arrive;
    429: too many requests), then like LMCache's."""

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status: int | None = status

    def health(self) -> HealthReply:
        status, self.status = self.status, None
        if status is not None:
            raise CoordinatorError(f"GET /healthz: {status} try again", status)
        return super().health()


@pytest.mark.parametrize("status", [408, 429])
def test_a_coordinator_that_asks_to_try_again_is_retried(status: int) -> None:
    """408 and 429 say "later", not "no": the node retries rather than stopping."""
    fatal: list[Conflict] = []
    client = _BusyOnce(status)
    registrar = Registrar(
        client, CONFIG, "n1", on_registered=lambda: None,  # type: ignore[arg-type]
        on_fatal=fatal.append, initial=0.01, retry_max=0.02, jitter=lambda: 0.0,
    )  # fmt: skip
    registrar.start()
    try:
        assert wait_for(registrar.registered.is_set, timeout=30), fatal
    finally:
        registrar.stop()
    assert client.registered and not fatal and registrar.attempts == 2


def test_a_late_lmcache_coordinator_gets_json_events() -> None:
    """The event format follows the coordinator's /healthz when it is first reached late too:
    LMCache's coordinator reads JSON events only."""
    seen: list[HealthReply] = []
    client = _LMCacheLike()
    registrar = Registrar(
        client, CONFIG, "n1", on_registered=lambda: None,  # type: ignore[arg-type]
        on_fatal=lambda exc: None, on_health=seen.append,
    )  # fmt: skip
    registrar.attempt()
    assert client.registered and seen == [HealthReply(status="healthy")]
    transport = HttpTransport("http://127.0.0.1:1")
    follow_coordinator_format(transport, HealthReply(status="healthy"))
    assert transport.fmt == "json"
    follow_coordinator_format(transport, HealthReply(hash_scheme="blake3", chunk_size=16))
    assert transport.fmt == "json"  # never back: one coordinator per node
