"""Pins on the node (issue 30 item 3, ``docs/cache-control.md``, "Pins on the node"), with a
real ``kvatlas coordinator`` and a real ``kvatlas node`` on loopback: the node reads its pins
from the coordinator (``GET /instances/{id}/pins``), and neither its L1's LRU nor its capped
fs L2 evicts a pinned document while unpinned ones go; a store that only pinned chunks could
make room for is refused and counted; a node-side delete without ``force`` skips pinned keys,
with ``force`` removes them; once unpinned, the document can go. (Fails on a node that does not
learn its pins: the first document is the least recently used and is evicted first.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.keys import ObjectKey, pack_kv_rank
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.stored_chunk import StoredChunk, encode_chunk
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, wait_for
from tests.helpers import TOY_LAYOUT, C, spawn_coordinator, toy_node_flags

DOCS = [[int(t) for t in np.random.default_rng(seed).integers(0, 500, 3 * C)] for seed in range(6)]
"""Six documents of three chunks each."""
KV = ToyRopeModel(TOY_LAYOUT)
RANK = pack_kv_rank(1, 0, 1, 0)  # the toy node's: one rank of one
CHUNK_BYTES = 2 * 2 * 16 * 2 * C * 4  # layers x (K, V) x heads x head_dim x tokens x float32


def _file_bytes() -> int:
    """What one toy chunk takes in the fs L2 (its header, KV, tokens and digest)."""
    kv = KV.kv_chunks(np.asarray(DOCS[0], dtype=np.uint32))[0]
    key = ObjectKey(bytes(32), "toy", RANK)
    tokens = np.arange(C, dtype=np.uint32)
    return len(encode_chunk(StoredChunk(key, kv, tokens, 1_000_000, "float32")))


def spawn_node(coordinator: str, port: int, l2: Path) -> subprocess.Popen[bytes]:
    """node-a: L1 and L2 each hold six chunks (two documents), not seven."""
    return spawn_service(
        ["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "node-a",
         *toy_node_flags(C), "--l2", "fs", "--l2-path", str(l2),
         "--l1-bytes", str(6 * CHUNK_BYTES + CHUNK_BYTES // 2),
         "--l2-max-bytes", str(6 * _file_bytes() + _file_bytes() // 2),
         "--pin-refresh-interval-s", "0.2", "--coordinator-url", coordinator,
         "--coordinator-event-reporting"],
        f"http://127.0.0.1:{port}",
    )  # fmt: skip


@pytest.fixture
def fleet(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> tuple[str, str]:
    """A coordinator and node-a (:func:`spawn_node`)."""
    coord_port, node_port = free_port(), free_port()
    coordinator, node = f"http://127.0.0.1:{coord_port}", f"http://127.0.0.1:{node_port}"
    procs.append(spawn_coordinator(coord_port, "--chunk-size", str(C)))
    procs.append(spawn_node(coordinator, node_port, tmp_path / "l2"))
    return coordinator, node


def store(node: str, doc: list[int]) -> int:
    with NodeEngineClient(node, TOY_LAYOUT) as client:
        tokens = np.asarray(doc, dtype=np.uint32)
        return client.store(tokens, KV.kv_chunks(tokens))


def held(node: str) -> dict[str, set[str]]:
    """The chunk hashes the node's own tiers hold, by tier (``GET /engine/inventory``)."""
    rows = msgspec.msgpack.decode(HTTP.get(f"{node}/engine/inventory").content)["placements"]
    out: dict[str, set[str]] = {"l1": set(), "l2": set()}
    for row in rows:
        out[row["tier"]].add(row["key"]["chunk_hash_hex"])
    return out


def metric(node: str, name: str) -> float:
    text = HTTP.get(f"{node}/metrics").text
    found = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def pins(coordinator: str, doc: list[int], method: str = "POST") -> None:
    body = {"model_name": "toy", "world_size": 1, "token_ids": doc}
    r = httpx.request(method, f"{coordinator}/cache/pins", json=body)
    assert r.status_code == 200, r.text


def node_delete(node: str, hashes: set[str], *, force: bool) -> dict[str, object]:
    keys = [{"chunk_hash_hex": h, "model_name": "toy", "kv_rank": RANK, "object_group_id": 0,
             "cache_salt": ""} for h in sorted(hashes)]  # fmt: skip
    r = httpx.request(
        "DELETE", f"{node}/cache/objects", json={"keys": keys, "tier": "all", "force": force}
    )
    assert r.status_code == 200, r.text
    reply: dict[str, object] = r.json()
    return reply


def test_pinned_document_survives_l1_and_l2_pressure_until_unpinned(
    fleet: tuple[str, str],
) -> None:
    coordinator, node = fleet
    pins(coordinator, DOCS[0])
    assert wait_for(lambda: metric(node, "kvatlas_node_pinned_keys") == 3, timeout=30)
    assert store(node, DOCS[0]) == 3
    doc0 = held(node)["l1"]
    assert len(doc0) == 3 and held(node)["l2"] == doc0
    for doc in DOCS[1:4]:  # three more documents: L1 and L2 hold two in all
        store(node, doc)
    now = held(node)
    assert doc0 <= now["l1"] and doc0 <= now["l2"]  # pinned: the LRU passed it by
    assert len(now["l1"]) == len(now["l2"]) == 6  # the others went: only the newest stayed
    assert metric(node, "kvatlas_node_l1_evictions") >= 6

    # a node-side delete without force skips the pinned copies (L1 and L2)
    assert node_delete(node, doc0, force=False) == {"deleted": 0, "skipped": 6, "ok": True}
    assert doc0 <= held(node)["l1"] and doc0 <= held(node)["l2"]

    # pins fill both tiers: a store that only pinned chunks could make room for is refused
    newest = now["l1"] - doc0
    pins(coordinator, DOCS[3])
    assert wait_for(lambda: metric(node, "kvatlas_node_pinned_keys") == 6, timeout=30)
    store(node, DOCS[4])
    after = held(node)
    assert after["l1"] == after["l2"] == doc0 | newest
    assert metric(node, "kvatlas_node_l1_refused_pinned") == 3
    assert metric(node, "kvatlas_node_l2_refused_pinned") == 3

    # unpinned: the first document is the least recently used again, and goes
    pins(coordinator, DOCS[0], "DELETE")
    pins(coordinator, DOCS[3], "DELETE")
    assert wait_for(lambda: metric(node, "kvatlas_node_pinned_keys") == 0, timeout=30)
    assert store(node, DOCS[4]) == 3
    after = held(node)
    assert not doc0 & after["l1"] and not doc0 & after["l2"]
    assert newest <= after["l1"] and newest <= after["l2"]

    # force is the only way past a pin
    pins(coordinator, DOCS[3])
    assert wait_for(lambda: metric(node, "kvatlas_node_pinned_keys") == 3, timeout=30)
    assert node_delete(node, newest, force=True) == {"deleted": 6, "skipped": 0, "ok": True}
    assert not newest & (held(node)["l1"] | held(node)["l2"])


def test_a_node_started_before_its_coordinator_learns_its_pins(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Any start order: the node registers in the background, then reads its pins."""
    coord_port, node_port = free_port(), free_port()
    coordinator, node = f"http://127.0.0.1:{coord_port}", f"http://127.0.0.1:{node_port}"
    procs.append(spawn_node(coordinator, node_port, tmp_path / "l2"))
    procs.append(spawn_coordinator(coord_port, "--chunk-size", str(C)))
    pins(coordinator, DOCS[0])
    assert wait_for(lambda: metric(node, "kvatlas_node_pinned_keys") == 3, timeout=60)
