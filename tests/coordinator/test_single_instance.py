"""A second coordinator on a port in use, or on a snapshot path another coordinator holds, is
refused before it restores, touches Redis or serves, and writes no snapshot (real processes,
real HTTP on loopback; docs/coordinator.md)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.server import free_port
from kvatlas.directory import KeyDirectory, load_snapshot
from kvatlas.events import CacheEntry
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_service

C = 16


def flags(port: int, snap: Path) -> list[str]:
    return [
        "-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(C),
        "--log-level", "info", "--snapshot-path", str(snap), "--snapshot-interval", "3600",
    ]  # fmt: skip


def run_second(port: int, snap: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *flags(port, snap)], capture_output=True, text=True, timeout=120
    )


def test_second_coordinator_is_refused_and_leaves_the_snapshot_alone(tmp_path: Path) -> None:
    port, snap = free_port(), tmp_path / "directory.snap"
    url = f"http://127.0.0.1:{port}"
    first = spawn_service(flags(port, snap), url)
    rows = np.random.default_rng(0).integers(0, 1000, (3, C)).astype(np.uint32)
    keys = [ObjectKey(chunk_hashes(r, C)[0], "m", pack_kv_rank(1, 0, 1, 0)) for r in rows]
    sink = EventSink("emitter", HttpTransport(url), backoff_max=0.2)
    try:
        batch = [CacheEntry(k, 64, r, 0) for k, r in zip(keys, rows, strict=True)]
        sink.emit("store", "l1", "dram", batch)
        assert sink.flush(30)
        assert httpx.get(f"{url}/directory/stats").json()["keys"] == 3

        same_port = run_second(port, snap)
        assert same_port.returncode != 0
        assert str(port) in same_port.stderr + same_port.stdout
        assert not snap.exists(), "the refused coordinator wrote a snapshot"

        other_port = run_second(free_port(), snap)
        assert other_port.returncode != 0
        assert "lock" in (other_port.stderr + other_port.stdout).lower()
        assert not snap.exists(), "the refused coordinator wrote a snapshot"

        assert httpx.get(f"{url}/directory/stats").json()["keys"] == 3
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
    finally:
        sink.close(timeout=1)
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)
    restored = KeyDirectory(C)
    assert load_snapshot(restored, snap).keys == 3
    assert all(p for p in restored.lookup(keys))
