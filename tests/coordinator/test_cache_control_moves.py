"""Moves L1 -> L1 carried out across real processes on loopback (``docs/cache-control.md``,
"Moves"; issue 30 item 5): a ``kvatlas coordinator`` and two ``kvatlas node`` processes. A move
hands the keys to the target and takes them from the source; ``keep_source`` copies; keys the
source lacks are ``missing``; pinned source copies are ``skipped``; a target that is down is
retried until it is back; a coordinator killed (``kill -9``) mid-move finishes the move after
its restart. Throughout, a watcher reads both nodes' own inventories (the source's first, then
the target's) and records any key neither holds in L1: there must be none.

(Every test fails on a coordinator that records moves without carrying them out.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.cli import main
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service, spawn_services, stop
from tests.conftest import HTTP, wait_for
from tests.helpers import C, node_config, spawn_coordinator, toy_node_flags

DOCS = [[int(t) for t in np.random.default_rng(50 + n).integers(0, 500, 3 * C)] for n in range(7)]
"""Seven documents of three chunks."""


def node_args(coordinator: str, port: int, name: str, *flags: str) -> tuple[list[str], str]:
    return (
        ["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", name,
         *toy_node_flags(C), "--coordinator-url", coordinator, "--coordinator-event-reporting",
         "--fleet-refresh-interval-s", "1", *flags],
        f"http://127.0.0.1:{port}",
    )  # fmt: skip


def spawn_node(coordinator: str, port: int, name: str, *flags: str) -> subprocess.Popen[bytes]:
    return spawn_service(*node_args(coordinator, port, name, *flags))


def store(node: str, doc: list[int]) -> None:
    layout = node_config().layout
    with NodeEngineClient(node, layout) as client:
        tokens = np.asarray(doc, dtype=np.uint32)
        assert client.store(tokens, ToyRopeModel(layout).kv_chunks(tokens)) == 3


def hexes(doc: list[int]) -> list[str]:
    return [h.hex() for h in node_config().scheme.chunk_hashes(np.asarray(doc, dtype=np.uint32))]


def in_l1(node: str, timeout: float = 10.0) -> set[str]:
    """The chunk hashes the node's own L1 holds (``GET /engine/inventory``)."""
    r = httpx.get(f"{node}/engine/inventory", headers={"accept": "application/json"},
                  timeout=timeout)  # fmt: skip
    assert r.status_code == 200, r.text
    return {p["key"]["chunk_hash_hex"] for p in r.json()["placements"] if p["tier"] == "l1"}


def tiers(coordinator: str, doc: list[int]) -> list[dict[str, list[str]]]:
    """Per chunk of ``doc``, each instance's tiers, as the directory shows them."""
    r = HTTP.post(f"{coordinator}/directory/lookup",
                   json={"token_ids": doc, "model_name": "toy"})  # fmt: skip
    assert r.status_code == 200, r.text
    rows = []
    for row in r.json()["results"]:
        held: dict[str, list[str]] = {}
        for p in row["placements"]:
            held.setdefault(p["instance_id"], []).append(p["tier"])
        rows.append({i: sorted(t) for i, t in held.items()})
    return rows


def move(coordinator: str, doc: list[int], **extra: Any) -> str:
    body = {"model_name": "toy", "world_size": 1, "token_ids": doc,
            "source_instance_id": "node-a", "target_instance_id": "node-b", **extra}  # fmt: skip
    r = httpx.post(f"{coordinator}/cache/moves", json=body)
    assert r.status_code == 200 and r.json()["status"] == "pending", r.text
    return str(r.json()["move_id"])


def status(coordinator: str, move_id: str) -> dict[str, Any]:
    r = HTTP.get(f"{coordinator}/cache/moves/{move_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def finished(coordinator: str, move_id: str) -> dict[str, Any]:
    assert wait_for(lambda: status(coordinator, move_id)["status"] != "pending", timeout=60), (
        status(coordinator, move_id)
    )
    return status(coordinator, move_id)


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", HTTP.get(f"{url}/metrics").text, re.M)
    assert found is not None, name
    return float(found.group(1))


class CopyWatch(threading.Thread):
    """Reads the source's L1, then the target's, over and over; ``lost`` collects every key of
    ``keys`` neither held in a round (a source read before the target's: a key that left the
    source before the target held it shows up). A node that does not answer (down, stopped)
    skips the round."""

    def __init__(self, source: str, target: str, keys: list[str]) -> None:
        super().__init__(daemon=True)
        self.source, self.target, self.keys = source, target, keys
        self.lost: list[str] = []
        self.rounds = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                source = in_l1(self.source, timeout=0.5)
                target = in_l1(self.target, timeout=0.5)
            except httpx.HTTPError:
                self.done.wait(0.05)
                continue
            self.lost += [k for k in self.keys if k not in source and k not in target]
            self.rounds += 1

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


class Fleet:
    """A coordinator with a snapshot, ``node-a`` (L1 only: the sources) and ``node-b`` (a
    private fs L2: the targets), shared by this module's tests (starting them costs seconds);
    the outage test, last, restarts some of them (``procs``: every one started)."""

    def __init__(self, tmp: Path) -> None:
        self.coord_port, self.a_port, self.b_port = free_port(), free_port(), free_port()
        self.coordinator = f"http://127.0.0.1:{self.coord_port}"
        self.a, self.b = f"http://127.0.0.1:{self.a_port}", f"http://127.0.0.1:{self.b_port}"
        self.snapshot = tmp / "snap"
        self.coordinator_flags = ["--chunk-size", str(C), "--snapshot-path", str(self.snapshot),
                                  "--snapshot-interval", "0.5"]  # fmt: skip
        self.b_flags = ["--l2", "fs", "--l2-path", str(tmp / "l2-b")]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self.coordinator_proc = spawn_coordinator(self.coord_port, *self.coordinator_flags)
        self.procs.append(self.coordinator_proc)
        self.node_a, self.node_b = spawn_services([
            node_args(self.coordinator, self.a_port, "node-a"),
            node_args(self.coordinator, self.b_port, "node-b", *self.b_flags),
        ])  # fmt: skip
        self.procs += [self.node_a, self.node_b]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("moves"))
    try:
        f.start()
        yield f
    finally:
        stop([p for p in f.procs if p.poll() is None])


def test_a_move_hands_the_keys_over_and_copies_missing_and_pinned_keys_are_counted(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    coordinator, a, b = fleet.coordinator, fleet.a, fleet.b

    # a move, waited for by the CLI: the keys end in the target's L1 only, never in neither
    doc = DOCS[0]
    store(a, doc)
    assert wait_for(lambda: tiers(coordinator, doc) == [{"node-a": ["l1"]}] * 3, timeout=30)
    watch = CopyWatch(a, b, hexes(doc))
    watch.start()
    tokens = tmp_path / "doc.json"
    tokens.write_text(json.dumps(doc))
    capsys.readouterr()
    code = main(["cache", "move", "--coordinator-url", coordinator, "--model-name", "toy",
                 "--tokens-file", str(tokens), "--source-instance-id", "node-a",
                 "--target-instance-id", "node-b", "--wait", "--poll-interval-s", "0.05",
                 "--wait-timeout-s", "60",
                 "--json", "-"])  # fmt: skip
    out = capsys.readouterr()
    watch.stop()
    assert code == 0, out
    done = json.loads(out.out)
    assert {k: done[k] for k in ("status", "phase", "requested", "loaded", "missing", "deleted",
                                 "skipped", "error")} == {
        "status": "completed", "phase": "done", "requested": 3, "loaded": 3, "missing": 0,
        "deleted": 3, "skipped": 0, "error": None}  # fmt: skip
    assert f"move {done['move_id']}: pending (" in out.err  # progress on stderr
    assert watch.rounds > 0 and watch.lost == []
    assert set(hexes(doc)) <= in_l1(b) and not set(hexes(doc)) & in_l1(a)
    # (node-b writes its L2 through)
    want = [{"node-b": ["l1", "l2"]}] * 3
    assert wait_for(lambda: tiers(coordinator, doc) == want, timeout=30)
    assert metric(b, "kvatlas_node_held_keys") == 0  # the hold was released

    # a target that can never do it (it serves another world size: 400): failed, exit 4
    capsys.readouterr()
    code = main(["cache", "move", "--coordinator-url", coordinator, "--model-name", "toy",
                 "--world-size", "2", "--tokens-file", str(tokens), "--source-instance-id",
                 "node-a", "--target-instance-id", "node-b", "--wait", "--poll-interval-s",
                 "0.05", "--wait-timeout-s", "60", "--json", "-"])  # fmt: skip
    failed = json.loads(capsys.readouterr().out)
    assert (code, failed["status"], failed["phase"]) == (4, "failed", "loading"), failed
    assert "world_size=1" in failed["error"]

    # keep_source: a copy, both hold it
    doc = DOCS[1]
    store(a, doc)
    assert wait_for(lambda: tiers(coordinator, doc) == [{"node-a": ["l1"]}] * 3, timeout=30)
    got = finished(coordinator, move(coordinator, doc, keep_source=True))
    assert (got["status"], got["loaded"], got["deleted"]) == ("completed", 3, 0)
    assert set(hexes(doc)) <= in_l1(a) & in_l1(b)

    # keys the source never had: missing, not a failure
    got = finished(coordinator, move(coordinator, DOCS[2]))
    assert (got["status"], got["loaded"], got["missing"], got["deleted"]) == ("completed", 0, 3, 0)

    # pinned source copies stay (a move is no forced delete); the target gets them all the same
    doc = DOCS[3]
    store(a, doc)
    assert wait_for(lambda: tiers(coordinator, doc) == [{"node-a": ["l1"]}] * 3, timeout=30)
    pin = {"model_name": "toy", "world_size": 1, "token_ids": doc}
    assert httpx.post(f"{coordinator}/cache/pins", json=pin).json()["affected"] == 3
    got = finished(coordinator, move(coordinator, doc))
    assert (got["status"], got["loaded"], got["skipped"], got["deleted"]) == ("completed", 3, 3, 0)
    assert set(hexes(doc)) <= in_l1(a) & in_l1(b)

    text = httpx.get(f"{coordinator}/metrics").text
    assert 'kvatlas_cache_commands{kind="move",state="completed"} 4.0' in text


def test_a_move_outlives_a_target_down_and_a_coordinator_killed_mid_move(fleet: Fleet) -> None:
    """Two outages in one fleet (each process start costs seconds). The second is made
    deterministic: the target holds the keys in its own L2, so it loads them without the
    source, which is stopped (``SIGSTOP``): the move waits in ``deleting`` while the coordinator
    is killed, and must resume from its snapshot."""
    coordinator, a, b, snapshot = fleet.coordinator, fleet.a, fleet.b, fleet.snapshot

    # 1. the target is down (kill -9: still registered): retried, done once it is back
    doc = DOCS[5]
    store(a, doc)
    assert wait_for(lambda: tiers(coordinator, doc) == [{"node-a": ["l1"]}] * 3, timeout=30)
    fleet.node_b.kill()
    fleet.node_b.wait(timeout=30)
    move_id = move(coordinator, doc)
    assert wait_for(lambda: status(coordinator, move_id)["error"] is not None, timeout=30)
    waiting = status(coordinator, move_id)
    assert (waiting["status"], waiting["phase"]) == ("pending", "loading"), waiting
    assert set(hexes(doc)) <= in_l1(a)  # nothing taken from the source meanwhile
    fleet.procs.append(spawn_node(coordinator, fleet.b_port, "node-b", *fleet.b_flags))
    got = finished(coordinator, move_id)
    assert (got["status"], got["loaded"], got["deleted"]) == ("completed", 3, 3), got
    assert set(hexes(doc)) <= in_l1(b) and not set(hexes(doc)) & in_l1(a)

    # 2. the coordinator is killed (-9) while the move deletes the source's copies
    doc = DOCS[6]
    store(b, doc)  # into b's L1 and its L2 (write-through), then out of its L1
    assert wait_for(lambda: tiers(coordinator, doc) == [{"node-b": ["l1", "l2"]}] * 3, timeout=30)
    body = {"instance_id": "node-b", "model_name": "toy", "world_size": 1, "token_ids": doc,
            "tier": "l1"}  # fmt: skip
    assert httpx.post(f"{coordinator}/cache/delete", json=body).status_code == 200
    store(a, doc)
    want = [{"node-a": ["l1"], "node-b": ["l2"]}] * 3
    assert wait_for(lambda: tiers(coordinator, doc) == want, timeout=30)
    watch = CopyWatch(a, b, hexes(doc))
    watch.start()
    os.kill(fleet.node_a.pid, signal.SIGSTOP)  # the source cannot delete anything now
    try:
        move_id = move(coordinator, doc)
        assert wait_for(lambda: status(coordinator, move_id)["phase"] == "deleting", timeout=30)
        # the target holds the keys before any source copy is deleted
        assert set(hexes(doc)) <= in_l1(b) and metric(b, "kvatlas_node_held_keys") == 3
        written = snapshot.stat().st_mtime_ns
        assert wait_for(lambda: snapshot.stat().st_mtime_ns > written, timeout=30)
        fleet.coordinator_proc.kill()  # only the snapshot knows about the move now
        fleet.coordinator_proc.wait(timeout=30)
    finally:
        os.kill(fleet.node_a.pid, signal.SIGCONT)
    fleet.procs.append(spawn_coordinator(fleet.coord_port, *fleet.coordinator_flags))
    got = finished(coordinator, move_id)
    watch.stop()
    assert (got["status"], got["phase"], got["loaded"]) == ("completed", "done", 3), got
    assert watch.rounds > 0 and watch.lost == []
    assert set(hexes(doc)) <= in_l1(b) and not set(hexes(doc)) & in_l1(a)
    assert metric(b, "kvatlas_node_held_keys") == 0
