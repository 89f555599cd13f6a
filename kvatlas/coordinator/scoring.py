"""Route scoring, the arithmetic: from the placements of a query's prefix chunks and of its
blend matches to one score per candidate instance (spec kv-events §4, docs/route-scoring.md).

Pure and per request: :mod:`kvatlas.coordinator.route_score` does the one blend match and the
one prefix walk and hands the placements here; each chunk becomes one :class:`Access` (built
once, shared by every candidate), so the per-instance work is a dictionary lookup per chunk,
and candidates that hold none of the fragments share one coverage pass.

Every copy an instance can use scores as one of :data:`TIER_CLASSES`: its own copies by their
tier (:data:`OWN_TIER_CLASS`: engine GPU memory ``gpu``, node DRAM and engine CPU memory
``l1``, node L2 ``l2``), a shared pool's copy as ``l2``, another live instance's L1 as
``peer`` (fragments only: the prefix is what an instance loads without asking anyone). A key
held several ways counts as its best class (highest weight); a chunk of a ``world_size > 1``
query needs every rank, and counts as its worst rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvatlas.keys import leftmost_greedy

if TYPE_CHECKING:  # only read by attribute: config.py imports this module, kept light
    from kvatlas.directory import Placement

TIER_CLASSES: Final = ("gpu", "l1", "l2", "peer")
"""The ``by_tier`` keys of a reply and the keys ``weights`` may set, in class-id order."""
GPU, L1, L2, PEER = range(4)
_CLASS_IDS: Final = (GPU, L1, L2, PEER)
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
NO_ATTACHMENTS: Final[Mapping[str, str]] = {}
"""No node serves an engine (``attached``: node id → the engine whose KV connector it is)."""


MAX_WEIGHT: Final = 1e12
"""The largest tier weight a query may set: a score is a sum of tokens times weights, and at
this bound the longest query's stays finite (any finite weight let a 512-token query's score
overflow to inf, which JSON carries as ``null``). The fragment weight has the same bound."""


def checked_weight(what: str, weight: float) -> float:
    """``weight`` as a float, if a number in [0, :data:`MAX_WEIGHT`] (``ValueError`` naming
    ``what`` otherwise; NaN fails both bounds); ``-0.0`` is ``0.0`` (a score of ``-0.0`` is
    never answered)."""
    if not 0 <= weight <= MAX_WEIGHT:
        raise ValueError(f"{what} must be a number in [0, {MAX_WEIGHT:g}], got {weight}")
    return float(weight) + 0.0


@dataclass(frozen=True, slots=True)
class Weights:
    """Tier weights by class id, and the share at which fragment tokens count."""

    by_class: tuple[float, ...]
    fragment: float
    rank: tuple[int, ...] = ()
    """Each class's place in the preference order (higher is better), derived."""

    def __post_init__(self) -> None:
        order = sorted(range(len(self.by_class)), key=self.preference)
        object.__setattr__(self, "rank", tuple(order.index(c) for c in range(len(order))))

    @classmethod
    def of(cls, overrides: Mapping[str, float] | None, fragment: float) -> Weights:
        """The defaults with ``overrides`` (a tier class name → a finite weight ≥ 0);
        ``ValueError`` names a bad entry."""
        merged = dict(DEFAULT_WEIGHTS)
        for name, weight in (overrides or {}).items():
            if name not in merged:
                raise ValueError(f"weights: unknown tier {name!r:.40} (one of {TIER_CLASSES})")
            merged[name] = checked_weight(f"weights.{name}", weight)
        return cls(
            tuple(merged[name] for name in TIER_CLASSES),
            checked_weight("fragment weight", fragment),
        )

    def preference(self, c: Class) -> tuple[float, int]:
        """Higher is better: the weight, then the class order (gpu before l1 before l2)."""
        return (self.by_class[c], -c)

    def better(self, a: Class | None, b: Class | None) -> Class | None:
        """The preferred of two ways to use a copy (``None``: no way)."""
        if a is None:
            return b
        return a if b is None or self.rank[a] > self.rank[b] else b

    def worse(self, a: Class | None, b: Class | None) -> Class | None:
        """What a chunk needing both counts as (``None`` if either is out of reach)."""
        if a is None or b is None:
            return None
        return a if self.rank[a] < self.rank[b] else b


@dataclass(frozen=True, slots=True)
class Access:
    """Who can use one chunk of the query (every rank of it) and in which class: each of
    ``named`` (``None``: it cannot), and ``others`` for every other instance. Built once per
    chunk, so asking for one instance is one dictionary lookup."""

    named: dict[str, Class | None]
    others: Class | None

    def class_for(self, instance_id: str) -> Class | None:
        return self.named.get(instance_id, self.others)

    @classmethod
    def of(
        cls,
        ranks: Sequence[Sequence[Placement]],
        peers: frozenset[str] | None,
        weights: Weights,
        attached: Mapping[str, str] = NO_ATTACHMENTS,
    ) -> Access:
        """From each rank's placements: own copies by tier, shared pools, and (``peers``
        given: fragments) a live peer's L1; a chunk counts as its worst rank. ``attached``
        maps a node to the engine it serves: the node's copies are that engine's own too."""
        if len(ranks) == 1:
            return cls.one(ranks[0], peers, weights, attached)
        per_rank = [
            _rank_access(placements, peers, weights, attached) if placements else NOBODY
            for placements in ranks
        ]
        worse = weights.worse
        names = set().union(*(a.named for a in per_rank))
        named: dict[str, Class | None] = {}
        for instance_id in names:
            c: Class | None = per_rank[0].class_for(instance_id)
            for a in per_rank[1:]:
                c = worse(c, a.class_for(instance_id))
            named[instance_id] = c
        others = per_rank[0].others
        for a in per_rank[1:]:
            others = worse(others, a.others)
        return cls(named, others)

    @staticmethod
    def one(
        placements: Sequence[Placement],
        peers: frozenset[str] | None,
        weights: Weights,
        attached: Mapping[str, str] = NO_ATTACHMENTS,
    ) -> Access:
        """:meth:`of` for a chunk of one rank (``world_size`` 1): its one key's placements."""
        return _rank_access(placements, peers, weights, attached) if placements else NOBODY


NOBODY: Final = Access({}, None)
"""A key no one holds."""


def _rank_access(
    placements: Sequence[Placement],
    peers: frozenset[str] | None,
    weights: Weights,
    attached: Mapping[str, str],
) -> Access:
    """One key: each owner's best own class (a node's copy is also its engine's own), anyone's
    best shared or peer class."""
    rank = weights.rank
    own: dict[str, Class] = {}
    shared: Class | None = None
    holders: list[str] = []
    for p in placements:
        if p.shared:
            shared = SHARED_CLASS
            continue
        c = OWN_TIER_CLASS.get(p.tier, L2)
        engine = attached.get(p.instance_id)
        for owner in (p.instance_id,) if engine is None else (p.instance_id, engine):
            old = own.get(owner)
            if old is None or rank[c] > rank[old]:
                own[owner] = c
        if peers is not None and p.tier in PEER_TIERS and p.instance_id in peers:
            holders.append(p.instance_id)
    better = weights.better
    others = better(shared, PEER) if holders else shared
    named: dict[str, Class | None] = {}
    for instance_id, c in own.items():
        best = c if shared is None or rank[c] > rank[shared] else shared
        if (
            holders
            and rank[PEER] > rank[best]
            and any(h != instance_id and attached.get(h) != instance_id for h in holders)
        ):
            best = PEER
        named[instance_id] = best
    return Access(named, others)


def walk_prefix(candidates: Sequence[str], chunks: Iterable[Access]) -> dict[str, list[Class]]:
    """One walk over the query's leading chunks for every candidate at once: each one's
    classes of the leading chunks it can load from its own tiers or a shared pool. The walk
    stops at the first chunk no candidate can load (``chunks`` may be lazy)."""
    out: dict[str, list[Class]] = {i: [] for i in candidates}
    live = list(out)
    for access in chunks:
        if not live:
            break
        still = []
        for instance_id in live:
            c = access.class_for(instance_id)
            if c is not None:
                out[instance_id].append(c)
                still.append(instance_id)
        live = still
    return out


Fragment = tuple[int, Access]
"""A blend match: where it starts in the query, and who can fetch its chunk."""


def cover_fragments(
    candidates: Sequence[str],
    prefix_tokens: Mapping[str, int],
    fragments: Sequence[Fragment],
    chunk_size: int,
    weights: Weights,
) -> dict[str, list[Class]]:
    """Each candidate's classes of the matches it reuses after its prefix: those at or after
    its ``prefix_tokens`` it can fetch (own tiers, shared pools, a live peer's L1), made
    disjoint leftmost-greedy as the node resolves them; at equal starts the better class
    wins. ``fragments`` are in query order.

    Matches are merged by start once; each start gets the class any instance would have
    (``others``) and, for the instances some match there names, their own. Candidates no
    match names share one pass per prefix length."""
    better = weights.better
    starts: list[int] = []
    others: list[Class | None] = []
    own: dict[str, dict[int, Class | None]] = {}
    here: set[str] = set()  # the instances named at the current start
    for start, access in fragments:
        if not starts or starts[-1] != start:
            starts.append(start)
            others.append(None)
            here = set()
        k = len(starts) - 1
        for instance_id in here - access.named.keys():
            own[instance_id][k] = better(own[instance_id][k], access.others)
        for instance_id, c in access.named.items():
            mine = own.setdefault(instance_id, {})
            mine[k] = better(mine[k] if instance_id in here else others[k], c)
            here.add(instance_id)
        others[k] = better(others[k], access.others)
    generic: dict[int, list[Class]] = {}
    out: dict[str, list[Class]] = {}
    for instance_id in candidates:
        p = prefix_tokens[instance_id]
        if instance_id not in own:
            if p not in generic:
                generic[p] = _cover(starts, others, p, chunk_size)
            out[instance_id] = generic[p]
        else:
            classes = list(others)
            for k, c in own[instance_id].items():
                classes[k] = c
            out[instance_id] = _cover(starts, classes, p, chunk_size)
    return out


def _cover(
    starts: Sequence[int], classes: Sequence[Class | None], prefix_tokens: int, chunk_size: int
) -> list[Class]:
    """The classes of the chunks kept at ``starts`` (one candidate's ``classes``)."""
    usable = [
        k
        for k, (s, c) in enumerate(zip(starts, classes, strict=True))
        if s >= prefix_tokens and c is not None
    ]
    at = [starts[k] for k in usable]
    kept = leftmost_greedy(at, [s + chunk_size for s in at])
    return [classes[usable[j]] for j in kept]  # type: ignore[misc]


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
    classes = _CLASS_IDS
    tokens = [prefix.count(c) * chunk_size for c in classes]  # one C-level pass per class
    frag = [fragments.count(c) * chunk_size for c in classes]
    w = weights.by_class
    prefix_score = tokens[0] * w[0] + tokens[1] * w[1] + tokens[2] * w[2] + tokens[3] * w[3]
    frag_score = frag[0] * w[0] + frag[1] * w[1] + frag[2] * w[2] + frag[3] * w[3]
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
