"""Tiered fetch: find chunks across the tiers a node can read, cheapest first -- local L1, then
the peers' L1s, then L2 (this node's own, then the peers' private L2s; a shared pool is this
node's own L2 when it mounts one).

A key no tier can serve is absent from the answer: a miss, never an error (every tier below
L1 is an optimisation over recomputing). A chunk whose shape or dtype is not this node's
layout is never handed out (it is counted as ``fetched_wrong_layout``): wrong KV does not fail
loudly, it makes the model attend to garbage. Peers are asked only for keys the fleet says
they hold in an unshared tier, one batch per peer and tier; a key the first holder listed
does not serve (a ghost placement, a peer without a URL, down or failing) is asked of its
next holder in that tier before any slower tier is read. A peer that failed for want of a
connection is skipped while :class:`~kvatlas.node.peer_health.PeerHealth` has it down. A
prefix lookup counts only copies this node can fetch: its own tiers, a peer that has a URL
and is not down, a shared pool it mounts. See ``docs/node.md``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple

from kvatlas.keys import ObjectKey
from kvatlas.node.fleet_view import FleetView, Holder, PeerFetcher
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend
from kvatlas.node.peer_health import PeerHealth
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
    access); ``counters`` is where ``fetched_wrong_layout``, peer failures
    (``peer_fetch_<cause>``), peers skipped while down (``peer_skipped_down``) and keys served
    by a holder other than the first listed (``peer_fallback_hits``) are counted. A peer whose
    fetch failed for want of a connection (``unreachable``, ``refused``, ``deadline``) is down
    in ``health`` (by default from ``down_for`` seconds, doubling while it keeps failing): not
    asked and not counted in :meth:`prefix_hits` meanwhile.
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
        health: PeerHealth | None = None,
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self.fleet = fleet
        self.instance_id = instance_id
        self.layout = layout
        self._on_l1_hit = on_l1_hit
        self._counters = counters
        self.health = PeerHealth(down_for, clock=clock) if health is None else health
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
        failed: set[str] = set()  # peers that failed, were down or had no URL: not asked again
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
                if self.usable(chunk):
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
        if self.health.down(instance_id):
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
        """Ask the peers holding ``keys`` in their unshared ``tier``: each key of its first
        usable holder (one batch per peer), then what is still missing of its next holder,
        until every holder was tried; peers in ``failed`` are passed over, and join it when
        they fail or are down. Adds what came to ``found``; returns the keys still missing."""
        source = _PEER_SOURCE[tier]
        asked: dict[ObjectKey, int] = {}  # how many of the key's holders were tried
        missing = keys
        while missing:
            batches = self._peer_batches(missing, holders, tier, asked, failed)
            if not batches:
                break
            for instance_id, (peer, peer_keys, later) in batches.items():
                self._ask(instance_id, peer, peer_keys, later, tier, source, found, failed)
            missing = [k for k in missing if k not in found]
        return missing

    def _ask(
        self,
        instance_id: str,
        peer: PeerFetcher,
        keys: list[ObjectKey],
        later: set[ObjectKey],
        tier: Tier,
        source: FetchSource,
        found: dict[ObjectKey, Fetched],
        failed: set[str],
    ) -> None:
        """One batch to one peer; ``later``: its keys it was not the first holder of."""
        started = time.perf_counter()
        reply = peer.fetch(keys, (tier,))
        self._observe(source, time.perf_counter() - started)
        if reply.failure:
            failed.add(instance_id)
            self._counters[f"peer_fetch_{reply.failure}"] += 1
            if reply.failure in _DOWN_CAUSES:
                self.health.failed(instance_id, reply.failure)
        else:
            self.health.succeeded(instance_id)
        if reply.dropped:
            self._counters["peer_records_dropped"] += reply.dropped
        wanted, ours, foreign = set(keys), 0, 0
        for key, (chunk, digest) in reply.chunks.items():
            if key not in wanted or key in found:
                continue
            if not self.usable(chunk):
                foreign += 1
                continue
            ours += 1
            found[key] = Fetched(chunk, source, instance_id, digest)
            if key in later:
                self._counters["peer_fallback_hits"] += 1
        if foreign and not ours:  # a peer of another layout that registered none: its
            failed.add(instance_id)  # copies must not count as hits meanwhile
            self.health.failed(instance_id, "another KV layout")

    def _peer_batches(
        self,
        keys: Sequence[ObjectKey],
        holders: dict[ObjectKey, list[Holder]],
        tier: Tier,
        asked: dict[ObjectKey, int],
        failed: set[str],
    ) -> dict[str, tuple[PeerFetcher, list[ObjectKey], set[ObjectKey]]]:
        """Per peer, the keys to ask it for now: for each key its next unshared ``tier``
        placement (past the ``asked[key]`` tried before) whose peer is usable, i.e. not in
        ``failed``, not down (then added to ``failed``, counted once per call) and with a
        URL (else added to ``failed``). With each peer, the keys it is not the first holder
        of."""
        assert self.fleet is not None
        batches: dict[str, tuple[PeerFetcher, list[ObjectKey], set[ObjectKey]]] = {}
        for key in keys:
            candidates = list(
                dict.fromkeys(
                    h.instance_id
                    for h in holders.get(key, ())
                    if h.tier == tier and not h.shared and h.instance_id != self.instance_id
                )
            )
            start = asked.get(key, 0)
            for n, instance_id in enumerate(candidates[start:], start=start):
                asked[key] = n + 1
                if instance_id in batches:
                    peer = batches[instance_id][0]
                else:
                    usable = self._usable_peer(instance_id, failed)
                    if usable is None:
                        continue
                    peer = usable
                    batches[instance_id] = (peer, [], set())
                batches[instance_id][1].append(key)
                if n > 0:
                    batches[instance_id][2].add(key)
                break
        return batches

    def _usable_peer(self, instance_id: str, failed: set[str]) -> PeerFetcher | None:
        """The peer to ask, or ``None`` (then in ``failed`` for the rest of the call)."""
        if instance_id in failed:
            return None
        if self.health.down(instance_id):
            failed.add(instance_id)
            self._counters["peer_skipped_down"] += 1
            return None
        assert self.fleet is not None
        peer = self.fleet.peer(instance_id)
        if peer is None:
            failed.add(instance_id)
        return peer

    def usable(self, chunk: StoredChunk) -> bool:
        """Whether ``chunk`` is in this node's layout (else counted ``fetched_wrong_layout``)."""
        ok = self.layout.fits(chunk.kv.shape, chunk.kv_dtype)
        if not ok:
            self._counters["fetched_wrong_layout"] += 1
        return ok
