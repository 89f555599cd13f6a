"""Route scoring, the arithmetic: from the placements of a query's prefix chunks and of its
blend matches to one score per candidate instance (spec kv-events §4, docs/route-scoring.md).

Pure and per request: :mod:`kvatlas.coordinator.route_score` does the one blend match and the
one prefix walk and hands the placements here as :class:`Reach` values (one per key, built
once, shared by every candidate), so the per-instance work is a pass over small tuples.

Every copy an instance can use scores as one of :data:`TIER_CLASSES`: its own copies by their
tier (:data:`OWN_TIER_CLASS`: engine GPU memory ``gpu``, node DRAM and engine CPU memory
``l1``, node L2 ``l2``), a shared pool's copy as ``l2``, another live instance's L1 as
``peer`` (fragments only: the prefix is what an instance loads without asking anyone). A key
held several ways counts as its best class (highest weight); a chunk of a ``world_size > 1``
query needs every rank, and counts as its worst rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Final

from kvatlas.keys import leftmost_greedy

if TYPE_CHECKING:  # only read by attribute: config.py imports this module, kept light
    from kvatlas.directory import Placement

TIER_CLASSES: Final = ("gpu", "l1", "l2", "peer")
"""The ``by_tier`` keys of a reply and the keys ``weights`` may set, in class-id order."""
GPU, L1, L2, PEER = range(4)
DEFAULT_WEIGHTS: Final = {"gpu": 1.0, "l1": 0.8, "l2": 0.5, "peer": 0.6}
DEFAULT_FRAGMENT_WEIGHT: Final = 0.85
"""Fragment tokens score at this share: CacheBlend recomputes ≈15% of the reused tokens."""
OWN_TIER_CLASS: Final[Mapping[str, int]] = {"gpu": GPU, "engine-cpu": L1, "l1": L1, "l2": L2}
"""The class of an instance's own copy, by the placement's tier; a tier not listed scores as
``l2`` (the slowest own class) until it is added here."""
SHARED_CLASS: Final = L2
PEER_TIERS: Final = frozenset({"l1"})
"""Tiers whose own copies other instances can fetch (a node's peer API serves its L1)."""

Class = int
"""A tier class id: an index into :data:`TIER_CLASSES`."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Tier weights by class id, and the share at which fragment tokens count."""

    by_class: tuple[float, ...]
    fragment: float

    @classmethod
    def of(cls, overrides: Mapping[str, float] | None, fragment: float) -> Weights:
        """The defaults with ``overrides`` (a tier class name → a finite weight ≥ 0);
        ``ValueError`` names a bad entry."""
        merged = dict(DEFAULT_WEIGHTS)
        for name, weight in (overrides or {}).items():
            if name not in merged:
                raise ValueError(f"weights: unknown tier {name!r:.40} (one of {TIER_CLASSES})")
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weights.{name}: must be a finite number >= 0, got {weight}")
            merged[name] = float(weight)
        if not math.isfinite(fragment) or fragment < 0:
            raise ValueError(f"fragment weight must be a finite number >= 0, got {fragment}")
        return cls(tuple(merged[name] for name in TIER_CLASSES), fragment)

    def preference(self, c: Class) -> tuple[float, int]:
        """Higher is better: the weight, then the class order (gpu before l1 before l2)."""
        return (self.by_class[c], -c)


@dataclass(frozen=True, slots=True)
class Reach:
    """Who can use one key without recompute, and how: each instance's best own class, the
    best shared-pool class, and the instances whose own L1 holds it (what peers fetch)."""

    own: dict[str, Class]
    shared: Class | None
    l1_holders: frozenset[str]

    @classmethod
    def of(cls, placements: Iterable[Placement], weights: Weights) -> Reach:
        own: dict[str, Class] = {}
        shared: Class | None = None
        holders = []
        pref = weights.preference
        for p in placements:
            if p.shared:
                if shared is None or pref(SHARED_CLASS) > pref(shared):
                    shared = SHARED_CLASS
                continue
            c = OWN_TIER_CLASS.get(p.tier, L2)
            old = own.get(p.instance_id)
            if old is None or pref(c) > pref(old):
                own[p.instance_id] = c
            if p.tier in PEER_TIERS:
                holders.append(p.instance_id)
        return cls(own, shared, frozenset(holders))

    def best_for(
        self, instance_id: str, peers: frozenset[str] | None, weights: Weights
    ) -> Class | None:
        """The best class ``instance_id`` can use this key in (``None``: it cannot); peer L1
        counts only when ``peers`` (the live instances) is given."""
        pref = weights.preference
        best = self.own.get(instance_id)
        shared = self.shared
        if shared is not None and (best is None or pref(shared) > pref(best)):
            best = shared
        if (
            peers is not None
            and (best is None or pref(PEER) > pref(best))
            and any(h != instance_id and h in peers for h in self.l1_holders)
        ):
            best = PEER
        return best


ChunkReach = Sequence[Reach]
"""One chunk of the query: the reach of each rank's key (``world_size`` of them)."""


def chunk_class(
    instance_id: str, ranks: ChunkReach, peers: frozenset[str] | None, weights: Weights
) -> Class | None:
    """The class one instance can use a whole chunk in: every rank's key is needed, so the
    worst rank counts (``None``: some rank is out of reach)."""
    worst: Class | None = None
    pref = weights.preference
    for reach in ranks:
        best = reach.best_for(instance_id, peers, weights)
        if best is None:
            return None
        if worst is None or pref(best) < pref(worst):
            worst = best
    return worst


def walk_prefix(
    candidates: Sequence[str], chunks: Iterable[ChunkReach], weights: Weights
) -> dict[str, list[Class]]:
    """One walk over the query's leading chunks for every candidate at once: each one's
    classes of the leading chunks it can load from its own tiers or a shared pool. The walk
    stops at the first chunk no candidate can load (``chunks`` may be lazy)."""
    out: dict[str, list[Class]] = {i: [] for i in candidates}
    live = list(out)
    for ranks in chunks:
        if not live:
            break
        still = []
        for instance_id in live:
            c = chunk_class(instance_id, ranks, None, weights)
            if c is not None:
                out[instance_id].append(c)
                still.append(instance_id)
        live = still
    return out


Fragment = tuple[int, ChunkReach]
"""A blend match: where it starts in the query, and its chunk's reach."""


def cover_fragments(
    instance_id: str,
    prefix_tokens: int,
    fragments: Sequence[Fragment],
    chunk_size: int,
    peers: frozenset[str],
    weights: Weights,
) -> list[Class]:
    """The classes of the matches one instance reuses after its prefix: those at or after
    ``prefix_tokens`` it can fetch (own tiers, shared pools, a live peer's L1), made disjoint
    leftmost-greedy as the node resolves them; at equal starts the better class wins."""
    usable = []
    for start, ranks in fragments:
        if start >= prefix_tokens:
            c = chunk_class(instance_id, ranks, peers, weights)
            if c is not None:
                usable.append((start, c))
    w = weights.by_class
    usable.sort(key=lambda sc: (sc[0], -w[sc[1]], sc[1]))
    kept = leftmost_greedy(usable, _start, lambda sc: sc[0] + chunk_size)
    return [c for _, c in kept]


_start = itemgetter(0)


@dataclass(frozen=True, slots=True)
class InstanceScore:
    """One row of a ``POST /route/score`` reply."""

    instance_id: str
    prefix_tokens: int
    fragment_tokens: int
    score: float
    by_tier: dict[str, int]
    """Tokens (prefix and fragments) per tier class, every class listed."""


def instance_score(
    instance_id: str,
    prefix: Sequence[Class],
    fragments: Sequence[Class],
    chunk_size: int,
    weights: Weights,
) -> InstanceScore:
    """Σ tokens × tier weight, fragment tokens × the fragment weight on top."""
    tokens = [0] * len(TIER_CLASSES)
    for c in prefix:
        tokens[c] += chunk_size
    prefix_score = sum(n * w for n, w in zip(tokens, weights.by_class, strict=True))
    frag = [0] * len(TIER_CLASSES)
    for c in fragments:
        frag[c] += chunk_size
    frag_score = sum(n * w for n, w in zip(frag, weights.by_class, strict=True))
    score = prefix_score + weights.fragment * frag_score
    by_tier = {name: tokens[c] + frag[c] for c, name in enumerate(TIER_CLASSES)}
    return InstanceScore(
        instance_id,
        len(prefix) * chunk_size,
        len(fragments) * chunk_size,
        round(score, 6),
        by_tier,
    )


def rank_scores(scores: Iterable[InstanceScore]) -> list[InstanceScore]:
    """Best first: higher score, then the longer prefix, then by instance id."""
    return sorted(scores, key=lambda s: (-s.score, -s.prefix_tokens, s.instance_id))
