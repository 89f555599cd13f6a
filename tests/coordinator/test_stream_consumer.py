"""The Redis Streams consumer through its seams (ingest, position, readiness, stop, errors),
without Redis and without a service: entries are applied in order, each position is reported
after its entry is applied and before it is acknowledged, a malformed entry is skipped and
counted, and readiness becomes ``serving`` once, at the end of the stream; the readiness
tracker keeps ``resyncing`` until the digest exchanges end it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvatlas.coordinator import stream_consumer
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import InstanceRegistry, Registration
from kvatlas.coordinator.readiness import ReadinessTracker
from kvatlas.coordinator.stream_consumer import StreamConsumer
from kvatlas.coordinator.views import Readiness
from kvatlas.events import ColumnBatch, EventBatch
from kvatlas.events.stream_format import encode_stream_fields


class FakeRedis:
    """Serves the given replies to XREADGROUP, then an empty stream; records calls."""

    def __init__(self, replies: list[Any], log: list[tuple[str, Any]]) -> None:
        self.replies = replies
        self.log = log
        self.queued: list[Any] = []

    def xgroup_create(self, stream: str, group: str, id: str, mkstream: bool) -> None:
        self.log.append(("group", id))

    def xinfo_stream(self, stream: str) -> dict[str, Any]:
        return {"length": 2, "last-generated-id": b"7-0"}

    def xinfo_groups(self, stream: str) -> list[dict[str, Any]]:
        return []  # a group not created yet: nothing lost (this process never joined)

    def xreadgroup(self, group: str, consumer: str, streams: dict[str, str], **kw: Any) -> Any:
        if ">" not in streams.values():  # a read of its own pending entries: showing itself
            return []
        self.log.append(("read", kw["count"]) if kw["block"] else ("read at once", kw["count"]))
        return self.replies.pop(0) if self.replies else []

    def pipeline(self, transaction: bool) -> Any:
        return self

    def time(self) -> None:
        self.queued = [(0, 0)]

    def info(self, section: str) -> None:
        self.queued.append({"uptime_in_seconds": 86400})  # up for long

    def xinfo_consumers(self, stream: str, group: str) -> None:
        self.queued.append([])  # no other replica consumes the group

    def execute(self) -> list[Any]:
        return self.queued

    def xgroup_delconsumer(self, stream: str, group: str, consumer: str) -> int:
        return 0

    def xack(self, stream: str, group: str, entry_id: bytes) -> None:
        self.log.append(("ack", entry_id.decode()))


def _run(replies: list[Any], log: list[tuple[str, Any]]) -> tuple[StreamConsumer, Any]:
    """A consumer of ``replies`` (from position 5-0), run until it says ``serving``; its
    calls in ``log``; returns it and its metrics' registry."""
    stop = threading.Event()
    registry = CollectorRegistry()
    errors = Counter("errors", "stream errors", ["kind"], registry=registry)
    rejected = Counter("rejected", "stream entries refused", ["reason"], registry=registry)

    def ingest(_who: object, batches: Sequence[ColumnBatch]) -> None:
        log.append(("ingest", [b.header.seq for b in batches]))

    def set_readiness(state: Readiness) -> None:
        log.append(("ready", state))
        if state is Readiness.SERVING:
            stop.set()

    consumer = StreamConsumer(
        CoordinatorConfig(event_transport="redis", redis_url="redis://127.0.0.1:1/0"),
        attribute=lambda fields: None,
        ingest=ingest,
        position="5-0",
        on_position=lambda position: log.append(("position", position)),
        set_readiness=set_readiness,
        stop=stop,
        errors=errors,
        rejected=rejected,
    )
    consumer.client = FakeRedis(replies, log)  # type: ignore[assignment]
    thread = threading.Thread(target=consumer.run)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    return consumer, registry


def test_consumer_applies_reports_and_becomes_ready() -> None:
    log: list[tuple[str, Any]] = []
    good = encode_stream_fields([EventBatch("a", 1, 1, "access", "l1", "dram")])
    bad = {b"fmt": b"json", b"data": b"{not json"}
    consumer, registry = _run([[("s", [(b"6-0", good)])], [("s", [(b"7-0", bad)])]], log)
    assert log == [
        ("group", "5-0"),  # rewound to the position it was given
        ("ready", Readiness.CATCHING_UP),
        ("read", 1),
        ("ingest", [1]),
        ("position", "6-0"),
        ("ack", "6-0"),
        # a full read: the next asks without waiting, for about 8 MB of entries of the size
        # seen (as many as a read may ask for)
        ("read at once", 256),
        ("position", "7-0"),  # skipped, never blocks the stream
        ("ack", "7-0"),
        ("ready", Readiness.SERVING),
    ]
    assert consumer.position == "7-0"
    assert (consumer.applied_entries, consumer.bad_entries) == (1, 1)
    assert registry.get_sample_value("errors_total", {"kind": "decode"}) == 1


def test_a_read_asks_for_about_8_mb_of_entries_of_the_size_the_last_one_returned() -> None:
    """Each read's count follows the previous read's entries (the first asks for one): 1 MB
    entries are read 8 at a time (not 256: a reply of 256 MB held at once), small ones 256 at
    a time; every entry is still applied (here: refused as undecodable, and acknowledged) in
    order."""
    log: list[tuple[str, Any]] = []
    big = {b"fmt": b"json", b"data": b"x" * ((1 << 20) - 4)}  # 1 MiB, undecodable: skipped
    small = {b"fmt": b"json", b"data": b"x" * 100}
    ids = iter(range(6, 1000))

    def reply(fields: dict[bytes, bytes], n: int) -> list[Any]:
        return [("s", [(f"{next(ids)}-0".encode(), fields) for _ in range(n)])]

    replies = [reply(big, 1), reply(big, 8), reply(small, 8), reply(small, 2)]
    consumer, _ = _run(replies, log)
    reads = [(what, count) for what, count in log if what in ("read", "read at once")]
    assert reads == [("read", 1), ("read at once", 8), ("read at once", 8), ("read at once", 256)]
    assert consumer.bad_entries == 19 and consumer.position == "24-0"
    acks = [entry for what, entry in log if what == "ack"]
    assert acks == [f"{n}-0" for n in range(6, 25)]
    assert stream_consumer.read_count([(b"1-0", {b"data": b"x" * (64 << 20)})]) == 1
    assert stream_consumer.read_count([(b"1-0", {})]) == stream_consumer.READ_COUNT


def test_a_backlog_read_to_its_end_is_serving_without_waiting_a_block_time() -> None:
    """A read that came back full is followed by one that does not wait for new entries:
    the empty answer says the backlog was read to its end (``serving`` at once); only then
    does the consumer wait on the stream again."""
    log: list[tuple[str, Any]] = []
    good = encode_stream_fields([EventBatch("a", 1, 1, "access", "l1", "dram")])
    _run([[("s", [(b"6-0", good)])], []], log)
    reads = [what for what, _count in log if what in ("read", "read at once")]
    assert reads == ["read", "read at once"]  # the second, empty, ended the catching up
    assert log[-1] == ("ready", Readiness.SERVING)


def test_events_lost_after_serving_wait_for_the_stream_to_be_read_again() -> None:
    """Redis lost events after this replica had once read the stream to its end: the digest
    exchanges alone do not end ``resyncing``; what the rewound group still has is read to its
    end first (the consumer says ``serving`` again)."""
    now = [0.0]
    instances = InstanceRegistry(30.0, lambda _id: None, lambda: now[0])
    instances.register("n1", Registration())
    tracker = ReadinessTracker(instances, 30.0, lambda: now[0])
    tracker.set(Readiness.SERVING)
    tracker.set(Readiness.RESYNCING)  # the consumer found events lost and rewound its group
    tracker.set(Readiness.CATCHING_UP)
    instances.digest_done("n1")
    tracker.check_resynced()
    assert tracker.state is Readiness.RESYNCING  # the rewound stream was not read again yet
    tracker.set(Readiness.SERVING)
    tracker.check_resynced()
    assert tracker.state is Readiness.SERVING


def test_resyncing_outlasts_catching_up_and_only_a_held_group_overrides_it() -> None:
    """``ReadinessTracker``: once resyncing, a transport saying it caught up changes nothing;
    the digest exchanges end it (after the stream was read to its end); ``group_held`` is
    final."""
    now = [0.0]
    instances = InstanceRegistry(30.0, lambda _id: None, lambda: now[0])
    instances.register("n1", Registration())
    tracker = ReadinessTracker(instances, 30.0, lambda: now[0])
    tracker.set(Readiness.CATCHING_UP)
    tracker.set(Readiness.RESYNCING)  # e.g. Redis lost events while catching up
    tracker.set(Readiness.CATCHING_UP)
    assert (tracker.state, instances.owing()) == (Readiness.RESYNCING, {"n1"})
    instances.digest_done("n1")
    tracker.check_resynced()
    assert tracker.state is Readiness.RESYNCING  # the stream was not read to its end yet
    tracker.set(Readiness.SERVING)
    assert tracker.state is Readiness.RESYNCING
    tracker.check_resynced()
    assert tracker.state is Readiness.SERVING
    tracker.set(Readiness.RESYNCING)
    tracker.set(Readiness.GROUP_HELD)
    now[0] += 61  # past the time bound: still held, never serving
    tracker.check_resynced()
    assert tracker.state is Readiness.GROUP_HELD
