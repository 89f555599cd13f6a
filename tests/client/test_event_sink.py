"""EventSink over real HTTP: outbox survives a coordinator outage (every batch delivered once),
drops beyond the bound are counted and show up as a gap at the coordinator."""

from __future__ import annotations

import threading

import numpy as np

from kvatlas.client import EventSink, HttpTransport, InProcessTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.conftest import wait_for

CHUNK = 16


def entry(i: int) -> CacheEntry:
    tokens = np.arange(i * CHUNK, (i + 1) * CHUNK, dtype=np.uint32)
    (h,) = chunk_hashes(tokens, CHUNK)
    return CacheEntry(ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0)), 100, tokens, 0)


def test_outbox_delivers_everything_once_after_coordinator_outage() -> None:
    port = free_port()
    config = CoordinatorConfig(port=port, chunk_size=CHUNK)
    sink = EventSink(
        "node-a", HttpTransport(f"http://127.0.0.1:{port}"), incarnation=5, backoff_max=0.2
    )
    for i in range(30):  # coordinator not running yet: everything waits in the outbox
        assert sink.emit("store", "l1", "dram", [entry(i)])
    # the sender has tried and failed at least once (however late the machine lets it run)
    assert wait_for(lambda: sink.retries >= 1, timeout=20)
    assert not sink.flush(timeout=0.3)  # nothing can be delivered while it is down
    with BackgroundServer(config) as server:
        assert sink.flush(timeout=20)
        stats = server.service.directory.stats()
        assert stats.keys == 30
        assert stats.batches == {"applied": 30, "duplicate": 0, "stale": 0}
        assert server.service.directory.gap_state("node-a").gaps == 0  # type: ignore[union-attr]
    sink.close(timeout=0.5)


def test_drops_beyond_the_bound_are_counted_and_visible_as_a_gap() -> None:
    port = free_port()
    config = CoordinatorConfig(port=port, chunk_size=CHUNK)
    sink = EventSink(
        "node-b",
        HttpTransport(f"http://127.0.0.1:{port}"),
        incarnation=1,
        max_outbox=10,
        backoff_max=0.2,
    )
    results = [sink.emit("store", "l1", "dram", [entry(i)]) for i in range(25)]
    assert sum(results) == 10  # the bound covers queued and in-flight batches alike
    assert sink.dropped_batches == 25 - sum(results)
    with BackgroundServer(config) as server:
        assert sink.flush(timeout=20)
        sink.emit("store", "l1", "dram", [entry(99)])  # the next batch reveals the gap
        assert sink.flush(timeout=20)
        cursor = server.service.directory.gap_state("node-b")
        assert cursor is not None and cursor.gaps == 1
        assert cursor.missing_batches == sink.dropped_batches
        rows = {r.instance_id: r for r in server.service.instances_view()}
        assert rows["node-b"].emitter.gaps == 1
    sink.close(timeout=0.5)


def test_in_process_transport_and_monotonic_incarnation() -> None:
    directory = KeyDirectory(CHUNK)
    first = EventSink("emb", InProcessTransport(directory.consume))
    first.emit("store", "l1", "dram", [entry(1)])
    assert first.flush()
    first.close()
    second = EventSink("emb", InProcessTransport(directory.consume))  # a restart: new incarnation
    assert second.incarnation > first.incarnation
    second.emit("store", "l1", "dram", [entry(2)])
    assert second.flush()
    second.close()
    assert wait_for(lambda: directory.stats().keys == 1)  # the restart fenced the old L1 copy


def test_emitter_restarted_twice_within_a_second_is_fenced_each_time() -> None:
    """Nanosecond incarnations grow across quick restarts; each restart fences the previous
    incarnation's L1 copies, and a late batch from an older incarnation is stale."""
    directory = KeyDirectory(CHUNK)
    sinks = []
    for i in range(3):
        sink = EventSink("quick", InProcessTransport(directory.consume))
        sink.emit("store", "l1", "dram", [entry(10 + i)])
        assert sink.flush()
        sinks.append(sink)
    assert sinks[0].incarnation < sinks[1].incarnation < sinks[2].incarnation
    assert sinks[2].incarnation - sinks[0].incarnation < 1_000_000_000
    assert directory.stats().keys == 1  # only the newest incarnation's copy is live
    sinks[0].emit("store", "l1", "dram", [entry(20)])  # a late batch from a dead incarnation
    assert sinks[0].flush()
    assert directory.stats().keys == 1 and directory.stats().batches["stale"] == 1
    for sink in sinks:
        sink.close()


def test_a_flush_waits_for_what_was_queued_before_it_not_after() -> None:
    """A busy node's outbox is seldom empty: a flush that waited for an empty outbox kept
    waiting for batches queued after it (the pool journal is cut after a flush)."""
    gates = {1: threading.Event(), 2: threading.Event()}

    def consume(batch: EventBatch) -> None:
        gates[batch.seq].wait(30)

    sink = EventSink("n", InProcessTransport(consume), incarnation=1, max_batches_per_send=1)
    try:
        assert sink.emit("store", "l1", "dram", [entry(1)])  # delivery waits at the gate
        flushed: list[bool] = []
        flusher = threading.Thread(target=lambda: flushed.append(sink.flush(timeout=20)))
        flusher.start()
        assert wait_for(lambda: sink.pending == 1)
        assert sink.emit("store", "l1", "dram", [entry(2)])  # queued after the flush began
        gates[1].set()
        flusher.join(timeout=30)
        assert flushed == [True] and sink.pending == 1  # batch 2 still in delivery
        assert not sink.flush(timeout=0.2)  # negative control: now batch 2 is waited for
    finally:
        gates[2].set()
        sink.close()
