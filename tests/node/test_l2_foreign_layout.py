"""A node restarted on its own fs L2 with another KV layout (here 2 layers, then 1) does not
adopt the old layout's files at the rescan: they are no lookup hit, no placement at the
coordinator, and stay on disk (counted), usable again by a node of their layout. Found by
black-box probing: the old layout's chunks were announced and promised by every lookup, while
retrieval refused each of them (``fetched_wrong_layout``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvatlas.asgi_thread import free_port
from kvatlas.client import CoordinatorClient, EngineClient
from kvatlas.keys import KeyScheme, ObjectKey, RequestTracker
from kvatlas.processes import spawn_service, stop
from tests.conftest import wait_for
from tests.helpers import C, node_config, spawn_coordinator


def node_args(port: int, l2: Path, num_layers: int, *coordinator: str) -> list[str]:
    return [
        "-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "n1",
        "--model-name", "toy", "--num-layers", str(num_layers), "--num-kv-heads", "2",
        "--head-dim", "16", "--chunk-size", str(C), "--dtype", "float32",
        "--l2", "fs", "--l2-path", str(l2), "--log-level", "warning", *coordinator,
    ]  # fmt: skip


def keys_of(tokens: np.ndarray) -> list[ObjectKey]:
    tracker = RequestTracker(tokens, (), scheme=KeyScheme("blake3", C))
    kv_rank = node_config().kv_rank
    return [ObjectKey(h, "toy", kv_rank, 0, "") for h in tracker.chunk_hashes()]


def store(url: str, tokens: np.ndarray) -> int:
    with EngineClient(url) as engine:
        rng = np.random.default_rng(0)
        kv = [rng.standard_normal(engine.layout.shape).astype(np.float32) for _ in tokens[::C]]
        return engine.store(tokens, kv)


def test_a_restart_with_another_layout_leaves_the_old_layouts_files_unused(
    tmp_path: Path,
) -> None:
    l2 = tmp_path / "l2"
    port, coord_port = free_port(), free_port()
    url, coord = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{coord_port}"
    old = np.arange(1000, 1000 + 4 * C, dtype=np.uint32)  # 4 chunks of the 2-layer layout
    proc = spawn_service(node_args(port, l2, 2), url)
    try:
        assert store(url, old) == 4
    finally:
        stop([proc])
    files = sorted(l2.rglob("*.kvc"))
    assert len(files) == 4

    procs = [spawn_coordinator(coord_port, "--chunk-size", str(C))]
    try:  # the restart: one layer now, reporting to a coordinator
        reporting = ("--coordinator-url", coord, "--coordinator-event-reporting")
        procs.append(spawn_service(node_args(port, l2, 1, *reporting), url))
        with EngineClient(url) as engine:
            assert engine.layout.num_layers == 1
            assert engine.lookup(old) == 0  # no promise of chunks it cannot hand out
            assert engine.retrieve(old)[0] == []
            new = np.arange(5000, 5000 + C, dtype=np.uint32)
            assert store(url, new) == 1
            stats = engine.stats()
        assert stats["l2_foreign_layout_kept"] == 4 and stats.get("l2_rescanned", 0) == 0

        def placements(keys: list[ObjectKey]) -> set[tuple[ObjectKey, str]]:
            with CoordinatorClient(coord) as c:
                found = [r.placements for r in c.lookup_keys(keys).results]
            return {(k, p.tier) for k, pls in zip(keys, found, strict=True) for p in pls}

        # the new chunk's events come after whatever the rescan announced: once they are in,
        # the old layout's chunks would be too
        new_key = keys_of(new)[0]
        assert wait_for(lambda: placements([new_key]) == {(new_key, "l1"), (new_key, "l2")})
        assert placements(keys_of(old)) == set()
        assert all(f.exists() for f in files)  # kept, not deleted: not corrupt, only foreign
    finally:
        stop(procs)

    proc = spawn_service(node_args(port, l2, 2), url)  # back to their layout: usable again
    try:
        with EngineClient(url) as engine:
            assert engine.lookup(old) == 4 * C
            assert len(engine.retrieve(old)[0]) == 4
    finally:
        stop([proc])
