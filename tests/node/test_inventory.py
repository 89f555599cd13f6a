"""The node's inventory and resync driver (convergence.md §3): the node's digests equal the
coordinator's for the same placements, a digest exchange repairs a drifted directory while
listing only the differing prefixes, and every trigger starts an exchange."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from blake3 import blake3

from kvatlas.client import EventSink, InProcessTransport
from kvatlas.directory import KeyDirectory
from kvatlas.events import DELETE, RESYNC, STORE, CacheEntry, EventBatch
from kvatlas.events.inventory import differing, digest_from_hex
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.inventory import NodeInventory, ResyncDriver, SendResync
from kvatlas.node.l2 import FsL2
from tests.conftest import wait_for
from tests.helpers import TINY, node_config

CS = 4


config = partial(node_config, model_name="m", **TINY, chunk_size=CS, instance_id="n")


def test_node_digests_equal_the_directorys_through_stores_and_evictions(tmp_path: Path) -> None:
    directory = KeyDirectory(CS)
    sink = EventSink("n", InProcessTransport(directory.consume), incarnation=1)
    one_chunk = 1 * 8 * 2 * CS * 4  # layers * heads * dim * (k, v) * tokens * float32 bytes
    node = CacheNode(
        config(l1_bytes=5 * one_chunk),
        l2=FsL2(tmp_path),
        sink=sink,  # L1 holds few: evictions
    )
    try:
        rng = random.Random(3)
        kv = np.zeros(node.layout.shape, dtype=node.layout.numpy_dtype())
        for _ in range(30):
            start = rng.randrange(1000) * 7
            tracker = node.tracker(token_ids=list(range(start, start + 2 * CS)))
            node.store(tracker, [kv, kv])
        node.flush_events()
        assert sink.flush(10)
        for tier in ("l1", "l2"):
            assert node.own.digest(tier) == directory.digest("n", tier), tier
            assert node.own.digest(tier) != [0] * 256
        placements = node.inventory()
        assert {t for _, t, _ in placements} == {"l1", "l2"}
        assert len([p for p in placements if p[1] == "l1"]) <= 5
    finally:
        node.close()
        sink.close()


def key(i: int) -> ObjectKey:
    h = blake3(i.to_bytes(8, "little")).digest()  # a chunk hash looks random
    return ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0))


class Coordinator:
    """A directory behind the digest exchange, fed in order by one emitter's batches."""

    def __init__(self) -> None:
        self.directory = KeyDirectory(CS)
        self.seq = 0
        self.entries_sent = 0

    def emit(
        self,
        kind: str,
        tier: str,
        backend: str,
        entries: list[CacheEntry],
        prefixes: tuple[str, ...] | None = None,
    ) -> None:
        self.seq += 1
        batch = EventBatch(
            "n", 1, self.seq, kind, tier, backend, entries=tuple(entries), prefixes=prefixes
        )
        self.directory.consume(batch)
        if kind == RESYNC:
            self.entries_sent += len(entries)

    def exchange(self, tiers: dict[str, dict[str, str]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for tier, by_prefix in tiers.items():
            out[tier] = []
            for prefix_hex, digest_hex in by_prefix.items():
                prefix = bytes.fromhex(prefix_hex)
                mine = self.directory.digest("n", tier, prefix)
                out[tier] += [p.hex() for p in differing(prefix, mine, digest_from_hex(digest_hex))]
        return out

    def barrier(self, action: Callable[[SendResync], None]) -> None:
        def send(
            tier: str, backend: str, prefixes: tuple[str, ...], entries: list[CacheEntry]
        ) -> None:
            self.emit(RESYNC, tier, backend, entries, prefixes)

        action(send)


def drifted(n: int) -> tuple[NodeInventory, Coordinator, list[CacheEntry]]:
    """A node holding ``n`` L1 entries and a directory that missed the last 30 of them and
    holds 20 ghosts."""
    inv, coord = NodeInventory(), Coordinator()
    entries = [CacheEntry(key(i), 10) for i in range(n)]
    for e in entries:
        inv.add("l1", "dram", e)
    coord.emit(STORE, "l1", "dram", entries[:-30])  # 30 stores lost
    coord.emit(STORE, "l1", "dram", [CacheEntry(key(10**6 + i), 10) for i in range(20)])  # ghosts
    return inv, coord, entries


def test_an_exchange_repairs_drift_listing_only_the_differing_prefixes() -> None:
    inv, coord, entries = drifted(20_000)
    coord.emit(DELETE, "l1", "dram", entries[:5])  # wrongly deleted
    driver = ResyncDriver(
        inv, {"l1": "dram"}, exchange=coord.exchange, barrier=coord.barrier, interval=3600
    )
    report = driver.run_once()
    assert coord.directory.digest("n", "l1") == inv.digest("l1")
    assert coord.directory.stats().placements == len(entries)
    assert report.rounds == 2  # root buckets hold ~78 placements each: refined by second byte
    assert 0 < report.entries < len(entries) // 20  # a small fraction of a full listing
    assert driver.run_once().prefixes == 0  # converged: nothing differs any more


def test_every_trigger_starts_an_exchange() -> None:
    inv, coord = NodeInventory(), Coordinator()
    lost = [0]
    ran = threading.Event()

    def exchange(tiers: dict[str, dict[str, str]]) -> dict[str, list[str]]:
        ran.set()
        return coord.exchange(tiers)

    driver = ResyncDriver(
        inv, {"l1": "dram"}, exchange=exchange, barrier=coord.barrier,
        lost=lambda: lost[0], interval=3600,
    )  # fmt: skip
    driver.start()
    try:
        assert not ran.wait(0.3)  # nothing due: an hour between periodic exchanges
        driver.wanted.set()  # (re-)registration, or the coordinator's hint
        assert wait_for(lambda: driver.exchanges == 1)
        lost[0] += 1  # the sink dropped a batch: a gap the coordinator will see
        assert wait_for(lambda: driver.exchanges == 2)
    finally:
        driver.stop()


def test_a_full_listing_repairs_a_directory_the_node_never_compares_with() -> None:
    """A replica that lost events is repaired by nodes registered with another one: asked
    (``list_all``), the node sends every bucket of every tier without an exchange, the empty
    ones too, so ghosts under a prefix the node holds nothing in go as well."""
    inv, coord, entries = drifted(2_000)

    def exchange(tiers: dict[str, dict[str, str]]) -> dict[str, list[str]]:
        raise AssertionError("a full listing asks nothing")

    driver = ResyncDriver(
        inv, {"l1": "dram"}, exchange=exchange, barrier=coord.barrier, interval=3600
    )
    report = driver.run_once(list_all=True)
    assert coord.directory.digest("n", "l1") == inv.digest("l1")
    assert coord.directory.stats().placements == len(entries)
    assert (report.rounds, report.prefixes, report.entries) == (0, 256, len(entries))


def test_a_full_listing_asked_for_runs_and_is_retried_after_a_failure() -> None:
    inv, coord = NodeInventory(), Coordinator()
    inv.add("l1", "dram", CacheEntry(key(1), 10))
    calls: list[int] = []

    def barrier(action: Callable[[SendResync], None]) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("sink gone")  # the first try fails
        coord.barrier(action)

    driver = ResyncDriver(
        inv, {"l1": "dram"}, exchange=coord.exchange, barrier=barrier, interval=3600
    )
    driver.start()
    try:
        driver.want_listing()
        assert wait_for(lambda: driver.exchanges == 1)
        assert driver.last is not None and driver.last.prefixes == 256  # listed, not compared
        assert coord.entries_sent == 1 and driver.failures == 1
    finally:
        driver.stop()


def test_the_inventory_keeps_no_tokens_and_a_listing_takes_them_from_the_token_cache() -> None:
    inv, coord = NodeInventory(), Coordinator()
    coord.directory.enable_blend_lookup()
    content = np.arange(10, 10 + CS, dtype=np.uint32)
    content.flags.writeable = False
    k = key(7)
    inv.add("l1", "dram", CacheEntry(k, 10, content, 0))
    assert inv.listing("l1", [k.chunk_hash[:1]])[0].token_ids is None  # memory stays bounded
    known = {k.chunk_hash: (content, 0)}
    driver = ResyncDriver(
        inv, {"l1": "dram"}, exchange=coord.exchange, barrier=coord.barrier,
        tokens_of=known.get, interval=3600,
    )  # fmt: skip
    assert driver.run_once().entries == 1
    ns = BlendNamespace("m", "", 1)
    assert [m.chunk_hash for m in coord.directory.blend_match(content, ns)] == [k.chunk_hash]


def test_a_restarted_node_that_stores_nothing_still_clears_its_old_l1_everywhere() -> None:
    """Found by ``kvatlas soak``: a pool node killed and restarted (nothing in a private L2 to
    re-report) sent no event until its next store, so a replica it does not talk to kept its
    old L1 placements as ghosts (the replica it registers with fences it at registration, and
    its digests then match: no resync goes on the stream). Every replica learns of a new
    incarnation only from the stream, so the node announces itself there when it starts: a
    ``config`` batch declaring its L1 capacity (the gate fences the old incarnation first)."""
    directory = KeyDirectory(CS)  # a replica that sees only the node's events
    one_chunk = 1 * 8 * 2 * CS * 4
    first = EventSink("n", InProcessTransport(directory.consume), incarnation=1)
    node = CacheNode(config(l1_bytes=8 * one_chunk), sink=first)
    kv = np.zeros(node.layout.shape, dtype=node.layout.numpy_dtype())
    node.store(node.tracker(token_ids=list(range(2 * CS))), [kv, kv])
    node.flush_events()
    assert first.flush(10)
    assert directory.digest("n", "l1") != [0] * 256  # its two chunks, in L1
    first.close()  # the process dies (its L1 with it) and starts again: a new incarnation
    second = EventSink("n", InProcessTransport(directory.consume), incarnation=2)
    restarted = CacheNode(config(l1_bytes=8 * one_chunk), sink=second)
    try:
        restarted.flush_events()
        assert second.flush(10)
        assert directory.digest("n", "l1") == [0] * 256  # no L1 placement of n left
        capacity = {(u.instance_id, u.tier): u.capacity_bytes for u in directory.usage().modules}
        assert capacity[("n", "l1")] == 8 * one_chunk
    finally:
        restarted.close()
        node.close()
        second.close()
