"""TieredFetch: cost order (local L1, own L2, peer L1), what peers are asked for, prefix hits,
and chunks of a foreign layout never handed out. The fleet is a duck-typed fake (only
``holders`` and ``peer`` are read)."""

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
    def __init__(self, chunks: dict[ObjectKey, StoredChunk]) -> None:
        self.chunks = chunks
        self.asked: list[list[ObjectKey]] = []

    def fetch(self, keys: Sequence[ObjectKey]) -> PeerReply:
        self.asked.append(list(keys))
        return PeerReply(
            {k: PeerChunk(self.chunks[k], b"d" * 32) for k in keys if k in self.chunks}
        )


class FailingPeer:
    def fetch(self, keys: Sequence[ObjectKey]) -> PeerReply:
        return PeerReply(failure="deadline", dropped=2)


def test_cost_order_peer_batches_and_wrong_layout(tmp_path: Path) -> None:
    l1, l2 = L1Cache(1 << 20), FsL2(tmp_path)
    l1.put(chunk(0))
    l2.put(chunk(0))
    l2.put(chunk(1))
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, chunk_size=4, dtype="float32")
    peer = Peer({key(2): chunk(2), key(3): chunk(3, other), key(9): chunk(9)})
    holders = {
        key(2): [Holder("me", "l1", "dram", False), Holder("p", "l1", "dram", False)],
        key(3): [Holder("p", "l1", "dram", False)],
        key(4): [Holder("p", "l2", "fs", False), Holder("q", "l1", "dram", True)],
        key(5): [Holder("bad", "l1", "dram", False)],
    }
    fleet = Fleet(holders, {"p": peer, "bad": FailingPeer()})  # type: ignore[dict-item]
    hits: list[ObjectKey] = []
    counters: Counter[str] = Counter()
    tiers = TieredFetch(
        l1, l2, fleet, instance_id="me", layout=LAYOUT, on_l1_hit=hits.append, counters=counters
    )
    found = tiers.fetch([key(i) for i in range(6)])
    assert {k: f.source for k, f in found.items()} == {
        key(0): "local_l1",
        key(1): "l2",
        key(2): "peer_l1",
    }
    assert found[key(2)] == Fetched(peer.chunks[key(2)], "peer_l1", "p", b"d" * 32)
    assert found[key(1)].origin == "fs" and found[key(0)].origin == "me"
    assert hits == [key(0)]
    assert peer.asked == [[key(2), key(3)]]  # one batch; never an L2 or a shared holder
    assert counters == {
        "fetched_wrong_layout": 1,
        "peer_fetch_deadline": 1,  # a failed peer call is counted by cause
        "peer_records_dropped": 2,
    }


def test_prefix_hits(tmp_path: Path) -> None:
    l1 = L1Cache(1 << 20)
    l1.put(chunk(0))
    l1.put(chunk(2))  # after a gap: not a prefix hit
    holders: dict[ObjectKey, list[Holder]] = {
        key(1): [Holder("p", "l1", "dram", False)],
        key(2): [Holder("me", "l1", "dram", False)],  # only this node's own: not a fleet hit
    }
    fleet = Fleet(holders, {})
    tiers = TieredFetch(
        l1, None, fleet, instance_id="me", layout=LAYOUT, on_l1_hit=lambda _: None,
        counters=Counter(),
    )  # fmt: skip
    assert tiers.prefix_hits([key(0), key(1), key(2), key(3)]) == 2
    assert tiers.prefix_hits([key(5)]) == 0
    assert tiers.prefix_hits([]) == 0


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
        l1, None, Fleet(holders, {}), instance_id="me", layout=LAYOUT,
        on_l1_hit=lambda _: None, counters=Counter(),
    )  # fmt: skip
    assert tiers.prefix_hits([key(0), key(1)]) == 1
    assert tiers.prefix_hits([key(2)]) == 1
