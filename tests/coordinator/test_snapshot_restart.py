"""Restart with the HTTP transport: the shutdown snapshot is restored at start-up (keys,
cursors, blend index rebuilt), and an emitter's outbox resends what the restart missed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hashes, pack_kv_rank

C = 16


def entries(seed: int, n: int) -> list[CacheEntry]:
    rows = np.random.default_rng(seed).integers(0, 1000, (n, C)).astype(np.uint32)
    rank = pack_kv_rank(1, 0, 1, 0)
    return [CacheEntry(ObjectKey(chunk_hashes(r, C)[0], "m", rank), 64, r, 3 * C) for r in rows]


def test_restart_restores_snapshot_and_outbox_fills_the_gap(tmp_path: Path) -> None:
    port = free_port()
    config = CoordinatorConfig(
        port=port, chunk_size=C, enable_blend_lookup=True, snapshot_path=tmp_path / "d.snap"
    )
    sink = EventSink(
        "node", HttpTransport(f"http://127.0.0.1:{port}"), incarnation=9, backoff_max=0.2
    )
    first, second = entries(1, 20), entries(2, 20)
    with BackgroundServer(config):
        sink.emit("store", "l1", "dram", first)
        assert sink.flush(20)
    sink.emit("store", "l1", "dram", second)  # while the coordinator is down
    with BackgroundServer(config) as server:
        directory = server.service.directory
        # restored, answering, and not ready until the instances resynced (test_resync.py);
        # this emitter never registered: the wait is bounded by the instance timeout
        assert server.service.state == "resyncing"
        assert sink.flush(20)
        assert directory.stats().keys == 40
        cursor = directory.gap_state("node")
        assert cursor is not None and (cursor.incarnation, cursor.last_seq, cursor.gaps) == (
            9,
            2,
            0,
        )
        query = np.concatenate([np.array([5, 5], np.uint32), first[0].token_ids])  # type: ignore[list-item]
        matches = directory.blend_match(query, BlendNamespace("m"))
        assert [(m.old_st, m.cur_st) for m in matches] == [(3 * C, 2)]  # index rebuilt on restore
    sink.close(timeout=1)


def test_a_restart_from_an_unreadable_snapshot_resyncs_before_serving(tmp_path: Path) -> None:
    """A snapshot that cannot be read (truncated, corrupt) is set aside and the coordinator
    starts empty: it lost what it knew, as surely as one restarted from a snapshot misses what
    came after it — so it resyncs before it says ``serving`` (it said ``serving`` at once, an
    empty directory a load balancer would send lookups to). A first start (no snapshot file)
    has nothing to resync: ``serving``."""
    path = tmp_path / "d.snap"
    config = CoordinatorConfig(port=free_port(), chunk_size=C, snapshot_path=path)
    with BackgroundServer(config) as server:
        assert server.service.state == "serving"  # a first start
    path.write_bytes(b"KVAS" + b"\x00" * 200)  # not a snapshot this release reads
    with BackgroundServer(config) as server:
        assert server.service.state == "resyncing"
        assert list(tmp_path.glob("d.snap.unreadable-*"))
