"""Tiered fetch: find chunks across the tiers a node can read, cheapest first -- local L1, then
the peers' L1s, then L2 (this node's own, then the peers' private L2s; a shared pool is this
node's own L2 when it mounts one).

A key no tier can serve is absent from the answer: a miss, never an error (every tier below
L1 is an optimisation over recomputing). A chunk whose shape or dtype is not this node's
layout is never handed out (it is counted as ``fetched_wrong_layout``): wrong KV does not fail
loudly, it makes the model attend to garbage. Peers are asked only for keys the fleet says
they hold in an unshared tier, one batch per peer and tier. A prefix lookup counts only
copies this node can fetch: its own tiers, a peer that has a URL and did not just fail, a
shared pool it mounts. See ``docs/node.md``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple

from kvatlas.keys import ObjectKey
from kvatlas.node.fleet_view import FleetView, Holder
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend
from kvatlas.node.presence import L1 as TIER_L1
from kvatlas.node.presence import L2 as TIER_L2
from kvatlas.node.presence import Tier
from kvatlas.node.stored_chunk import StoredChunk

FetchSource = Literal["local_l1", "l2", "peer_l1", "peer_l2"]
"""Where a fetched chunk came from (not :data:`kvatlas.node.segments.Source`: which lookup
leg found a match)."""
LOCAL_L1: Final = "local_l1"
L2: Final = "l2"
PEER_L1: Final = "peer_l1"
PEER_L2: Final = "peer_l2"
_PEER_SOURCE: Final[dict[Tier, FetchSource]] = {TIER_L1: PEER_L1, TIER_L2: PEER_L2}
_DOWN_CAUSES: Final = frozenset({"unreachable", "refused", "deadline"})
"""Peer fetch failures after which the peer's copies do not count for a while."""


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
    access); ``counters`` is where ``fetched_wrong_layout`` and peer failures are counted. A
    peer whose fetch failed for want of a connection (``unreachable``, ``refused``,
    ``deadline``) does not count in :meth:`prefix_hits` for ``down_for`` seconds.
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
        down_for: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        observe: Callable[[str, float], None] = lambda _source, _seconds: None,
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self.fleet = fleet
        self.instance_id = instance_id
        self.layout = layout
        self._on_l1_hit = on_l1_hit
        self._counters = counters
        self._down_for = down_for
        self._clock = clock
        self._failed_at: dict[str, float] = {}
        self._observe = observe  # (source, seconds) of each batched step

    def fetch(
        self, keys: Sequence[ObjectKey], listed: set[ObjectKey] | None = None
    ) -> dict[ObjectKey, Fetched]:
        """One batched step: local L1, peer L1s, own L2, peer private L2s; absent = miss.
        ``listed`` collects the keys the fleet listed on another instance (regret)."""
        started = time.perf_counter()
        found: dict[ObjectKey, Fetched] = {}
        missing: list[ObjectKey] = []
        for key in keys:
            chunk = self.l1.get(key)
            if chunk is not None:
                found[key] = Fetched(chunk, LOCAL_L1, self.instance_id)
                self._on_l1_hit(key)
            else:
                missing.append(key)
        self._observe(LOCAL_L1, time.perf_counter() - started)
        holders: dict[ObjectKey, list[Holder]] = {}
        failed: set[str] = set()  # peers that failed in this call are not asked again
        if missing and self.fleet is not None:
            holders = dict(zip(missing, self.fleet.holders(missing), strict=False))
            if listed is not None:
                listed.update(
                    k
                    for k, hs in holders.items()
                    if any(h.instance_id != self.instance_id for h in hs)
                )
            missing = self._from_peers(missing, holders, TIER_L1, found, failed)
        if missing and self.l2 is not None:
            started = time.perf_counter()
            for key, chunk in self.l2.get_many(missing).items():
                if self._usable(chunk):
                    found[key] = Fetched(chunk, L2, self.l2.name)
            self._observe(L2, time.perf_counter() - started)
            missing = [k for k in missing if k not in found]
        if missing and holders:
            self._from_peers(missing, holders, TIER_L2, found, failed)
        return found

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` this node can fetch: from its own L1 or L2, then (for the
        rest) from a holder the fleet knows that :meth:`_fetchable` accepts."""
        hit = 0
        for key in keys:
            if self.l1.contains(key) or (self.l2 is not None and self.l2.contains(key)):
                hit += 1
            else:
                break
        if hit < len(keys) and self.fleet is not None:
            for holders in self.fleet.holders(keys[hit:]):
                if not any(self._fetchable(h) for h in holders):
                    break
                hit += 1
        return hit

    def _fetchable(self, holder: Holder) -> bool:
        """A shared placement in the pool this node mounts, or an unshared L1/L2 placement of
        a peer that has a URL and did not just fail (this node's own placements were checked
        against its tiers already)."""
        if holder.shared:
            return self.l2 is not None and self.l2.shared and holder.backend == self.l2.name
        if holder.instance_id == self.instance_id or holder.tier not in _PEER_SOURCE:
            return False
        return self._reachable(holder.instance_id)

    def _reachable(self, instance_id: str) -> bool:
        failed = self._failed_at.get(instance_id)
        if failed is not None and self._clock() - failed < self._down_for:
            return False
        assert self.fleet is not None
        return self.fleet.peer(instance_id) is not None

    def _from_peers(
        self,
        keys: list[ObjectKey],
        holders: dict[ObjectKey, list[Holder]],
        tier: Tier,
        found: dict[ObjectKey, Fetched],
        failed: set[str],
    ) -> list[ObjectKey]:
        """Ask each peer holding some of ``keys`` in its unshared ``tier`` for them (one batch
        per peer, skipping those in ``failed``); adds what came to ``found`` and returns the
        keys still missing."""
        assert self.fleet is not None
        source = _PEER_SOURCE[tier]
        for instance_id, peer_keys in self._peer_batches(keys, holders, tier).items():
            peer = None if instance_id in failed else self.fleet.peer(instance_id)
            if peer is None:
                continue
            asked = set(peer_keys)
            started = time.perf_counter()
            reply = peer.fetch(peer_keys, (tier,))
            self._observe(source, time.perf_counter() - started)
            if reply.failure:
                failed.add(instance_id)
                self._counters[f"peer_fetch_{reply.failure}"] += 1
                if reply.failure in _DOWN_CAUSES:
                    self._failed_at[instance_id] = self._clock()
            else:
                self._failed_at.pop(instance_id, None)
            if reply.dropped:
                self._counters["peer_records_dropped"] += reply.dropped
            for key, (chunk, digest) in reply.chunks.items():
                if key in asked and key not in found and self._usable(chunk):
                    found[key] = Fetched(chunk, source, instance_id, digest)
        return [k for k in keys if k not in found]

    def _peer_batches(
        self, keys: Sequence[ObjectKey], holders: dict[ObjectKey, list[Holder]], tier: Tier
    ) -> dict[str, list[ObjectKey]]:
        """Per peer, the keys to ask it for: its first unshared ``tier`` placement of each."""
        batches: dict[str, list[ObjectKey]] = {}
        for key in keys:
            for holder in holders.get(key, ()):
                if (
                    holder.tier == tier
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
