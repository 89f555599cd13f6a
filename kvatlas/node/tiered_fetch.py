"""Tiered fetch: find chunks across local L1, this node's L2 and the peers' L1s, cheapest first.

A key no tier can serve is absent from the answer: a miss, never an error (every tier below
L1 is an optimisation over recomputing). A chunk whose shape or dtype is not this node's
layout is never handed out (it is counted as ``fetched_wrong_layout``): wrong KV does not fail
loudly, it makes the model attend to garbage. Peers are asked only for keys the fleet says
they hold in an unshared L1, one batch per peer. See ``docs/node.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple

from kvatlas.events import ENGINE_TIERS
from kvatlas.keys import ObjectKey
from kvatlas.node.fleet_view import FleetView
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend
from kvatlas.node.presence import L1 as TIER_L1
from kvatlas.node.stored_chunk import StoredChunk

FetchSource = Literal["local_l1", "l2", "peer_l1"]
"""Where a fetched chunk came from (not :data:`kvatlas.node.segments.Source`: which lookup
leg found a match)."""
LOCAL_L1: Final = "local_l1"
L2: Final = "l2"
PEER_L1: Final = "peer_l1"


class Fetched(NamedTuple):
    """A chunk found by :meth:`TieredFetch.fetch`, the tier it came from, who served it (the
    peer's instance id, the L2 backend's name, or this node's id) and, from a peer, the digest
    of its tokens (a peer sends no token ids)."""

    chunk: StoredChunk
    source: FetchSource
    origin: str
    tokens_digest: bytes | None = None


class TieredFetch:
    """Reads through this node's tiers and the fleet's, in cost order.

    ``on_l1_hit`` is called for each key served from local L1 (the node reports it as an
    access); ``counters`` is where ``fetched_wrong_layout`` and peer failures are counted.
    """

    def __init__(
        self,
        l1: L1Cache,
        l2: L2Backend | None,
        fleet: FleetView | None,
        *,
        instance_id: str,
        layout: KVLayout,
        on_l1_hit: Callable[[ObjectKey], None],
        counters: Counter[str],
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self.fleet = fleet
        self.instance_id = instance_id
        self.layout = layout
        self._on_l1_hit = on_l1_hit
        self._counters = counters

    def fetch(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, Fetched]:
        """One batched step: local L1, then this node's L2, then peer L1s; absent = miss."""
        found: dict[ObjectKey, Fetched] = {}
        missing: list[ObjectKey] = []
        for key in keys:
            chunk = self.l1.get(key)
            if chunk is not None:
                found[key] = Fetched(chunk, LOCAL_L1, self.instance_id)
                self._on_l1_hit(key)
            else:
                missing.append(key)
        if missing and self.l2 is not None:
            for key, chunk in self.l2.get_many(missing).items():
                if self._usable(chunk):
                    found[key] = Fetched(chunk, L2, self.l2.name)
            missing = [k for k in missing if k not in found]
        if missing and self.fleet is not None:
            for instance_id, peer_keys in self._peer_batches(missing).items():
                peer = self.fleet.peer(instance_id)
                if peer is None:
                    continue
                asked = set(peer_keys)
                reply = peer.fetch(peer_keys)
                if reply.failure:
                    self._counters[f"peer_fetch_{reply.failure}"] += 1
                if reply.dropped:
                    self._counters["peer_records_dropped"] += reply.dropped
                for key, (chunk, digest) in reply.chunks.items():
                    if key in asked and self._usable(chunk):
                        found[key] = Fetched(chunk, PEER_L1, instance_id, digest)
        return found

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` some tier can serve: this node's L1 or L2, then (for the
        rest) any holder the fleet knows other than this node's unshared tiers and engine
        memory (an engine's GPU or CPU offload serves that engine only)."""
        hit = 0
        for key in keys:
            if self.l1.contains(key) or (self.l2 is not None and self.l2.contains(key)):
                hit += 1
            else:
                break
        if hit < len(keys) and self.fleet is not None:
            for holders in self.fleet.holders(keys[hit:]):
                if not any(
                    (h.instance_id != self.instance_id or h.shared) and h.tier not in ENGINE_TIERS
                    for h in holders
                ):
                    break
                hit += 1
        return hit

    def _peer_batches(self, keys: Sequence[ObjectKey]) -> dict[str, list[ObjectKey]]:
        """Per peer, the keys to ask it for: its first unshared L1 placement of each key."""
        batches: dict[str, list[ObjectKey]] = {}
        assert self.fleet is not None
        for key, holders in zip(keys, self.fleet.holders(keys), strict=False):
            for holder in holders:
                if (
                    holder.tier == TIER_L1
                    and not holder.shared
                    and holder.instance_id != self.instance_id
                ):
                    batches.setdefault(holder.instance_id, []).append(key)
                    break
        return batches

    def _usable(self, chunk: StoredChunk) -> bool:
        ok = tuple(chunk.kv.shape) == self.layout.shape and chunk.kv_dtype == self.layout.dtype
        if not ok:
            self._counters["fetched_wrong_layout"] += 1
        return ok
