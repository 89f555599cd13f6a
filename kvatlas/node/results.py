"""What a :class:`~kvatlas.node.cache_node.CacheNode` call returns: retrieved KV, blend parts,
held placements, what a delete did, the node's stats."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from kvatlas.directory import BlendStats
from kvatlas.keys import ObjectKey
from kvatlas.node.presence import Tier
from kvatlas.node.segments import Segment
from kvatlas.node.token_cache import TokenCacheStats


class HeldPlacement(NamedTuple):
    """One placement this node holds: ``backend`` is ``"dram"`` for L1, the L2 backend's name
    for L2 (a shared pool's placements are listed too: ``node.l2.shared`` says so)."""

    key: ObjectKey
    tier: Tier
    backend: str


@dataclass
class Retrieved:
    """Prefix retrieval: the KV of the leading chunks that could be found, in order."""

    kv: list[Any]
    hit_tokens: int
    sources: Counter[str] = field(default_factory=Counter)


@dataclass
class BlendRetrieval:
    """Blend retrieval: re-RoPE'd KV per reused segment; misses are reported, not fatal."""

    parts: list[tuple[Segment, Any]]
    misses: list[Segment]
    sources: Counter[str] = field(default_factory=Counter)

    @property
    def reused_tokens(self) -> int:
        return sum(seg.length for seg, _ in self.parts)


class Deleted(NamedTuple):
    """What :meth:`CacheNode.delete` did: copies removed, held keys skipped, the L2 error it
    stopped at (``None``: it did all)."""

    deleted: int
    skipped: int
    error: str | None = None


class Loaded(NamedTuple):
    """What :meth:`~kvatlas.node.moves.MoveTarget.load_and_hold` did: the keys L1 holds (and
    keeps) now, those no tier had, those L1 had no room for, why the source could not be read
    (``""``: it answered), and how many keys it had no time left to try (asked again)."""

    held: list[ObjectKey]
    missing: list[ObjectKey]
    no_room: list[ObjectKey]
    source_failure: str = ""
    unfinished: int = 0


@dataclass(frozen=True, slots=True)
class NodeStats:
    """A node's state at one instant. ``local_index`` is the local blend index's stats;
    ``counters`` what the node counted (stores, refusals, misses, ...; a counter appears once
    it was first counted)."""

    instance_id: str
    l1_chunks: int
    l1_bytes: int
    local_index: BlendStats
    token_cache: TokenCacheStats
    counters: Mapping[str, int]
    event_sink: Mapping[str, int] | None = None
    """The event sink's counters (sent, dropped, quarantined, auth failures, splits, ...), if
    the sink keeps any (see docs/node.md)."""

    def to_wire(self) -> dict[str, Any]:
        """The engine API's ``/engine/stats`` reply: the counters flat beside the fields."""
        return {
            "instance_id": self.instance_id,
            "l1_chunks": self.l1_chunks,
            "l1_bytes": self.l1_bytes,
            "local_index": asdict(self.local_index),
            "token_cache": asdict(self.token_cache),
            **({"event_sink": dict(self.event_sink)} if self.event_sink is not None else {}),
            **self.counters,
        }
