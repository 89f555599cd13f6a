"""No KV-event message costs the coordinator more than bounded work (issue 25 items 4 and 6,
docs/kv-events.md "Bounded work per message", docs/security.md): a maximal message is decoded a
group at a time and applied in slices while ``/healthz`` answers; a failed slice is a gap at
once; a frame above ``--kv-events-max-message-bytes`` is refused by ZMQ on the SUB sockets
(connected and bound) and the replay DEALER, without the coordinator's memory growing by it,
and the next message is applied. Real coordinator process, real PUB sockets, loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from kvatlas.bench.kv_events_stall import (
    EngineCoordinator,
    Poller,
    maximal_message,
    subscriber_stats,
)
from kvatlas.coordinator.config import parse_config
from kvatlas.coordinator.kv_events import KvEventsSubscriber, LinkSpec, SubscriberSettings
from kvatlas.coordinator.kv_events.batch_checks import BadBatch
from kvatlas.coordinator.kv_events.rekey import SLICE_ENTRIES
from kvatlas.coordinator.server import free_port
from kvatlas.events import ColumnBatch
from kvatlas.events.vllm_wire import (
    DECODE_GROUP_BYTES,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    VllmWireError,
    decode_batch,
    encode_batch,
    pack_seq,
    split_batch,
)
from kvatlas.keys import KeyScheme
from tests.conftest import HTTP, wait_for
from tests.kv_events.helpers import FakeEngine, fed

C = 16
MAX_BLOCKS = 50_000  # the coordinator's --kv-events-max-blocks: a maximal message has as many
LIMIT = 256 * MAX_BLOCKS  # the derived --kv-events-max-message-bytes


@pytest.fixture(scope="module")
def coordinator() -> Iterator[tuple[EngineCoordinator, Any, str]]:
    """A coordinator connected to this process's PUB (``pod-a``) and bound for a second
    publisher that connects (``pod-b``); the second PUB socket and its topic come with it."""
    bound = f"tcp://127.0.0.1:{free_port()}"
    c = EngineCoordinator(C, MAX_BLOCKS, "--kv-events-bind", f"pod-b={bound}")
    pub_b = c.ctx.socket(zmq.PUB)
    pub_b.setsockopt(zmq.LINGER, 0)
    pub_b.connect(bound)
    try:
        yield c, pub_b, bound
    finally:
        pub_b.close(0)
        c.close()


def request_tokens(payload: bytes, event: int) -> list[int]:
    return list(decode_batch(payload).events[event].token_ids)  # type: ignore[union-attr]


def prefix(url: str, tokens: list[int]) -> list[tuple[str, str, int]]:
    found = httpx.post(
        f"{url}/directory/lookup", json={"token_ids": tokens, "model_name": "llama"}
    ).json()
    return [(h["instance_id"], h["tier"], h["chunks"]) for h in found["prefix"]]


def instance(url: str, instance_id: str) -> dict[str, Any]:
    listed = HTTP.get(f"{url}/instances").json()["instances"]
    found: dict[str, Any] = next(i for i in listed if i["instance_id"] == instance_id)
    return found


def test_a_maximal_message_is_applied_in_slices_while_healthz_answers(
    coordinator: tuple[EngineCoordinator, Any, str],
) -> None:
    c, _, _ = coordinator
    payload = maximal_message(np.random.default_rng(1), MAX_BLOCKS)
    assert len(payload) <= LIMIT  # the derived limit takes a maximal message
    c.send_until_applied(maximal_message(np.random.default_rng(2), 1))
    gaps = instance(c.url, "pod-a")["gaps"]
    poller = Poller(c.url, "/healthz")
    poller.start()
    try:
        before = c.stats()
        c.send(payload)
        c.wait_applied(before["batches"] + 1)
    finally:
        poller.stop()
    after = c.stats()
    # every block completes a chunk (block size = chunk size): one entry per block
    assert after["chunks_stored"] - before["chunks_stored"] == MAX_BLOCKS
    slices = after["slices"] - before["slices"]
    assert slices >= -(-MAX_BLOCKS // SLICE_ENTRIES) > 1  # (+1: the warm-up block evicted)
    # /healthz answered while the message was being applied: between two of its slices
    seen = [subscriber_stats(body)["slices"] for _, _, body in poller.answers]
    assert any(before["slices"] < s < after["slices"] for s in seen), seen
    # the slices are consecutive gated batches: no gap, and the data is there
    assert instance(c.url, "pod-a")["gaps"] == gaps
    first, last = request_tokens(payload, 0), request_tokens(payload, -1)
    assert prefix(c.url, first) == [("pod-a", "gpu", len(first) // C)]
    assert prefix(c.url, last) == [("pod-a", "gpu", len(last) // C)]


def vm_peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def oversized_message(blocks: int) -> bytes:
    """A vLLM batch (its encoding) of ``blocks`` 16-token blocks, far above the limit: the
    hashes and token ids are written as msgpack directly (no Python list of them)."""
    hashes = (
        b"\xdd" + blocks.to_bytes(4, "big") + (np.arange(blocks) % 128).astype(np.uint8).tobytes()
    )
    tokens = b"\xdd" + (16 * blocks).to_bytes(4, "big") + bytes(16 * blocks)
    event = BlockStored(msgspec.Raw(hashes), None, msgspec.Raw(tokens), 16, medium="GPU")  # type: ignore[arg-type]
    return encode_batch(KVEventBatch(1.0, [event], 0))


def test_an_oversized_message_is_refused_without_the_memory_and_the_next_one_is_applied(
    coordinator: tuple[EngineCoordinator, Any, str],
) -> None:
    c, pub_b, _ = coordinator
    small = maximal_message(np.random.default_rng(3), 1)
    c.send_until_applied(small)
    seq_b = 0

    def send_b_until_applied(payload: bytes) -> None:
        nonlocal seq_b
        start = c.stats()["batches"]

        def applied() -> bool:
            pub_b.send_multipart([b"", pack_seq(seq_b), payload])  # (same seq: repeats dropped)
            return c.stats()["batches"] > start

        assert wait_for(applied, timeout=60, interval=0.1)
        seq_b += 1

    send_b_until_applied(small)
    big = oversized_message(4 << 20)  # 4M blocks: 68 MB
    assert len(big) > 4 * LIMIT
    pid = c.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from now
    peak = vm_peak_rss_bytes(pid)
    before = c.stats()
    gaps_a = instance(c.url, "pod-a")["gaps"]
    c.send(big)
    pub_b.send_multipart([b"", pack_seq(seq_b), big])
    seq_b += 1
    assert wait_for(lambda: c.stats()["disconnects"] >= before["disconnects"] + 2, timeout=60)
    grown = vm_peak_rss_bytes(pid) - peak
    assert grown < len(big) // 4, f"peak RSS grew {grown} bytes for a {len(big)}-byte message"
    # both links take the next message: the connected endpoint was connected again, the
    # publisher that connects came back by itself
    c.send_until_applied(small)
    send_b_until_applied(maximal_message(np.random.default_rng(4), 1))
    after = c.stats()
    assert after["batches"] == before["batches"] + 2
    assert after["rejected_too_many_blocks"] == before["rejected_too_many_blocks"]  # never read
    # the refused message is a gap of its engine, never a silent loss
    assert instance(c.url, "pod-a")["gaps"] == gaps_a + 1


class FailingIngest:
    """The coordinator's two calls into a directory, the ``fail_at``-th slice of at least
    ``big`` entries raising (what an unexpected error in the directory would do)."""

    def __init__(self, fail_at: int, big: int) -> None:
        _, self.directory = fed(chunk_size=C)
        self.fail_at, self.big, self.seen = fail_at, big, 0

    def __call__(self, batches: list[ColumnBatch]) -> None:
        if sum(b.n_entries for b in batches) >= self.big:
            self.seen += 1
            if self.seen == self.fail_at:
                raise RuntimeError("the directory failed")
        self.directory.apply_columns(batches)


def test_a_slice_that_fails_leaves_the_rest_of_its_batch_a_gap_at_once() -> None:
    engine = FakeEngine()
    ingest = FailingIngest(fail_at=2, big=SLICE_ENTRIES)
    stop = threading.Event()
    settings = SubscriberSettings((LinkSpec(engine.endpoint),), max_blocks=MAX_BLOCKS)
    sub = KvEventsSubscriber(settings, KeyScheme("blake3", C), ingest=ingest,  # type: ignore[arg-type]
                             clear=ingest.directory.fence_instance, stop=stop)  # fmt: skip
    thread = threading.Thread(target=sub.run, daemon=True)
    thread.start()
    blocks = 2 * SLICE_ENTRIES + 100  # three slices: the second fails, the third is lost too
    payload = maximal_message(np.random.default_rng(5), blocks)
    try:
        engine.send_until(0, payload, lambda: sub.stats().errors == 1)
        stats = sub.stats()
        assert (stats.batches, stats.slices) == (0, 1)  # (a batch counts once all applied)
        cursor = ingest.directory.gap_state("pod-a")
        assert cursor is not None and (cursor.gaps, cursor.missing_batches) == (1, 2)
        found = ingest.directory.lookup_tokens(request_tokens(payload, 0), "llama")
        assert [(h.instance_id, h.chunks) for h in found.prefix] == [("pod-a", 2048 // C)]
        lost = ingest.directory.lookup_tokens(request_tokens(payload, -1), "llama")
        assert lost.prefix == []
        # the next batch is applied, with no further gap
        engine.send(1, encode_batch(KVEventBatch(2.0, [BlockRemoved([b"\x01" * 32], "GPU")], 0)))
        assert wait_for(lambda: sub.stats().batches == 1)
        cursor = ingest.directory.gap_state("pod-a")
        assert cursor is not None and cursor.gaps == 1
    finally:
        stop.set()
        thread.join(timeout=5)
        engine.close()


def test_an_oversized_replay_reply_is_refused_and_the_gap_stays_visible() -> None:
    engine = FakeEngine()
    _, directory = fed(chunk_size=C)
    stop = threading.Event()
    settings = SubscriberSettings(
        (LinkSpec(engine.endpoint, engine.replay_endpoint),), max_blocks=MAX_BLOCKS,
        replay_timeout=0.5, max_message_bytes=1 << 20,
    )  # fmt: skip
    sub = KvEventsSubscriber(settings, KeyScheme("blake3", C),
                             ingest=directory.apply_columns,
                             clear=directory.fence_instance, stop=stop)  # fmt: skip
    thread = threading.Thread(target=sub.run, daemon=True)
    thread.start()
    try:
        small = maximal_message(np.random.default_rng(6), 1)
        engine.send_until(0, small, lambda: sub.stats().batches == 1)
        engine.record(1, oversized_message(1 << 20))  # 17 MB, only in the replay ring
        engine.send(2, maximal_message(np.random.default_rng(7), 1))
        assert wait_for(lambda: sub.stats().batches == 2)
        stats = sub.stats()
        assert (stats.replay_failures, stats.replayed_batches, stats.gaps) == (1, 0, 1)
        assert stats.rejected_too_many_blocks == 0  # the reply never reached the decoder
    finally:
        stop.set()
        thread.join(timeout=5)
        engine.close()


def test_the_message_limit_defaults_to_the_largest_legitimate_message() -> None:
    assert parse_config([]).kv_events_max_message_bytes is None
    settings = SubscriberSettings(())
    assert settings.message_limit_bytes == 256 * parse_config([]).kv_events_max_blocks == 256 << 20
    assert SubscriberSettings((), max_blocks=100).message_limit_bytes == 25_600
    # never below what a ZMQ handshake needs: the limit applies to it too
    assert SubscriberSettings((), max_blocks=1).message_limit_bytes == 4096
    assert SubscriberSettings((), max_message_bytes=5000).message_limit_bytes == 5000
    flag = ["--kv-events-max-message-bytes", "5000"]
    assert parse_config(flag).kv_events_max_message_bytes == 5000
    with pytest.raises(ValueError, match="--kv-events-max-message-bytes must be >= 4096"):
        parse_config(["--kv-events-max-message-bytes", "4095"])


class _WholeBatch(msgspec.Struct, array_like=True):
    """vLLM's layout decoded in one call (the reference)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def test_events_decode_a_group_at_a_time_into_the_same_batch() -> None:
    """A batch of many groups decodes to what one decoder call gives; an invalid event in a
    late group refuses the whole batch; events of another layout in a later group too."""
    payload = maximal_message(np.random.default_rng(8), 30_000)  # ≈3 MB: 3 groups
    split = split_batch(payload)
    assert len(split.bodies) >= -(-len(payload) // DECODE_GROUP_BYTES) >= 3
    whole = msgspec.msgpack.decode(payload, type=_WholeBatch)
    assert decode_batch(payload).events == whole.events
    raw = msgspec.msgpack.decode(payload)
    raw[1][-1]["block_size"] = "sixteen"
    with pytest.raises(VllmWireError) as bad:
        decode_batch(msgspec.msgpack.encode(raw))
    assert bad.value.kind == "invalid"
    raw = msgspec.msgpack.decode(payload)
    raw[1][-1] = ["BlockRemoved", [1], "GPU"]  # the older array layout, after maps
    with pytest.raises(VllmWireError):
        decode_batch(msgspec.msgpack.encode(raw))
    rekeyer, directory = fed(chunk_size=C, max_blocks=MAX_BLOCKS)
    raw = msgspec.msgpack.decode(payload)
    raw[1][-1]["type"] = "BlockTeleported"
    with pytest.raises(BadBatch) as refused:
        rekeyer.translate("pod-a", "llama", split_batch(msgspec.msgpack.encode(raw)))
    assert refused.value.kind == "unknown_event"
    assert rekeyer.total_blocks == 0 and directory.stats().keys == 0  # nothing changed


def _inside(outer: bytes, inner: Any) -> bool:
    """Whether ``inner``'s bytes lie in ``outer``'s memory (a view, not a copy)."""
    start = np.frombuffer(outer, np.uint8).ctypes.data
    at = np.frombuffer(inner, np.uint8).ctypes.data
    return start <= at and at + memoryview(inner).nbytes <= start + len(outer)


def test_a_batch_of_one_group_keeps_its_events_where_they_are() -> None:
    """Every real vLLM step fits one decoder group: its events are decoded from the payload
    itself, not from a copy, into what one decoder call gives (the same split as before: a
    batch of several groups is still split, an empty one has none)."""
    payload = maximal_message(np.random.default_rng(9), 1_000)  # ≈100 KB: one group
    split = split_batch(payload)
    assert len(split.bodies) == 1 and _inside(payload, split.bodies[0])
    assert decode_batch(payload).events == msgspec.msgpack.decode(payload, type=_WholeBatch).events
    older = encode_batch(decode_batch(payload), "array")  # events as arrays, one group too
    (body,) = split_batch(older).bodies
    assert _inside(older, body) and decode_batch(older).events == decode_batch(payload).events
    empty = encode_batch(KVEventBatch(1.0, [], None))
    assert split_batch(empty).bodies == () and decode_batch(empty).events == []
