"""SIGTERM (what systemd and Kubernetes send) does the same shutdown work as SIGINT, on real
processes: the coordinator writes its shutdown snapshot, the node flushes its event outbox and
deregisters, and both exit 0."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.server import free_port
from kvatlas.directory import KeyDirectory, load_snapshot
from kvatlas.events import CacheEntry
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service
from tests.helpers import TOY_LAYOUT

C = 16
MODEL_FLAGS = [
    "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
    "--chunk-size", str(C), "--dtype", "float32",
]  # fmt: skip
SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


def spawn(args: list[str], port: int) -> subprocess.Popen[bytes]:
    return spawn_service(["-m", "kvatlas.cli", *args], f"http://127.0.0.1:{port}")


def coordinator(port: int, *extra: str) -> subprocess.Popen[bytes]:
    flags = ["--port", str(port), "--chunk-size", str(C), "--log-level", "warning", *extra]
    return spawn(["coordinator", *flags], port)


def signal_and_wait(proc: subprocess.Popen[bytes], sig: signal.Signals) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", SIGNALS)
def test_coordinator_writes_its_shutdown_snapshot(tmp_path: Path, sig: signal.Signals) -> None:
    port, snap = free_port(), tmp_path / "directory.snap"
    # A long interval: the only snapshot that can exist is the shutdown one.
    proc = coordinator(port, "--snapshot-path", str(snap), "--snapshot-interval", "3600")
    rows = np.random.default_rng(0).integers(0, 1000, (3, C)).astype(np.uint32)
    keys = [ObjectKey(chunk_hashes(r, C)[0], "m", pack_kv_rank(1, 0, 1, 0)) for r in rows]
    sink = EventSink("emitter", HttpTransport(f"http://127.0.0.1:{port}"), backoff_max=0.2)
    try:
        batch = [CacheEntry(k, 64, r, 0) for k, r in zip(keys, rows, strict=True)]
        sink.emit("store", "l1", "dram", batch)
        assert sink.flush(30)
        assert httpx.get(f"http://127.0.0.1:{port}/directory/stats").json()["keys"] == 3
        assert not snap.exists()
        code = signal_and_wait(proc, sig)
    finally:
        sink.close(timeout=1)
        if proc.poll() is None:
            proc.kill()
    assert snap.exists(), f"no shutdown snapshot after {sig.name} (exit {code})"
    assert code == 0
    restored = KeyDirectory(C)
    assert load_snapshot(restored, snap).keys == 3
    assert all(p for p in restored.lookup(keys))


@pytest.mark.parametrize("sig", SIGNALS)
def test_node_flushes_its_outbox_and_deregisters(tmp_path: Path, sig: signal.Signals) -> None:
    coord_port, node_port = free_port(), free_port()
    coord_url = f"http://127.0.0.1:{coord_port}"
    # No instance expires on its own during the test: only a deregistration removes the node.
    coord = coordinator(coord_port, "--instance-timeout", "3600")
    node = None
    try:
        node_flags = [
            "--port", str(node_port), "--instance-id", "node-a", "--coordinator-url", coord_url,
            "--coordinator-event-reporting", *MODEL_FLAGS, "--l2", "fs",
            "--l2-path", str(tmp_path / "l2"), "--log-level", "warning",
        ]  # fmt: skip
        node = spawn(["node", *node_flags], node_port)
        registered = httpx.get(f"{coord_url}/instances").json()["instances"]
        assert [row["instance_id"] for row in registered] == ["node-a"]
        layout = TOY_LAYOUT
        tokens = np.random.default_rng(1).integers(0, 500, 3 * C).astype(np.uint32)
        client = NodeEngineClient(f"http://127.0.0.1:{node_port}", layout)
        try:
            assert client.store(tokens, ToyRopeModel(layout).kv_chunks(tokens), request_id="r") == 3
        finally:
            client.close()
        code = signal_and_wait(node, sig)  # straight away: the outbox may still hold events
        assert httpx.get(f"{coord_url}/instances").json()["instances"] == []  # deregistered
        # Deregistration fences L1; the L2 placements stay, so they show the events arrived.
        assert httpx.get(f"{coord_url}/directory/stats").json()["keys"] == 3
        assert code == 0
    finally:
        for proc in (node, coord):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
