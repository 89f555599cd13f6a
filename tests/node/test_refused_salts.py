"""A node whose coordinator token may not store for a salt its engine stored under (an engine
token, or a node without engine auth, that stores salts the node's coordinator token lacks):
the coordinator refuses those entries (403 naming the salts), and the node's sink delivers
its batches without them, counted and logged, instead of retrying the send forever while
every later event of the node waits behind it (docs/coordinator.md, "Durability and
transports"). A real coordinator with auth on, a real node process object over HTTP."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.keys import ObjectKey
from kvatlas.node.server import NodeProcess
from tests.conftest import wait_for
from tests.helpers import C, node_config, write_tokens

NODE_TOKEN = "node-n1-" + "x" * 32
ALLOWED, REFUSED = "tenant-a", "tenant-b"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[BackgroundServer, NodeProcess]]:
    """A coordinator with auth on, and node ``n1`` on a shared fs pool whose coordinator token
    may store for :data:`ALLOWED` only."""
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": NODE_TOKEN, "roles": ["emit", "lookup"], "instance_ids": ["n1"],
         "cache_salts": [ALLOWED]},
    )  # fmt: skip
    token_file = tmp_path / "node-token"
    token_file.write_text(NODE_TOKEN)
    token_file.chmod(0o600)
    config = CoordinatorConfig(port=free_port(), chunk_size=C, auth_token_file=tokens)
    with BackgroundServer(config) as server:
        process = NodeProcess(
            node_config(
                instance_id="n1", port=free_port(), coordinator_url=server.url,
                coordinator_event_reporting=True, coordinator_token_file=token_file,
                l2="fs", l2_path=tmp_path / "pool", l2_shared=True, heartbeat_interval_s=0.5,
            )
        )  # fmt: skip
        try:
            yield server, process
        finally:
            process.close()


def store(process: NodeProcess, first: int, salt: str) -> list[ObjectKey]:
    """Store two chunks of a document under ``salt``; their keys."""
    node = process.node
    tokens = np.arange(first, first + 2 * C, dtype=np.uint32)
    tracker = node.tracker(token_ids=tokens, cache_salt=salt)
    kv = [np.full(node.layout.shape, i, dtype=np.float32) for i in range(2)]
    assert node.store(tracker, kv) == 2
    node.flush_events()
    return [node.key(h, salt) for h in tracker.chunk_hashes()]


def held_by_n1(server: BackgroundServer, keys: list[ObjectKey]) -> bool:
    rows = server.service.directory.lookup(keys)
    return all(any(p.instance_id == "n1" for p in row.placements) for row in rows)


def refused_metric(process: NodeProcess) -> str:
    text = generate_latest(process.node.timings.registry).decode()
    return next(
        line for line in text.splitlines()
        if line.startswith('kvatlas_node_events_refused_total{reason="cache_salt"}')
    )  # fmt: skip


def test_a_refused_salt_does_not_block_the_nodes_later_events(
    fleet: tuple[BackgroundServer, NodeProcess], caplog: pytest.LogCaptureFixture
) -> None:
    server, process = fleet
    assert process.sink is not None
    with caplog.at_level(logging.ERROR, logger="kvatlas.client"):
        refused = store(process, 1000, REFUSED)
        allowed = store(process, 2000, ALLOWED)
        # the later store arrives (it waited forever behind the refused one)
        assert wait_for(lambda: held_by_n1(server, allowed), timeout=15)
        assert process.sink.flush(timeout=10)
    rows = server.service.directory.lookup(refused)
    assert all(row.placements == () for row in rows)  # never admitted
    stats = process.sink.stats()
    assert stats.pending == 0
    assert stats.salt_refused_entries == 4  # two chunks, in L1 and in the pool
    assert stats.dropped_batches == stats.quarantined_batches == 0  # nothing lost: no gap
    cursor = server.service.directory.gap_state("n1")
    assert cursor is not None and cursor.gaps == 0
    assert refused_metric(process).endswith(" 4.0")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and repr(REFUSED) in errors[0], errors  # once, then throttled
    assert process.node.stats().to_wire()["event_sink"]["salt_refused_entries"] == 4


def test_the_journal_is_cut_and_a_resync_goes_through_without_the_refused_salt(
    fleet: tuple[BackgroundServer, NodeProcess],
) -> None:
    """The pool journal's lines of the refused entries are cut (nothing was lost, so nothing is
    announced again), and a digest exchange, whose resync listing holds the refused salt's
    placements too, is delivered without them: no gap, no loss, so no exchange in a loop."""
    server, process = fleet
    sink, cutter, resync = process.sink, process.node.pool_journal, process.resync
    assert sink is not None and cutter is not None and resync is not None
    store(process, 1000, REFUSED)
    allowed = store(process, 2000, ALLOWED)
    assert wait_for(lambda: held_by_n1(server, allowed), timeout=15)
    assert wait_for(lambda: len(cutter.journal) == 0, timeout=15)  # cut once they left
    report = resync.run_once()  # the node's L1 holds the refused chunks: its digest differs
    assert report.entries >= 2
    assert sink.flush(timeout=10)
    stats = sink.stats()
    assert stats.dropped_batches == stats.quarantined_batches == 0
    assert stats.salt_refused_entries == 4  # a resync's listing is not counted again
    assert held_by_n1(server, allowed)
    cursor = server.service.directory.gap_state("n1")
    assert cursor is not None and cursor.gaps == 0
