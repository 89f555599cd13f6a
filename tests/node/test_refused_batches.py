"""A node whose every batch the coordinator refuses for good (a 422: here its incarnation,
its start time, lies beyond the coordinator's clock + ``--max-clock-skew-s``, as for a node
whose clock runs an hour ahead): each batch is quarantined, but the node logs one ERROR a
minute, not one per batch, and its pool journal announces the journaled keys again with a
backoff, not every second (docs/node.md, "L2 bounds"; docs/coordinator.md, "Durability and
transports"). A real coordinator over HTTP, a real node process object on a shared fs pool."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvatlas.client import EventSink
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.node.server import NodeProcess
from tests.helpers import C, node_config

HOUR_NS = 3600 * 10**9
ANNOUNCING = "announcing the journaled pool keys again"


@pytest.fixture
def skewed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[BackgroundServer, NodeProcess]]:
    """A coordinator, and node ``n1`` on a shared fs pool whose incarnation lies an hour
    ahead of the coordinator's clock (its sink is made so: the clock of the machine it
    started on ran ahead)."""
    ahead = functools.partial(EventSink, incarnation=time.time_ns() + HOUR_NS)
    monkeypatch.setattr("kvatlas.node.server.EventSink", ahead)
    with BackgroundServer(CoordinatorConfig(port=free_port(), chunk_size=C)) as server:
        process = NodeProcess(
            node_config(
                instance_id="n1", port=free_port(), coordinator_url=server.url,
                coordinator_event_reporting=True, l2="fs", l2_path=tmp_path / "pool",
                l2_shared=True, heartbeat_interval_s=0.5,
            )
        )  # fmt: skip
        try:
            yield server, process
        finally:
            process.close()


def test_a_refusal_of_every_batch_is_logged_once_and_announced_with_backoff(
    skewed: tuple[BackgroundServer, NodeProcess], caplog: pytest.LogCaptureFixture
) -> None:
    server, process = skewed
    node, sink, cutter = process.node, process.sink, process.node.pool_journal
    assert sink is not None and cutter is not None
    with caplog.at_level(logging.WARNING):
        for doc in range(4):  # four stores, each an L1 and a pool batch, each refused
            tokens = np.arange(1000 * doc, 1000 * doc + 2 * C, dtype=np.uint32)
            tracker = node.tracker(token_ids=tokens)
            kv = [np.full(node.layout.shape, i, dtype=np.float32) for i in range(2)]
            assert node.store(tracker, kv) == 2
            node.flush_events()
        assert sink.flush(timeout=10)
        time.sleep(6.5)  # a window of ticks of the journal's cutter (one a second)
    stats = sink.stats()
    assert stats.quarantined_batches >= 8 and stats.sent_batches == 0
    assert server.service.directory.gap_state("n1") is None  # nothing was ever admitted
    refusals = [
        r for r in [*caplog.get_records("setup"), *caplog.records]
        if r.levelno == logging.ERROR and "quarantined" in r.getMessage()
    ]  # fmt: skip
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # then once a minute
    announced = [r.created for r in caplog.records if ANNOUNCING in r.getMessage()]
    # at once, then 2 s, 4 s, ... after an announcement that was refused too: it was once a
    # second, each reading every journaled key's pool file and refused again
    assert 1 <= len(announced) <= 3, announced
    assert len(cutter.journal) > 0  # kept: once the refusal ends, an announcement delivers
    # the digest exchanges the losses call for back off alike (they listed every prefix of
    # the node each second, each listing refused again)
    assert process.resync is not None and process.resync.exchanges <= 4, process.resync.exchanges
