"""The subscriber on real ZMQ sockets (loopback): golden payloads in both encodings from a live
PUB socket, gaps (visible, or recovered through replay), a late join, an engine restart, and
bad input counted without stopping it (docs/kv-events.md)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from kvatlas.coordinator.server import free_port
from kvatlas.events.vllm_wire import BlockRemoved, KVEventBatch, decode_batch, encode_batch
from tests.conftest import wait_for
from tests.kv_events.helpers import (
    HASHES,
    NESTED_TOO_DEEP,
    TOKENS,
    UNKNOWN_TAG_THEN_BAD_UTF8,
    FakeEngine,
    Subscribed,
    golden,
)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine()
    yield e
    e.close()


def holders(s: Subscribed) -> dict[tuple[str, str], int]:
    found = s.directory.lookup_tokens(TOKENS, "llama")
    return {(h.instance_id, h.tier): h.chunks for h in found.prefix}


def removed(*hashes: bytes) -> bytes:
    return encode_batch(KVEventBatch(2.0, [BlockRemoved(list(hashes), "GPU")], 0))


def test_a_live_stream_in_both_encodings(engine: FakeEngine) -> None:
    s = Subscribed([engine.endpoint], [None])
    try:
        engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
        assert holders(s) == {("pod-a", "gpu"): 2}  # blocks 2-3 (LoRA + image): un-indexable
        engine.send(1, golden("legacy-array-cleared"))
        assert wait_for(lambda: holders(s) == {})
        engine.send(2, golden("legacy-array-int-hashes"))
        assert wait_for(lambda: holders(s) == {("pod-a", "gpu"): 2})
        engine.send(3, golden("current-removed"))  # block 3: never stored since the clear
        assert wait_for(lambda: s.sub.stats().batches == 4)
        stats = s.sub.stats()
        assert (stats.unknown_removed_blocks, stats.clears, stats.gaps) == (1, 1, 0)
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None and cursor.gaps == 0
    finally:
        s.close()


def test_a_gap_without_replay_is_visible_at_the_gate(engine: FakeEngine) -> None:
    s = Subscribed([engine.endpoint], [None])
    try:
        engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
        engine.send(5, removed(HASHES[1]))
        assert wait_for(lambda: s.sub.stats().batches == 2)
        assert (s.sub.stats().gaps, s.sub.stats().missing_batches) == (1, 4)
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None and (cursor.gaps, cursor.missing_batches) == (1, 4)
        assert holders(s) == {("pod-a", "gpu"): 1}
    finally:
        s.close()


@pytest.mark.parametrize("rank", [None, 1])
@pytest.mark.parametrize(
    "bad",
    [b"\xc1", msgspec.msgpack.encode({"x": 1}), msgspec.msgpack.encode([1.0, [], 10**6])],
    ids=["malformed", "invalid", "bad-dp-rank"],
)
def test_a_batch_refused_before_translation_is_a_gap_at_the_gate(
    engine: FakeEngine, bad: bytes, rank: int | None
) -> None:
    """docs/kv-events.md, "Gaps": a rejected batch is at once a gap of its engine. One that
    fails to decode (or names a data-parallel rank out of range) was counted as rejected and
    its seq taken, but the engine's gate saw no gap (only a token-range refusal made one); a
    seq jump right after it reported 0 missing batches for it. The gap is the engine's whose
    batch the topic carried last (its data-parallel rank's instance: ``pod-a:dp1``)."""
    s = Subscribed([engine.endpoint], [None])
    try:
        stored = msgspec.structs.replace(
            decode_batch(golden("current-stored")), data_parallel_rank=rank
        )
        engine.send_until(0, encode_batch(stored), lambda: s.sub.stats().batches == 1)
        engine.send(1, bad)
        gone = KVEventBatch(2.0, [BlockRemoved([HASHES[1]], "GPU")], rank)
        engine.send(4, encode_batch(gone))  # 2 and 3 never sent: lost
        assert wait_for(lambda: s.sub.stats().batches == 2)
        cursor = s.directory.gap_state("pod-a" if rank is None else "pod-a:dp1")
        assert cursor is not None and cursor.missing_batches == 3, cursor
    finally:
        s.close()


@pytest.mark.parametrize("bad", [UNKNOWN_TAG_THEN_BAD_UTF8, NESTED_TOO_DEEP],
                         ids=["unknown-tag-then-bad-utf8", "nested-too-deep"])  # fmt: skip
def test_a_payload_msgspec_cannot_read_is_refused_counted_and_a_gap(
    engine: FakeEngine, bad: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/kv-events.md, "Bad input": malformed msgpack is counted and logged, the batch
    changes nothing, the subscriber goes on; a rejected batch is a gap of its engine. These
    two escaped as msgspec's own errors (``DecodeError`` from the second, untyped decode that
    names an invalid event's kind; ``RecursionError``): an ``errors`` count with a traceback,
    the seq not taken, and the next batch's replay met the bad payload again and was lost."""
    s = Subscribed([engine.endpoint], [engine.replay_endpoint])
    try:
        with caplog.at_level("WARNING", logger="kvatlas.coordinator.kv_events"):
            engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
            engine.send(1, bad)
            engine.send(2, removed(HASHES[1]))
            assert wait_for(lambda: s.sub.stats().batches == 2)
        stats = s.sub.stats()
        assert (stats.errors, stats.rejected_malformed) == (0, 1)
        assert holders(s) == {("pod-a", "gpu"): 1}
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None and (cursor.gaps, cursor.missing_batches) == (1, 1), cursor
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    finally:
        s.close()


def test_a_gap_is_recovered_through_replay(engine: FakeEngine) -> None:
    s = Subscribed([engine.endpoint], [engine.replay_endpoint])
    try:
        engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
        engine.record(1, removed(HASHES[1]))  # lost on the way: only the ring has it
        engine.send(2, removed(b"\x01" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 3)
        stats = s.sub.stats()
        assert (stats.gaps, stats.replayed_batches, stats.replay_failures) == (0, 1, 0)
        assert engine.requests == [1]
        assert holders(s) == {("pod-a", "gpu"): 1}  # the replayed removal was applied
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None and cursor.gaps == 0
    finally:
        s.close()


def test_a_late_join_catches_up_through_replay(engine: FakeEngine) -> None:
    engine.record(0, golden("current-stored"))
    engine.record(1, removed(HASHES[1]))
    s = Subscribed([engine.endpoint], [engine.replay_endpoint])
    try:
        engine.send_until(2, removed(b"\x01" * 32), lambda: s.sub.stats().batches == 3)
        assert holders(s) == {("pod-a", "gpu"): 1}
        assert s.sub.stats().gaps == 0 and s.sub.stats().replayed_batches == 2
    finally:
        s.close()


def test_an_engine_restart_fences_what_it_held(engine: FakeEngine) -> None:
    s = Subscribed([engine.endpoint], [None])
    try:
        engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
        engine.send(1, removed(b"\x01" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 2)
        raw = msgspec.msgpack.decode(golden("current-int-hashes"))
        raw["events"][0]["token_ids"] = [7] * 32
        engine.send(0, msgspec.msgpack.encode(raw))  # seq back to 0: a new engine process
        assert wait_for(lambda: s.sub.stats().batches == 3)
        assert s.sub.stats().engine_restarts == 1
        assert holders(s) == {}
        assert s.directory.stats().keys == 2
    finally:
        s.close()


@pytest.mark.parametrize("with_replay", [True, False], ids=["replayed", "a-gap"])
def test_a_restarted_engines_batches_before_the_first_heard_are_replayed_or_a_gap(
    engine: FakeEngine, with_replay: bool
) -> None:
    """docs/kv-events.md, "Gaps": a restarted vLLM counts from seq 0 again, and its PUB drops
    what it sends before the SUB has reconnected (ZMQ's slow joiner); its fresh replay ring
    keeps it. Heard at seq 2 after 6, the restart fenced the old incarnation but seqs 0 and 1
    of the new one were lost without a word: never asked of the replay socket, no gap."""
    s = Subscribed([engine.endpoint], [engine.replay_endpoint if with_replay else None])
    try:
        engine.send_until(0, removed(b"\x01" * 32), lambda: s.sub.stats().batches == 1)
        for seq in range(1, 7):
            engine.send(seq, removed(b"\x01" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 7)
        with engine.lock:
            engine.ring.clear()  # the new process's ring
        engine.record(0, golden("current-stored"))  # sent before the SUB reconnected
        engine.record(1, removed(b"\x02" * 32))
        engine.send(2, removed(b"\x03" * 32))
        assert wait_for(lambda: s.sub.stats().batches == (10 if with_replay else 8))
        stats = s.sub.stats()
        assert stats.engine_restarts == 1
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None
        if with_replay:
            assert engine.requests == [0]
            assert holders(s) == {("pod-a", "gpu"): 2}
            assert (stats.replayed_batches, stats.gaps, cursor.gaps) == (2, 0, 0)
        else:
            assert holders(s) == {}
            assert (stats.gaps, stats.missing_batches) == (1, 2)
            assert (cursor.gaps, cursor.missing_batches) == (1, 2)
    finally:
        s.close()


def test_a_restart_whose_first_heard_batch_is_refused_is_still_a_restart(
    engine: FakeEngine,
) -> None:
    """A restarted engine whose first batch heard (seq back below the old last one) is refused
    (malformed): the seq going back is a restart all the same — the old incarnation fenced
    (its copies were the dead process's memory), the lost batches a gap; it recorded the lower
    seq and nothing else, so the next valid batch looked like the old incarnation's."""
    s = Subscribed([engine.endpoint], [None])
    try:
        engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
        for seq in range(1, 5):
            engine.send(seq, removed(b"\x09" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 5)
        assert holders(s) == {("pod-a", "gpu"): 2}
        engine.send(1, b"\xc1\xc1")  # the new process's seq 1, unreadable (seq 0 missed)
        engine.send(2, removed(b"\x09" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 6)
        stats = s.sub.stats()
        assert (stats.engine_restarts, stats.rejected_malformed) == (1, 1)
        assert holders(s) == {}  # the old incarnation's copies are gone
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None and cursor.missing_batches == 2  # seq 0 and the refused 1
    finally:
        s.close()


def test_bad_input_is_counted_and_the_subscriber_goes_on(engine: FakeEngine) -> None:
    s = Subscribed([engine.endpoint], [None], max_blocks=100)
    flood = msgspec.msgpack.decode(golden("current-int-hashes"))
    flood["events"][0]["block_hashes"] = list(range(101))
    flood["events"][0]["token_ids"] = [1] * (16 * 101)
    huge = msgspec.msgpack.decode(golden("current-int-hashes"))
    huge["events"][0]["block_size"] = 1 << 40
    out_of_range = msgspec.msgpack.decode(golden("current-int-hashes"))
    out_of_range["events"][0]["token_ids"][3] = 1 << 33
    unknown = {"ts": 1.0, "events": [{"type": "BlockTeleported"}]}
    rank = {"ts": 1.0, "events": [], "data_parallel_rank": 1 << 40}
    try:
        engine.send_until(0, b"\xc1\xc1", lambda: s.sub.stats().rejected_malformed >= 1)
        t = b"kv@pod-a@llama"
        engine.pub.send_multipart([t, b"\x00" * 8])  # two frames
        engine.pub.send_multipart([t, b"\x00" * 8, b"x", b"y"])  # four frames
        engine.pub.send_multipart([t, b"\x01", golden("current-stored")])  # short seq
        engine.pub.send_multipart(
            [b"kv@a/b@llama", b"\x00" * 7 + b"\x05", golden("current-stored")]
        )
        for seq, body in enumerate((unknown, flood, huge, out_of_range, rank), start=1):
            engine.send(seq, msgspec.msgpack.encode(body))
        engine.send(9, golden("current-stored"))
        assert wait_for(lambda: s.sub.stats().batches == 1)
        stats = s.sub.stats()
        want = {"rejected_malformed": 1, "rejected_frames": 3, "rejected_topic": 1,
                "rejected_unknown_event": 1, "rejected_too_many_blocks": 1,
                "rejected_block_size": 1, "rejected_token_range": 1, "rejected_invalid": 1,
                "errors": 0}  # fmt: skip
        assert {k: getattr(stats, k) for k in want} == want
        assert holders(s) == {("pod-a", "gpu"): 2}
        assert s.thread.is_alive()
    finally:
        s.close()


def test_a_dead_replay_endpoint_leaves_a_visible_gap_and_is_not_asked_again_at_once(
    engine: FakeEngine,
) -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: no answer
    s = Subscribed([engine.endpoint], [dead], replay_timeout=0.2)
    try:
        engine.send_until(0, golden("current-stored"), lambda: s.sub.stats().batches == 1)
        stats = s.sub.stats()
        assert (stats.replay_failures, stats.gaps) == (0, 0)  # seq 0: nothing to catch up on
        engine.send(3, removed(b"\x01" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 2)
        engine.send(6, removed(b"\x02" * 32))
        assert wait_for(lambda: s.sub.stats().batches == 3)
        stats = s.sub.stats()
        assert (stats.replay_failures, stats.gaps, stats.missing_batches) == (1, 2, 4)
        cursor = s.directory.gap_state("pod-a")
        assert cursor is not None and (cursor.gaps, cursor.missing_batches) == (2, 4)
    finally:
        s.close()


def test_a_flood_of_bad_input_is_logged_sparsely(caplog: pytest.LogCaptureFixture) -> None:
    s = Subscribed(["tcp://127.0.0.1:1"], [None])  # never delivers: messages handed in directly
    link = s.sub._links[0]
    try:
        with caplog.at_level("WARNING", logger="kvatlas.coordinator.kv_events.subscriber"):
            for seq in range(1000):
                s.sub.handle(link, [b"kv@pod-a@llama", seq.to_bytes(8, "big"), b"\xc1"])
        assert s.sub.stats().rejected_malformed == 1000
        assert 10 < len(caplog.records) <= 20
    finally:
        s.close()


def test_an_unnamed_endpoint_cannot_take_an_engine_named_for_another() -> None:
    """The operator named ``pod-a`` for one endpoint: a topic naming it (any rank) on an
    unnamed endpoint is refused even before pod-a's own endpoint spoke, and pod-a's endpoint
    then speaks for it."""
    import threading

    from kvatlas.coordinator.kv_events import KvEventsSubscriber, LinkSpec, SubscriberSettings
    from kvatlas.events.vllm_wire import pack_seq
    from kvatlas.keys import KeyScheme

    applied: list[str] = []
    links = (LinkSpec("tcp://127.0.0.1:1"), LinkSpec("tcp://127.0.0.1:2", engine="pod-a"))
    settings = SubscriberSettings(links, default_model="llama")
    sub = KvEventsSubscriber(
        settings, KeyScheme("blake3", 16), stop=threading.Event(),
        ingest=lambda batches: applied.extend(b.header.instance_id for b in batches),
        clear=lambda _instance: 0,
    )  # fmt: skip
    unnamed, named = sub._links
    sub.handle(unnamed, [b"kv@pod-a@llama", pack_seq(0), golden("current-stored")])
    sub.handle(unnamed, [b"kv@pod-a@llama", pack_seq(1), golden("vllm-0.33.0-cleared")])
    assert sub.stats().rejected_foreign == 2 and applied == []
    sub.handle(named, [b"", pack_seq(0), golden("vllm-0.33.0-stored")])
    assert sub.stats().rejected_foreign == 2 and set(applied) == {"pod-a"}
