"""End to end with real processes over HTTP: a coordinator and two cache nodes.

A chunk stored by node A at position p is found by node B's unified lookup at a new offset q,
fetched from A's L1 (peer) and re-RoPE'd; the result equals the toy model's KV computed fresh
at q. Then A is killed: B's retrieval reports misses and completes.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, wait_for
from tests.helpers import TOY_LAYOUT

C = 16
NODE_FLAGS = [
    "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
    "--chunk-size", str(C), "--dtype", "float32", "--l2", "none", "--log-level", "warning",
    "--coordinator-blend-timeout", "20",  # a loaded CI machine must not turn into a local-only answer
]  # fmt: skip


def spawn(args: list[str], health_url: str) -> subprocess.Popen[bytes]:
    return spawn_service(["-m", "kvatlas.cli", *args], health_url.removesuffix("/healthz"))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, object]]:
    coord_port, a_port, b_port = free_port(), free_port(), free_port()
    coord_url = f"http://127.0.0.1:{coord_port}"
    procs = [
        spawn(
            [
                "coordinator",
                "--port",
                str(coord_port),
                "--chunk-size",
                str(C),
                "--enable-blend-lookup",
                "--log-level",
                "warning",
            ],
            f"{coord_url}/healthz",
        )
    ]
    for name, port in (("node-a", a_port), ("node-b", b_port)):
        procs.append(
            spawn(
                [
                    "node",
                    "--port",
                    str(port),
                    "--instance-id",
                    name,
                    "--coordinator-url",
                    coord_url,
                    "--coordinator-event-reporting",
                    *NODE_FLAGS,
                ],
                f"http://127.0.0.1:{port}/healthz",
            )
        )
    layout = TOY_LAYOUT
    a = NodeEngineClient(f"http://127.0.0.1:{a_port}", layout)
    b = NodeEngineClient(f"http://127.0.0.1:{b_port}", layout)
    yield {"coordinator": coord_url, "a": a, "b": b, "procs": procs, "layout": layout}
    a.close()
    b.close()
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait(timeout=20)


def test_stored_on_a_found_by_b_at_new_offset_and_rerope_exact(fleet: dict[str, object]) -> None:
    a, b = fleet["a"], fleet["b"]
    assert isinstance(a, NodeEngineClient) and isinstance(b, NodeEngineClient)
    model = ToyRopeModel(a.layout)
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 500, 3 * C).astype(np.uint32)
    first = np.concatenate([rng.integers(0, 500, 2 * C).astype(np.uint32), doc])  # doc at p = 2C
    assert a.store(first, model.kv_chunks(first), request_id="store-1") == 5

    coordinator = str(fleet["coordinator"])
    assert wait_for(
        lambda: HTTP.get(f"{coordinator}/directory/stats").json()["keys"] == 5, timeout=20
    )
    assert b.lookup(first) == 5 * C  # prefix: every chunk is in A's L1

    q = 11
    query = np.concatenate(
        [rng.integers(0, 500, q).astype(np.uint32), doc, rng.integers(0, 500, 7).astype(np.uint32)]
    )
    answers: list[object] = []  # None = "ask again" (the fleet leg is pending): poll like an engine
    assert wait_for(
        lambda: answers.append(b.blend_lookup(query, "blend-1")) or answers[-1] is not None
    )
    segments = answers[-1]
    assert isinstance(segments, list)
    assert [(s.old_st, s.cur_st) for s in segments] == [
        (2 * C, q),
        (3 * C, q + C),
        (4 * C, q + 2 * C),
    ]
    got = b.blend_retrieve(query, "blend-1", segments)
    assert got["misses"] == [] and got["sources"] == {"peer_l1": 3}
    for seg, kv in got["parts"]:
        fresh = model.kv_chunk(query[seg.cur_st : seg.cur_st + C], seg.cur_st)
        np.testing.assert_allclose(kv, fresh, atol=1e-4)

    procs = fleet["procs"]
    assert isinstance(procs, list)
    procs[1].send_signal(signal.SIGKILL)  # node A dies
    procs[1].wait(timeout=10)
    after = b.blend_retrieve(query, "blend-2", segments)
    assert after["parts"] == [] and len(after["misses"]) == 3  # misses, and the request completes
