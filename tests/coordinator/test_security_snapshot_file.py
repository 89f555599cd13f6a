"""Issue 25 item 12: the snapshot file holds every tenant's token ids, so only the
coordinator's user may read it (mode 0600), also when an older, world-readable snapshot was
there before. Against a real coordinator process (its shutdown snapshot)."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx

from kvatlas.coordinator.server import free_port
from kvatlas.processes import stop
from tests.coordinator.helpers import CS, Emitter, fresh_tokens
from tests.coordinator.security_support import spawn_coordinator


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_snapshot_file_is_private_to_the_coordinator(tmp_path: Path) -> None:
    snap = tmp_path / "directory.snap"
    snap.write_bytes(b"an older snapshot, world-readable")
    snap.chmod(0o644)
    port = free_port()
    proc = spawn_coordinator(port, "--chunk-size", str(CS), "--snapshot-path", str(snap))
    try:
        batch = Emitter().store_chunks(fresh_tokens(2))
        r = httpx.post(f"http://127.0.0.1:{port}/events", json={"batches": [batch]}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        stop([proc])  # SIGTERM: the shutdown snapshot replaces the old file
    assert proc.returncode == 0
    assert snap.read_bytes() != b"an older snapshot, world-readable"
    assert _mode(snap) == 0o600, oct(_mode(snap))
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []
