"""Presence: which of this node's own tiers (its L1, its L2) hold each chunk.

Two guarantees, both kept under one lock:

* the node's local blend index claims a chunk exactly while some tier of this node holds it
  with known tokens and offset: the local matcher only offers what this node can serve itself
  (the claim goes with the last tier that drops the chunk);
* :meth:`Presence.cost_of` reads the per-hash tier count, so ranking a blend segment's fetch
  cost is one dictionary read however many chunks the node holds.

See ``docs/node.md`` (pieces, blend lookup).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from kvatlas.directory import BlendIndex
from kvatlas.keys import BlendNamespace, ObjectKey, TokenArray
from kvatlas.node.segments import FetchCost, Segment
from kvatlas.node.stored_chunk import StoredChunk

Tier = Literal["l1", "l2"]
L1: Final = "l1"
L2: Final = "l2"


@dataclass(slots=True)
class _Held:
    tiers: set[Tier]
    tokens: TokenArray | None
    token_offset: int


class Presence:
    """Tier membership per key and per chunk hash, and the local index claims that follow it.

    ``namespace`` maps a key's cache salt to the blend namespace its claim goes in.
    """

    def __init__(self, index: BlendIndex, namespace: Callable[[str], BlendNamespace]) -> None:
        self.index = index
        self._namespace = namespace
        self._lock = threading.Lock()
        self._held: dict[ObjectKey, _Held] = {}
        self._tiers_by_hash: dict[bytes, Counter[Tier]] = {}

    def gain(self, chunk: StoredChunk, tier: Tier) -> None:
        """``tier`` now holds ``chunk``; the first tier to hold it adds its index claim (when
        its tokens are one whole chunk at a known offset)."""
        key = chunk.key
        with self._lock:
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _Held(set(), chunk.tokens, chunk.token_offset)
                if (
                    chunk.tokens is not None
                    and len(chunk.tokens) == self.index.chunk_size
                    and chunk.token_offset >= 0
                ):
                    self.index.add(
                        chunk.tokens,
                        key.chunk_hash,
                        chunk.token_offset,
                        self._namespace(key.cache_salt),
                    )
            if tier not in held.tiers:
                held.tiers.add(tier)
                self._tiers_by_hash.setdefault(key.chunk_hash, Counter())[tier] += 1

    def lose(self, key: ObjectKey, tier: Tier) -> None:
        """``tier`` no longer holds ``key``; the last tier to drop it removes its claim."""
        with self._lock:
            held = self._held.get(key)
            if held is None or tier not in held.tiers:
                return
            held.tiers.discard(tier)
            by_hash = self._tiers_by_hash[key.chunk_hash]
            by_hash[tier] -= 1
            if by_hash.total() <= 0:
                del self._tiers_by_hash[key.chunk_hash]
            if held.tiers:
                return
            del self._held[key]
            if held.tokens is not None and held.token_offset >= 0:
                self.index.remove_claim(
                    held.tokens, key.chunk_hash, self._namespace(key.cache_salt)
                )

    def tiers_of_key(self, key: ObjectKey) -> frozenset[Tier]:
        """The tiers of this node holding ``key``."""
        with self._lock:
            held = self._held.get(key)
            return frozenset(held.tiers) if held is not None else frozenset()

    def holdings(self) -> list[tuple[ObjectKey, frozenset[Tier], TokenArray | None, int]]:
        """A snapshot of every held key: its tiers, tokens (if known) and token offset."""
        with self._lock:
            return [
                (key, frozenset(h.tiers), h.tokens, h.token_offset) for key, h in self._held.items()
            ]

    def tiers_of(self, chunk_hash: bytes) -> frozenset[Tier]:
        """The tiers of this node holding some key with ``chunk_hash`` (any salt or rank)."""
        with self._lock:
            by_hash = self._tiers_by_hash.get(chunk_hash)
            return frozenset(t for t, n in by_hash.items() if n > 0) if by_hash else frozenset()

    def cost_of(self, segment: Segment) -> FetchCost:
        """Where the segment's KV would come from: this node's L1, else its L2 (ranked as
        shared L2), else a peer's L1 when only the fleet knows it, else unknown."""
        tiers = self.tiers_of(segment.chunk_hash)
        if L1 in tiers:
            return FetchCost.LOCAL_L1
        if tiers:
            return FetchCost.SHARED_L2
        return FetchCost.PEER_L1 if segment.source == "fleet" else FetchCost.UNKNOWN

    def __len__(self) -> int:
        """Keys held by at least one tier."""
        with self._lock:
            return len(self._held)
