"""Cache-control commands carried to completion across real processes on loopback
(``docs/cache-control.md``, issue 30 item 2): a ``kvatlas coordinator`` and a ``kvatlas node``
with a private fs L2. A delete whose node is down is recorded (LMCache's 502), retried with
backoff and completed once the node is back and its delete events arrive; a coordinator killed
(``kill -9``) with a delete still pending finishes it after its restart, from its snapshot.
(The first fails on a coordinator that fires and forgets, the second on one that keeps its
commands only in memory.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import numpy as np

from kvatlas.asgi_thread import free_port
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, wait_for
from tests.coordinator.helpers import cache_commands
from tests.helpers import C, node_config, spawn_coordinator, toy_node_flags

DOC, DOC2 = (list(np.random.default_rng(seed).integers(0, 500, 3 * C)) for seed in (30, 31))
"""Two documents of three chunks."""


def spawn_node(coordinator: str, port: int, l2: Path) -> subprocess.Popen[bytes]:
    return spawn_service(
        ["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "node-a",
         *toy_node_flags(C), "--l2", "fs", "--l2-path", str(l2), "--coordinator-url",
         coordinator, "--coordinator-event-reporting"],
        f"http://127.0.0.1:{port}",
    )  # fmt: skip


def store_doc(node_url: str, doc: list[int]) -> None:
    layout = node_config().layout
    with NodeEngineClient(node_url, layout) as client:
        tokens = np.asarray(doc, dtype=np.uint32)
        assert client.store(tokens, ToyRopeModel(layout).kv_chunks(tokens)) == 3


def l2_keys(node_url: str) -> int:
    return len(httpx.get(f"{node_url}/cache/objects").json()["entries"])


def tiers(coordinator: str, doc: list[int]) -> list[list[str]]:
    """Per chunk of ``doc``, the tiers node-a holds it in, as the directory shows."""
    r = HTTP.post(
        f"{coordinator}/directory/lookup",
        json={"token_ids": [int(t) for t in doc], "model_name": "toy"},
    )
    assert r.status_code == 200, r.text
    return [
        sorted(p["tier"] for p in row["placements"] if p["instance_id"] == "node-a")
        for row in r.json()["results"]
    ]


def commands(coordinator: str) -> dict[tuple[str, str], float]:
    return cache_commands(HTTP.get(f"{coordinator}/metrics").text)


def delete_doc(coordinator: str, doc: list[int], tier: str = "all") -> httpx.Response:
    body = {"instance_id": "node-a", "model_name": "toy", "world_size": 1,
            "token_ids": [int(t) for t in doc], "tier": tier}  # fmt: skip
    return httpx.post(f"{coordinator}/cache/delete", json=body, timeout=60)


def test_deletes_survive_a_node_down_and_a_coordinator_killed_mid_command(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """One fleet, two outages (each process start costs seconds): first the node is down when
    the delete is asked; then, the node up, an L1 delete and a prefetch from L2; then the
    coordinator is killed while a delete is pending."""
    coord_port, node_port = free_port(), free_port()
    coordinator, node = f"http://127.0.0.1:{coord_port}", f"http://127.0.0.1:{node_port}"
    snapshot = tmp_path / "snap"
    flags = ["--chunk-size", str(C), "--snapshot-path", str(snapshot), "--snapshot-interval", "0.5"]
    l2 = tmp_path / "l2"
    procs.append(spawn_coordinator(coord_port, *flags))
    procs.append(spawn_node(coordinator, node_port, l2))

    # 1. the node is down when the delete is asked: recorded, retried, done once it is back
    store_doc(node, DOC)
    assert wait_for(lambda: tiers(coordinator, DOC) == [["l1", "l2"]] * 3, timeout=30)
    procs[-1].kill()  # kill -9: no deregistration
    procs[-1].wait(timeout=30)
    r = delete_doc(coordinator, DOC)
    assert r.status_code == 502, r.text  # LMCache's answer: the MP server is unreachable
    assert "node-a" in r.json()["detail"]
    assert commands(coordinator)[("delete", "pending")] == 1  # kept, to be retried
    assert tiers(coordinator, DOC) == [["l1", "l2"]] * 3  # nothing applied yet
    procs.append(spawn_node(coordinator, node_port, l2))  # back, with the same L2
    assert wait_for(lambda: commands(coordinator)[("delete", "completed")] == 1, timeout=90)
    assert tiers(coordinator, DOC) == [[]] * 3
    assert l2_keys(node) == 0  # gone from the node's L2, not only from the view

    # 2. with the node up: an L1 delete, then a prefetch back from L2, each done from events
    store_doc(node, DOC2)
    assert wait_for(lambda: tiers(coordinator, DOC2) == [["l1", "l2"]] * 3, timeout=30)
    r = delete_doc(coordinator, DOC2, tier="l1")
    assert (r.status_code, r.json()["affected"]) == (200, 3), r.text
    assert wait_for(lambda: commands(coordinator)[("delete", "completed")] == 2, timeout=30)
    assert tiers(coordinator, DOC2) == [["l2"]] * 3
    body = {"instance_id": "node-a", "model_name": "toy", "world_size": 1,
            "token_ids": [int(t) for t in DOC2]}  # fmt: skip
    r = httpx.post(f"{coordinator}/cache/prefetches", json=body)
    assert r.status_code == 202 and r.json()["status"] == "submitted", r.text
    status = f"{coordinator}/cache/prefetches/node-a/{r.json()['request_id']}"
    assert wait_for(lambda: HTTP.get(status).json()["status"] == "completed", timeout=30)
    assert httpx.get(status).json() == {"status": "completed", "found_keys": 3, "total_keys": 3}
    assert tiers(coordinator, DOC2) == [["l1", "l2"]] * 3  # the L1 store events came first

    # 3. the coordinator is killed (-9) with a delete pending: its snapshot carries it
    procs[-1].kill()
    procs[-1].wait(timeout=30)
    assert delete_doc(coordinator, DOC2).status_code == 502
    written = snapshot.stat().st_mtime_ns
    assert wait_for(lambda: snapshot.stat().st_mtime_ns > written, timeout=30)
    procs[0].kill()  # only the snapshot knows about the command now
    procs[0].wait(timeout=30)
    procs.append(spawn_coordinator(coord_port, *flags))
    assert commands(coordinator)[("delete", "pending")] == 1  # restored
    procs.append(spawn_node(coordinator, node_port, l2))
    assert wait_for(lambda: commands(coordinator)[("delete", "completed")] == 3, timeout=90)
    assert tiers(coordinator, DOC2) == [[]] * 3
    assert l2_keys(node) == 0


def test_a_zero_quota_evicts_every_unpinned_l2_key(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Fleet eviction (issue 30 item 4) across real processes: once the empty salt's quota is
    0, the loop's next pass (every 5 s) records ``evict`` commands, the node removes the
    keys from its L2 and the directory follows; the pinned document stays. (Fails on a
    coordinator whose loop runs no eviction pass.)"""
    coord_port, node_port = free_port(), free_port()
    coordinator, node = f"http://127.0.0.1:{coord_port}", f"http://127.0.0.1:{node_port}"
    procs.append(spawn_coordinator(coord_port, "--chunk-size", str(C)))
    procs.append(spawn_node(coordinator, node_port, tmp_path / "l2"))
    pin = {"model_name": "toy", "world_size": 1, "token_ids": [int(t) for t in DOC]}
    r = httpx.post(f"{coordinator}/cache/pins", json=pin)
    assert (r.status_code, r.json()["affected"]) == (200, 3), r.text
    for doc in (DOC, DOC2):
        store_doc(node, doc)
    assert wait_for(lambda: tiers(coordinator, DOC2) == [["l1", "l2"]] * 3, timeout=30)
    assert tiers(coordinator, DOC) == [["l1", "l2"]] * 3 and l2_keys(node) == 6
    r = httpx.put(f"{coordinator}/quota/_default", json={"limit_gb": 0})
    assert r.status_code == 200, r.text
    assert wait_for(lambda: commands(coordinator)[("evict", "completed")] >= 1, timeout=30)
    assert tiers(coordinator, DOC2) == [["l1"]] * 3  # L2 copies gone; L1 is not the quota's
    assert tiers(coordinator, DOC) == [["l1", "l2"]] * 3  # pinned: never evicted
    assert l2_keys(node) == 3  # gone from the node's L2, not only from the view
    text = httpx.get(f"{coordinator}/metrics").text
    assert re.search(r'^kvatlas_cache_evicted_bytes_total\{cache_salt="",reason="lru"\} [1-9]',
                     text, re.M), text  # fmt: skip
    assert commands(coordinator)[("evict", "failed")] == 0
