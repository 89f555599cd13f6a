"""Cache control is durable between snapshots (``docs/cache-control.md``, "Restart"): on the HTTP
transport every pin, quota and command a coordinator acknowledged is in its journal beside the
snapshot before the reply, so a ``kill -9`` long before the next snapshot loses none of it — the
spec's "a command survives a coordinator restart". Real coordinator processes on loopback; the
snapshot interval is an hour, so only the journal can carry the state. (Fails on a coordinator
that keeps cache control only in memory and its snapshots: everything is gone after the kill.)"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

from kvatlas.asgi_thread import free_port
from tests.conftest import HTTP
from tests.coordinator.helpers import cache_commands
from tests.helpers import spawn_coordinator

C = 16
DOC = list(range(1000, 1000 + 3 * C))  # three chunks
DOC2 = list(range(5000, 5000 + 2 * C))  # two chunks


def fields(doc: list[int], salt: str = "tenant-a", **more: Any) -> dict[str, Any]:
    return {"model_name": "m", "world_size": 1, "token_ids": doc, "cache_salt": salt, **more}


def seen(url: str) -> dict[str, Any]:
    """What an operator reads of cache control: pins, quotas, commands by kind and state."""
    pins = HTTP.get(f"{url}/cache/pins", params={"limit": 1000}).json()
    commands = cache_commands(HTTP.get(f"{url}/metrics").text)
    return {
        "pins": [(row["key"]["chunk_hash_hex"], row["pin_count"]) for row in pins["pins"]],
        "default": HTTP.get(f"{url}/quota/config").json(),
        "quotas": {
            row["cache_salt"]: (row["quota_limit_gb"], row["quota_exists"])
            for row in HTTP.get(f"{url}/quota").json()["by_cache_salt"]
        },
        "commands": {kind_state: n for kind_state, n in commands.items() if n},
    }


def register(url: str) -> None:
    """An instance whose MP server does not listen: its deletes stay pending."""
    r = HTTP.post(f"{url}/instances", json={"instance_id": "n1", "ip": "127.0.0.1", "http_port": 9})
    assert r.status_code == 200, r.text


def change(url: str, doc: list[int], salt: str, limit_gb: float) -> None:
    """Pins, quotas and a delete that stays pending (its MP server does not listen)."""
    assert HTTP.post(f"{url}/cache/pins", json=fields(doc, salt)).status_code == 200
    assert HTTP.post(f"{url}/cache/pins", json=fields(doc[:C], salt)).status_code == 200
    r = HTTP.request("DELETE", f"{url}/cache/pins", json=fields(doc[: 2 * C], salt))
    assert r.status_code == 200, r.text
    r = HTTP.put(f"{url}/quota/{salt}", json={"limit_gb": limit_gb})
    assert r.status_code == 200, r.text
    r = HTTP.put(f"{url}/quota/config", json={"default_limit_gb": limit_gb * 2})
    assert r.status_code == 200, r.text
    r = HTTP.post(f"{url}/cache/delete", json=fields(doc, "other", instance_id="n1"))
    assert r.status_code == 502, r.text  # recorded, retried later: pending


class Coordinator:
    """``kvatlas coordinator`` processes on one port with one snapshot path (an hour between
    snapshots: only the journal carries what a kill -9 would lose), one after the other; each
    started is appended to ``procs`` (the fixture stops what is left)."""

    def __init__(self, tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.snapshot = tmp_path / "snap"
        self.procs = procs
        self.flags = ["--chunk-size", str(C), "--snapshot-path", str(self.snapshot),
                      "--snapshot-interval", "3600", "--instance-timeout", "3600"]  # fmt: skip

    def start(self) -> None:
        self.procs.append(spawn_coordinator(self.port, *self.flags))

    def kill(self) -> None:
        """kill -9: no snapshot written on the way out."""
        self.procs[-1].kill()
        self.procs[-1].wait(timeout=30)

    def stop(self) -> None:
        """A clean stop (SIGTERM): it writes a snapshot."""
        self.procs[-1].send_signal(signal.SIGTERM)
        assert self.procs[-1].wait(timeout=60) == 0

    def killed_and_started(self) -> None:
        self.kill()
        self.start()


def test_a_coordinator_killed_between_snapshots_keeps_its_cache_control(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    coordinator = Coordinator(tmp_path, procs)
    url = coordinator.url
    coordinator.start()
    register(url)

    # 1. no snapshot was ever written: a kill -9 keeps what was acknowledged
    change(url, DOC, "tenant-a", 1.5)
    before = seen(url)
    assert before["commands"] == {("delete", "pending"): 1.0}
    assert len(before["pins"]) == 2  # chunk 1 unpinned, chunk 0 pinned twice then unpinned once
    coordinator.kill()
    assert not coordinator.snapshot.exists()
    coordinator.start()
    assert seen(url) == before

    # 2. changes after a snapshot (a clean stop writes one), then a kill -9: both kept
    coordinator.stop()
    assert coordinator.snapshot.exists()
    coordinator.start()
    assert seen(url) == before
    register(url)  # (registrations are the snapshot's, not the journal's)
    change(url, DOC2, "tenant-b", 0.25)
    r = HTTP.delete(f"{url}/quota/tenant-a")
    assert r.status_code == 200, r.text
    after = seen(url)
    assert after != before and after["commands"] == {("delete", "pending"): 2.0}
    coordinator.killed_and_started()
    assert seen(url) == after
    # ... and again (the journal of a restored coordinator is replayed once, not twice)
    coordinator.killed_and_started()
    assert seen(url) == after
    assert HTTP.get(f"{url}/cache/pins", params={"limit": 1000}).json()["total"] == 3


def test_a_snapshot_brought_back_without_its_journal_keeps_what_is_acknowledged_after(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A snapshot moved, or restored from a backup, without its journal files: the changes
    acknowledged after that start are journaled in a generation its next restart replays.
    (Failed on the old code: the new journal began at generation 1 again, below the one the
    snapshot names, and a ``kill -9`` lost the pin acknowledged since.)"""
    coordinator = Coordinator(tmp_path, procs)
    url = coordinator.url
    for _ in range(3):  # each clean stop writes a snapshot naming a later generation
        coordinator.start()
        assert HTTP.post(f"{url}/cache/pins", json=fields(DOC[:C])).status_code == 200
        coordinator.stop()
    for journal in tmp_path.glob("snap.journal-*"):
        journal.unlink()  # the snapshot alone is brought back

    coordinator.start()
    assert HTTP.post(f"{url}/cache/pins", json=fields(DOC2)).status_code == 200
    before = seen(url)
    assert sorted(n for _, n in before["pins"]) == [1, 1, 3]
    coordinator.killed_and_started()
    assert seen(url) == before
