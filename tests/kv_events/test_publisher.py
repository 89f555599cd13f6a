"""The publisher on real ZMQ sockets: a router's view (plain pyzmq SUB + untyped msgspec)
equals the directory's node placements, through stores, deletes, shared pools, fences and
restarts, without echoing engine-sourced placements, and again after a late join with replay
(docs/kv-events.md)."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kvatlas.coordinator.kv_events import KvEventsPublisher
from kvatlas.coordinator.server import free_port
from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.json_codec import decode_json_columns, encode_json
from kvatlas.events.msgpack_codec import decode_msgpack_columns, encode_msgpack
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from tests.conftest import wait_for
from tests.kv_events.router_view import RouterView, State

C = 16
RANK = pack_kv_rank(1, 0, 1, 0)


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def expected(directory: KeyDirectory) -> State:
    """The directory's node placements as a router must see them."""
    out: dict[str, dict[str, set[bytes]]] = {}
    for item in directory.list_keys(limit=10_000).items:
        for p in item.placements:
            if p.tier not in ("l1", "l2"):
                continue
            model = item.key.model_name
            topic = f"kv@pool:{p.backend}@{model}" if p.shared else f"kv@{p.instance_id}@{model}"
            medium = "kvatlas-l1" if p.tier == "l1" else f"kvatlas-l2-{p.backend}"
            out.setdefault(topic, {}).setdefault(medium, set()).add(item.key.chunk_hash)
    return out


class Published:
    def __init__(self, ring: int = 10_000, encoding: str = "vllm", wire: str | None = None) -> None:
        self.directory = KeyDirectory(C)
        self.endpoint, self.replay = free_endpoint(), free_endpoint()
        self.stop = threading.Event()
        self.pub = KvEventsPublisher(
            self.endpoint, self.replay, ring, self.directory, self.stop, encoding
        )
        self.directory.observer = self.pub
        self.pub.open()
        self.thread = threading.Thread(target=self.pub.run, daemon=True)
        self.thread.start()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.seqs: dict[str, int] = {}
        self.encoding = encoding
        self.wire = wire  # None: batches as objects; "msgpack"/"json": as a decoded body

    def router(self) -> RouterView:
        view = RouterView(self.ctx, self.endpoint, self.replay)
        view.replay()  # what was published before this SUB's subscription took hold
        return view

    def emit(self, instance: str, kind: str, tier: str, backend: str, entries: list[CacheEntry],
             *, shared: bool = False, incarnation: int = 1) -> None:  # fmt: skip
        seq = self.seqs[instance] = self.seqs.get(instance, 0) + 1
        batch = EventBatch(instance, incarnation, seq, kind, tier, backend, shared,
                           ts=1.0, entries=tuple(entries))  # fmt: skip
        if self.wire is None:
            assert self.directory.consume(batch).value == "applied"
            return
        # As POST /events hands it over: a body decoded into columns (the observer gets
        # the columns and builds the entries in the publisher's thread).
        if self.wire == "msgpack":
            decoded = decode_msgpack_columns(encode_msgpack([batch]))
        else:
            decoded = decode_json_columns(encode_json([batch]))
        assert decoded[0].columns is not None or not batch.entries or kind != "store"
        assert [o.value for o in self.directory.apply_columns(decoded)] == ["applied"]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.ctx.term()


@pytest.fixture(params=["vllm", "map", "array"])
def published(request: pytest.FixtureRequest) -> Iterator[Published]:
    p = Published(encoding=request.param)
    yield p
    p.close()


ROWS = np.arange(8 * C, dtype=np.uint32).reshape(8, C) + 5


def entry(i: int, model: str = "m", *, tokens: bool = True) -> CacheEntry:
    key = ObjectKey(chunk_hashes(ROWS[i], C)[0], model, RANK)
    return CacheEntry(key, 64, ROWS[i] if tokens else None, 0)


def sees(view: RouterView, directory: KeyDirectory) -> bool:
    return wait_for(lambda: view.pump() == expected(directory), timeout=10)


def test_a_router_sees_exactly_the_directory_placements(published: Published) -> None:
    router_scenario(published)


@pytest.mark.parametrize("wire", ["msgpack", "json"])
def test_batches_decoded_into_columns_are_published_alike(wire: str) -> None:
    p = Published(wire=wire)
    try:
        router_scenario(p)
    finally:
        p.close()


def router_scenario(p: Published) -> None:
    early = p.router()
    p.emit("node-1", "store", "l1", "dram", [entry(0), entry(1), entry(2, tokens=False)])
    p.emit("node-1", "store", "l2", "disk", [entry(3), entry(4, "other")])
    p.emit("node-2", "store", "l2", "s3", [entry(5)], shared=True)
    p.emit("node-2", "store", "l1", "dram", [entry(0)])
    p.emit("node-1", "delete", "l1", "dram", [entry(1)])
    p.emit("pod-a", "store", "gpu", "vllm", [entry(6)])  # engine-sourced: never echoed
    assert sees(early, p.directory)
    assert set(early.view()) == {"kv@node-1@m", "kv@node-1@other", "kv@pool:s3@m", "kv@node-2@m"}
    assert early.view()["kv@node-1@m"] == {
        "kvatlas-l1": {entry(0).key.chunk_hash, entry(2).key.chunk_hash},
        "kvatlas-l2-disk": {entry(3).key.chunk_hash},
    }
    assert early.block_sizes == {C}
    assert early.token_ids[entry(0).key.chunk_hash] == ROWS[0].tolist()
    assert entry(2).key.chunk_hash not in early.token_ids

    # A fence clears the instance's topics; its own L2 copies are published again.
    p.directory.fence_instance("node-1")
    assert sees(early, p.directory)
    assert early.view()["kv@node-1@m"] == {"kvatlas-l2-disk": {entry(3).key.chunk_hash}}
    # A restart (new incarnation) fences first, then stores.
    p.emit("node-2", "store", "l1", "dram", [entry(7)], incarnation=2)
    assert sees(early, p.directory)
    assert early.view()["kv@node-2@m"] == {"kvatlas-l1": {entry(7).key.chunk_hash}}

    late = p.router()
    assert sees(late, p.directory)
    assert late.view() == early.view()
    assert early.encodings == late.encodings == {p.encoding}
    early.close()
    late.close()
    assert p.pub.stats().errors == 0


def test_placements_restored_before_start_are_published_once() -> None:
    directory = KeyDirectory(C)
    directory.consume(EventBatch("node-1", 1, 1, "store", "l2", "disk", entries=(entry(0),)))
    stop = threading.Event()
    pub = KvEventsPublisher(free_endpoint(), replay := free_endpoint(), 100, directory, stop)
    directory.observer = pub
    pub.open()
    thread = threading.Thread(target=pub.run, daemon=True)
    thread.start()
    ctx: zmq.Context[Any] = zmq.Context()
    view = RouterView(ctx, pub.endpoint, replay)
    try:
        assert wait_for(lambda: pub.stats().messages == 1)
        view.replay()
        assert view.pump() == expected(directory) != {}
    finally:
        view.close()
        stop.set()
        thread.join(timeout=5)
        ctx.term()


def test_random_node_traffic_keeps_the_router_view_exact(published: Published) -> None:
    """Seeded random stores, deletes (own, shared), fences, restarts and deregistrations:
    after each burst the router's view equals the directory's node placements."""
    p = published
    rng = np.random.default_rng(7)
    view = p.router()
    incarnations = {"n1": 1, "n2": 1, "n3": 1}
    for burst in range(6):
        for _ in range(40):
            inst = str(rng.choice(list(incarnations)))
            roll = rng.random()
            if roll < 0.05:
                p.directory.fence_instance(inst)
                continue
            if roll < 0.08:
                p.directory.deregister(inst)
                p.seqs.pop(inst, None)
                continue
            if roll < 0.11:
                incarnations[inst] += 1
                p.seqs[inst] = 0
            kind = "delete" if rng.random() < 0.35 else "store"
            tier, backend, shared = [("l1", "dram", False), ("l2", "disk", False),
                                     ("l2", "s3", True)][int(rng.integers(0, 3))]  # fmt: skip
            picked = [entry(int(i), str(rng.choice(["m", "m2"])))
                      for i in rng.choice(8, int(rng.integers(1, 4)), replace=False)]  # fmt: skip
            p.emit(inst, kind, tier, backend, picked, shared=shared,
                   incarnation=incarnations[inst])  # fmt: skip
        assert sees(view, p.directory), f"burst {burst}"
    view.close()


def test_columns_queued_for_the_publisher_still_hold_the_applied_token_ids() -> None:
    """The observer gets the applied ColumnBatch and builds its entries later, in the
    publisher's thread: nothing done after ``apply_columns`` returns (more bodies applied,
    compact narrowing, index writes, entries of one content sharing an arena row) may change
    the ids it publishes. The thread starts only after every body is applied."""
    rng = np.random.default_rng(7)
    directory = KeyDirectory(C)
    directory.enable_blend_lookup()
    stop = threading.Event()
    pub = KvEventsPublisher(free_endpoint(), free_endpoint(), 10_000, directory, stop)
    directory.observer = pub
    pub.open()
    want: dict[bytes, list[int]] = {}
    for seq in range(1, 41):
        high = 1 << 16 if seq % 3 else 1 << 32  # compact and full-width contents
        rows = rng.integers(0, high, (6, C), dtype=np.uint64).astype(np.uint32)
        entries = [CacheEntry(ObjectKey(chunk_hashes(r, C)[0], "m", RANK), 64, r, 0) for r in rows]
        # two ranks of one content: entries sharing one token row of the body
        other = ObjectKey(entries[0].key.chunk_hash, "m", pack_kv_rank(2, 1, 2, 1))
        entries.append(CacheEntry(other, 64, rows[0], 0))
        want.update((e.key.chunk_hash, e.token_ids.tolist()) for e in entries)  # type: ignore[union-attr]
        batch = EventBatch("node-1", 1, seq, "store", "l1", "dram", ts=1.0, entries=tuple(entries))
        body = encode_msgpack([batch]) if seq % 2 else encode_json([batch])
        decoded = (decode_msgpack_columns if seq % 2 else decode_json_columns)(body)
        assert decoded[0].columns is not None
        assert [o.value for o in directory.apply_columns(decoded)] == ["applied"]
    ctx: zmq.Context[Any] = zmq.Context()
    view = RouterView(ctx, pub.endpoint, pub.replay_endpoint)
    thread = threading.Thread(target=pub.run, daemon=True)
    thread.start()
    try:
        view.replay()
        assert wait_for(lambda: view.pump() and len(view.token_ids) == len(want), timeout=10)
        assert view.token_ids == want
    finally:
        view.close()
        stop.set()
        thread.join(timeout=5)
        ctx.term()


def test_a_publisher_that_falls_behind_stays_bounded_and_resyncs_the_routers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches wait for the publisher's thread; when more entries wait than the bound, the
    waiting batches are dropped (counted) and, once the thread catches up, every topic it
    published is cleared and every node placement published again: the router's view ends
    equal to the directory, deletes that were dropped included."""
    from kvatlas.coordinator.kv_events import publisher as module

    p = Published()
    gate = threading.Event()
    views: list[RouterView] = []
    try:
        views.append(view := p.router())
        p.emit("node-1", "store", "l1", "dram", [entry(0), entry(1), entry(2)])
        p.emit("node-2", "store", "l2", "s3", [entry(3)], shared=True)
        assert sees(view, p.directory)
        handle = p.pub._handle

        def slow(item: Any) -> None:  # the thread is busy elsewhere (the GIL, a slow socket)
            gate.wait()
            handle(item)

        monkeypatch.setattr(p.pub, "_handle", slow)
        monkeypatch.setattr(module, "MAX_QUEUED_ENTRIES", 4)
        p.emit("node-1", "delete", "l1", "dram", [entry(0), entry(1)])
        p.emit("node-2", "delete", "l2", "s3", [entry(3)], shared=True)
        for i in range(4, 8):
            p.emit("node-3", "store", "l1", "dram", [entry(i)])
        p.directory.fence_instance("node-3")
        p.emit("node-3", "store", "l2", "disk", [entry(6)])
        stats = p.pub.stats()
        assert stats.dropped_batches >= 1 and stats.queued_entries <= 4
        gate.set()
        assert sees(view, p.directory)
        assert p.pub.stats().overflows == 1
        views.append(late := p.router())
        assert sees(late, p.directory)
    finally:
        gate.set()
        for v in views:
            v.close()
        p.close()


def test_copies_stored_after_a_fence_during_an_overflow_stay_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fence while the queue is over its bound, then copies of the fenced instance stored
    again (their batches dropped: the overflow's resync publishes them). The resync runs
    before the fence would (the fence waits behind it), so the fence's clear must not follow
    it: the router's view ends equal to the directory, the copies stored after the fence
    included."""
    from kvatlas.coordinator.kv_events import publisher as module

    p = Published()
    gate = threading.Event()
    views: list[RouterView] = []
    try:
        views.append(view := p.router())
        p.emit("node-1", "store", "l1", "dram", [entry(0)])
        assert sees(view, p.directory)
        handle = p.pub._handle

        def slow(item: Any) -> None:  # the thread is busy elsewhere
            gate.wait()
            handle(item)

        monkeypatch.setattr(p.pub, "_handle", slow)
        monkeypatch.setattr(module, "MAX_QUEUED_ENTRIES", 2)
        p.emit("node-1", "store", "l1", "dram", [entry(1), entry(2), entry(3)])  # overflows
        p.directory.fence_instance("node-1")
        p.emit("node-1", "store", "l1", "dram", [entry(4)])  # after the fence: dropped
        assert p.pub.stats().dropped_batches == 2
        gate.set()
        assert sees(view, p.directory)
        assert expected(p.directory)["kv@node-1@m"]["kvatlas-l1"] == {entry(4).key.chunk_hash}
    finally:
        gate.set()
        for v in views:
            v.close()
        p.close()


def test_a_fence_of_an_instance_without_own_l2_copies_scans_nothing(published: Published) -> None:
    """Its republish has nothing to send: the directory's counters say so, and the
    publisher runs no listing (a pass over every key, ≈2 µs each)."""
    view = published.router()
    try:
        published.emit("node-1", "store", "l1", "dram", [entry(0), entry(1)])
        published.emit("node-2", "store", "l2", "disk", [entry(2)])
        assert sees(view, published.directory)
        listed: list[Any] = []  # the publisher's listings (the test's own are not counted)
        list_keys = published.directory.list_keys

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is published.thread:
                listed.append(args)
            return list_keys(*args, **kwargs)

        published.directory.list_keys = counted  # type: ignore[method-assign]
        published.directory.fence_instance("node-1")
        published.directory.fence_instance("node-2")  # its own L2 copy is published again
        assert wait_for(lambda: listed, timeout=10)  # (fences are taken in order)
        assert {args[0].instance_id for args in listed} == {"node-2"}  # none for node-1
        assert sees(view, published.directory)
        assert "kv@node-1@m" not in view.view()
        assert view.view()["kv@node-2@m"] == {"kvatlas-l2-disk": {entry(2).key.chunk_hash}}
    finally:
        view.close()


def test_a_replay_read_a_moment_later_is_whole_and_ends() -> None:
    """A router that asks for a replay and reads it only later (busy for a moment) gets the
    whole ring and the end marker: the ROUTER socket queues a full replay (vLLM's publisher
    raises its send limit for this; ZMQ's default, 1,000 messages, dropped the rest and the
    marker without a word)."""
    n, per = 4_000, 32
    p = Published(ring=n)
    rng = np.random.default_rng(5)
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 10)  # (a reader that does not read: back-pressure at once)
    dealer.setsockopt(zmq.RCVBUF, 1 << 16)
    try:
        for _ in range(n):  # one message each, ≈4 KB
            rows = rng.integers(0, 128_256, (per, C), dtype=np.uint32)
            keys = [ObjectKey(chunk_hashes(r, C)[0], "m", RANK) for r in rows]
            entries = [CacheEntry(k, 64, r, 0) for k, r in zip(keys, rows, strict=True)]
            p.emit("node-1", "store", "l1", "dram", entries)
        assert wait_for(lambda: p.pub.stats().messages >= n, timeout=60)
        dealer.connect(p.replay)
        dealer.send_multipart([b"", struct.pack(">q", 0)])
        assert wait_for(lambda: p.pub.stats().replayed_messages >= n, timeout=60)
        seqs = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            seq = struct.unpack(">q", frames[-2])[0]
            if seq == -1:
                break
            seqs.append(seq)
        else:
            raise AssertionError(f"no end marker after {len(seqs)} of {n} messages")
        assert seqs == list(range(seqs[0], seqs[0] + n)) and len(seqs) == n
    finally:
        dealer.close(0)
        ctx.term()
        p.close()
