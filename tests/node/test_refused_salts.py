"""A node whose coordinator token may not store for a salt its engine stored under (an engine
token, or a node without engine auth, that stores salts the node's coordinator token lacks):
the coordinator refuses those entries (403 naming the salts), and the node's sink delivers
its batches without them, counted and logged, instead of retrying the send forever while
every later event of the node waits behind it (docs/coordinator.md, "Durability and
transports"). On the Redis transport the coordinator cannot answer the node: it applies the
node's signed stream entry without those entries itself. A real coordinator with auth on, a
real node process object, over HTTP and over a real Redis stream."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import EventBatch
from kvatlas.keys import ObjectKey
from kvatlas.node.server import NodeProcess
from tests.conftest import RedisServer, wait_for
from tests.helpers import C, node_config, write_tokens

NODE_TOKEN = "node-n1-" + "x" * 32
ALLOWED, REFUSED = "tenant-a", "tenant-b"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[BackgroundServer, NodeProcess]]:
    """A coordinator with auth on, and node ``n1`` on a shared fs pool whose coordinator token
    may store for :data:`ALLOWED` only."""
    yield from _fleet(tmp_path, {})


@pytest.fixture
def stream_fleet(
    tmp_path: Path, redis_server: RedisServer
) -> Iterator[tuple[BackgroundServer, NodeProcess]]:
    """The same on the Redis transport: the node signs its stream entries with its token."""
    stream = f"refused-salts-{time.time_ns()}"
    transport = {"event_transport": "redis", "redis_url": redis_server.url, "event_stream": stream}
    yield from _fleet(tmp_path, transport)


def _fleet(
    tmp_path: Path, transport: dict[str, str]
) -> Iterator[tuple[BackgroundServer, NodeProcess]]:
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": NODE_TOKEN, "roles": ["emit", "lookup"], "instance_ids": ["n1"],
         "cache_salts": [ALLOWED]},
    )  # fmt: skip
    token_file = tmp_path / "node-token"
    token_file.write_text(NODE_TOKEN)
    token_file.chmod(0o600)
    config = CoordinatorConfig(port=free_port(), chunk_size=C, auth_token_file=tokens, **transport)
    with BackgroundServer(config) as server:
        process = NodeProcess(
            node_config(
                instance_id="n1", port=free_port(), coordinator_url=server.url,
                coordinator_event_reporting=True, coordinator_token_file=token_file,
                l2="fs", l2_path=tmp_path / "pool", l2_shared=True, heartbeat_interval_s=0.5,
                **transport,
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


def coordinator_counts(server: BackgroundServer, family: str, label: str) -> dict[str, float]:
    """The coordinator's ``family`` series by the value of ``label`` (its first label)."""
    text = generate_latest(server.service.metrics.registry).decode()
    pattern = rf'^{family}_total\{{(?:[a-z_]+="[^"]*",)*?{label}="([a-z_]+)"[^}}]*\}} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def coordinator_refused(server: BackgroundServer) -> dict[str, float]:
    """``kvatlas_event_refused_entries_total{reason="cache_salt"}`` by ``transport``."""
    return coordinator_counts(server, "kvatlas_event_refused_entries", "transport")


def rejected_bodies(server: BackgroundServer) -> dict[str, float]:
    """``kvatlas_event_rejected_bodies_total`` by ``reason``."""
    return coordinator_counts(server, "kvatlas_event_rejected_bodies", "reason")


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
    assert coordinator_refused(server) == {"http": 4.0}  # in the bodies it refused (403)
    assert rejected_bodies(server).get("cache_salt", 0) >= 1
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
    assert coordinator_refused(server) == {"http": 4.0}  # nor by the coordinator
    assert held_by_n1(server, allowed)
    cursor = server.service.directory.gap_state("n1")
    assert cursor is not None and cursor.gaps == 0


def test_a_stream_entry_with_a_refused_salt_is_applied_without_its_entries(
    stream_fleet: tuple[BackgroundServer, NodeProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """One signed stream entry holds the node's batches of both salts: the coordinator applies
    it without the refused salt's entries (every batch's seq with it: no gap), counts them and
    logs once. It used to refuse the entry whole: the allowed placements never arrived, and
    the gap made the coordinator ask the node for a digest exchange at every heartbeat, whose
    listing, holding the refused salt too, was refused whole again (a loop)."""
    server, process = stream_fleet
    sink, resync = process.sink, process.resync
    assert sink is not None and resync is not None
    assert wait_for(lambda: sink.stats().pending == 0 and resync.exchanges >= 1, timeout=15)
    gate = threading.Event()
    real_send = sink.transport.send

    def held(batches: Sequence[EventBatch]) -> None:
        gate.wait(10)
        real_send(batches)

    sink.transport.send = held  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="kvatlas.coordinator"):
        refused = store(process, 1000, REFUSED)
        allowed = store(process, 2000, ALLOWED)
        gate.set()  # both stores' batches go out in one stream entry
        assert sink.flush(timeout=10)
        assert sink.stats().sent_batches >= 5 and sink.stats().retries == 0
        assert wait_for(lambda: held_by_n1(server, allowed), timeout=15)
        exchanges = resync.exchanges
        for doc in range(6):  # the node goes on storing; a heartbeat (0.5 s) after each
            later = store(process, 3000 + 100 * doc, ALLOWED)
            assert wait_for(lambda: held_by_n1(server, later), timeout=15)  # noqa: B023
            time.sleep(0.5)
    # no digest exchange was asked for: no gap (a later batch showed the gap of each refused
    # listing, and the next heartbeat asked for another)
    assert resync.exchanges == exchanges, (exchanges, resync.exchanges)
    assert all(row.placements == () for row in server.service.directory.lookup(refused))
    cursor = server.service.directory.gap_state("n1")
    assert cursor is not None and cursor.gaps == 0
    assert coordinator_refused(server) == {"stream": 4.0}  # two chunks, in L1 and the pool
    warned = [r.getMessage() for r in caplog.records if repr(REFUSED) in r.getMessage()]
    assert len(warned) == 1, warned  # then once a minute per instance and salt
    # a listing of both salts (the node's L1 holds the refused chunks: its digest differs) is
    # applied without them too, and not counted again
    report = resync.run_once()
    assert report.entries >= 2  # the refused chunks in L1 (the pool is no own tier)
    assert sink.flush(timeout=10)
    assert wait_for(lambda: server.service.stream_position == _last_id(server), timeout=15)
    assert held_by_n1(server, allowed)
    cursor = server.service.directory.gap_state("n1")
    assert cursor is not None and cursor.gaps == 0 and cursor.last_seq == sink.stats().seq
    assert coordinator_refused(server) == {"stream": 4.0}


def _last_id(server: BackgroundServer) -> str:
    consumer = server.service.stream_consumer
    assert consumer is not None
    last = consumer.client.xinfo_stream(consumer.stream)["last-generated-id"]
    return last.decode() if isinstance(last, bytes) else str(last)
