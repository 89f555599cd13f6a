"""TieredFetch: cost order (local L1, peer L1, own L2, peer private L2), what peers are asked
for, prefix hits (only copies this node can fetch), and chunks of a foreign layout never handed
out. The fleet is a duck-typed fake (only ``holders`` and ``peer`` are read)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvatlas.keys import ObjectKey
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import FsL2
from kvatlas.node.peer import PeerChunk, PeerReply
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.tiered_fetch import Fetched, TieredFetch

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=4, dtype="float32")


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 1 << 24 | 1 << 8)


def chunk(i: int, layout: KVLayout = LAYOUT) -> StoredChunk:
    return StoredChunk(key(i), np.full(layout.shape, i, dtype=np.float32))


class Holder(NamedTuple):
    instance_id: str
    tier: str
    backend: str
    shared: bool


class Fleet:
    def __init__(self, holders: dict[ObjectKey, list[Holder]], peers: dict[str, Peer]) -> None:
        self._holders = holders
        self._peers = peers

    def holders(self, keys: Sequence[ObjectKey]) -> list[list[Holder]]:
        return [self._holders.get(k, []) for k in keys]

    def peer(self, instance_id: str) -> Peer | None:
        return self._peers.get(instance_id)


class Peer:
    """Holds ``chunks`` in L1 and ``l2_chunks`` in its private L2; serves the tiers asked."""

    def __init__(
        self,
        chunks: dict[ObjectKey, StoredChunk],
        l2_chunks: dict[ObjectKey, StoredChunk] | None = None,
    ) -> None:
        self.chunks = chunks
        self.l2_chunks = l2_chunks or {}
        self.asked: list[tuple[list[ObjectKey], tuple[str, ...]]] = []

    def fetch(self, keys: Sequence[ObjectKey], tiers: Sequence[str] = ("l1",)) -> PeerReply:
        self.asked.append((list(keys), tuple(tiers)))
        held = {
            **(self.l2_chunks if "l2" in tiers else {}),
            **(self.chunks if "l1" in tiers else {}),
        }
        return PeerReply({k: PeerChunk(held[k], b"d" * 32) for k in keys if k in held})


class FailingPeer:
    def __init__(self) -> None:
        self.calls = 0

    def fetch(self, keys: Sequence[ObjectKey], tiers: Sequence[str] = ("l1",)) -> PeerReply:
        self.calls += 1
        return PeerReply(failure="deadline", dropped=2)


def test_cost_order_peer_batches_and_wrong_layout(tmp_path: Path) -> None:
    l1, l2 = L1Cache(1 << 20), FsL2(tmp_path)
    l1.put(chunk(0))
    l2.put(chunk(0))
    l2.put(chunk(1))
    l2.put(chunk(6))  # also in a peer's L1: the peer is asked first (cheaper than a disk read)
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, chunk_size=4, dtype="float32")
    peer = Peer(
        {key(2): chunk(2), key(3): chunk(3, other), key(6): chunk(6), key(9): chunk(9)},
        {key(7): chunk(7)},
    )
    bad = FailingPeer()
    holders = {
        key(2): [Holder("me", "l1", "dram", False), Holder("p", "l1", "dram", False)],
        key(3): [Holder("p", "l1", "dram", False)],
        key(4): [Holder("p", "l2", "fs", False), Holder("q", "l1", "dram", True)],
        key(5): [Holder("bad", "l1", "dram", False), Holder("bad", "l2", "fs", False)],
        key(6): [Holder("p", "l1", "dram", False)],
        key(7): [Holder("p", "l2", "fs", False)],
    }
    fleet = Fleet(holders, {"p": peer, "bad": bad})  # type: ignore[dict-item]
    hits: list[ObjectKey] = []
    counters: Counter[str] = Counter()
    tiers = TieredFetch(
        l1, l2, fleet, instance_id="me", layout=LAYOUT, on_l1_hit=hits.append, counters=counters
    )
    found = tiers.fetch([key(i) for i in range(8)])
    assert {k: f.source for k, f in found.items()} == {
        key(0): "local_l1",
        key(1): "l2",
        key(2): "peer_l1",
        key(6): "peer_l1",
        key(7): "peer_l2",
    }
    assert found[key(2)] == Fetched(peer.chunks[key(2)], "peer_l1", "p", b"d" * 32)
    assert found[key(7)] == Fetched(peer.l2_chunks[key(7)], "peer_l2", "p", b"d" * 32)
    assert found[key(1)].origin == "fs" and found[key(0)].origin == "me"
    assert hits == [key(0)]
    # one L1 batch, then one L2 batch for what neither L1 nor own L2 had; never a shared holder
    assert peer.asked == [([key(2), key(3), key(6)], ("l1",)), ([key(4), key(7)], ("l2",))]
    assert bad.calls == 1  # a peer that failed is not asked again in the same fetch
    assert counters == {
        "fetched_wrong_layout": 1,
        "peer_fetch_deadline": 1,  # a failed peer call is counted by cause
        "peer_records_dropped": 2,
    }


def test_prefix_hits_count_only_fetchable_copies(tmp_path: Path) -> None:
    l1 = L1Cache(1 << 20)
    l1.put(chunk(0))
    l1.put(chunk(2))  # after a gap: not a prefix hit
    holders: dict[ObjectKey, list[Holder]] = {
        key(1): [Holder("p", "l1", "dram", False)],
        key(2): [Holder("me", "l1", "dram", False)],  # only this node's own: not a fleet hit
        key(5): [Holder("p", "l2", "fs", False)],  # a peer's private L2: it serves it
        key(6): [Holder("gone", "l1", "dram", False)],  # no URL: not fetchable
        key(7): [Holder("x", "l2", "fs-shared", True)],  # a shared pool this node mounts
        key(8): [Holder("x", "l2", "other-pool", True)],  # a pool it does not mount
    }
    fleet = Fleet(holders, {"p": Peer({})})
    tiers = TieredFetch(
        l1, FsL2(tmp_path, "fs-shared", shared=True), fleet, instance_id="me", layout=LAYOUT,
        on_l1_hit=lambda _: None, counters=Counter(),
    )  # fmt: skip
    assert tiers.prefix_hits([key(0), key(1), key(2), key(3)]) == 2
    assert tiers.prefix_hits([key(5), key(7), key(6)]) == 2
    assert tiers.prefix_hits([key(8)]) == 0
    assert tiers.prefix_hits([key(5)]) == 1
    assert tiers.prefix_hits([key(5)]) == 1
    assert tiers.prefix_hits([]) == 0


def test_a_peer_that_just_failed_does_not_count_for_prefix_hits() -> None:
    now = [0.0]
    fleet = Fleet({key(1): [Holder("bad", "l1", "dram", False)]}, {"bad": FailingPeer()})  # type: ignore[dict-item]
    tiers = TieredFetch(
        L1Cache(1 << 20), None, fleet, instance_id="me", layout=LAYOUT,
        on_l1_hit=lambda _: None, counters=Counter(), down_for=10.0, clock=lambda: now[0],
    )  # fmt: skip
    assert tiers.prefix_hits([key(1)]) == 1  # has a URL, not known to be down
    assert tiers.fetch([key(1)]) == {}
    assert tiers.prefix_hits([key(1)]) == 0  # unreachable: not counted
    now[0] = 11.0
    assert tiers.prefix_hits([key(1)]) == 1  # tried again after down_for


def test_engine_memory_is_no_fleet_hit_for_a_node() -> None:
    """An engine's GPU / CPU-offload copy (learned from vLLM KV events) is nothing a node can
    fetch: counting it would promise tokens the node then cannot load."""
    l1 = L1Cache(1 << 20)
    l1.put(chunk(0))
    holders: dict[ObjectKey, list[Holder]] = {
        key(1): [Holder("pod-a", "gpu", "vllm", False)],
        key(2): [Holder("pod-a", "engine-cpu", "vllm", False), Holder("p", "l1", "dram", False)],
    }
    tiers = TieredFetch(
        l1, None, Fleet(holders, {"p": FailingPeer()}), instance_id="me", layout=LAYOUT,
        on_l1_hit=lambda _: None, counters=Counter(),
    )  # fmt: skip
    assert tiers.prefix_hits([key(0), key(1)]) == 1
    assert tiers.prefix_hits([key(2)]) == 1
