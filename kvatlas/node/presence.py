"""Presence: which of this node's own tiers (its L1, its L2) hold each chunk.

Three guarantees, all kept under one lock:

* the node's local blend index claims a chunk exactly while some tier of this node holds it
  with known tokens and offset: the local matcher only offers what this node can serve itself
  (the claim goes with the last tier that drops the chunk);
* a cache salt's local matches (:meth:`Presence.match`) carry that salt's own offsets, and
  what one salt holds or drops never changes another's. The index keeps one occupant per
  (content, chunk hash) with one offset, and a chunk hash names one text for every salt:
  equal ids under one hash at another offset for a second salt (a chunk handed over by a
  move, a prefetch or a shared pool carries its own offset) would move the first salt's
  ``old_st``. So the first salt to claim a chunk hash claims it under the hash itself and
  every other salt holding it meanwhile under a surrogate, a keyed hash of (salt, chunk hash)
  under a per-process secret, never on the wire (``directory.tenant_bindings.occupant_hash``,
  as the directory's own per-salt occupants): one occupant each. A match maps the
  surrogates back to the chunk hash and keeps only hits that are the querying salt's claims
  now (a claim dropped while the match ran is left out);
* :meth:`Presence.cost_of` reads the per-hash tier count, so ranking a blend segment's fetch
  cost is one dictionary read however many chunks the node holds.

See ``docs/node.md`` (pieces, blend lookup).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvatlas.directory import BlendIndex
from kvatlas.directory.tenant_bindings import occupant_hash
from kvatlas.keys import BlendMatch, BlendNamespace, ObjectKey, TokenArray
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
    occupant: bytes | None = None  # the hash its index claim is under (None: not indexed)


@dataclass(slots=True)
class _Occupant:
    """The hash one salt's claims of one chunk hash are under, and how many held keys of that
    salt and chunk hash have a claim in the index."""

    under: bytes
    claims: int = 0


class Presence:
    """Tier membership per key and per chunk hash, and the local index claims that follow it.

    ``namespace`` maps a key's cache salt to the blend namespace its claim goes in.
    """

    def __init__(self, index: BlendIndex, namespace: Callable[[str], BlendNamespace]) -> None:
        self.index = index
        self.chunk_size = index.chunk_size
        self._namespace = namespace
        self._lock = threading.Lock()
        self._held: dict[ObjectKey, _Held] = {}
        self._tiers_by_hash: dict[bytes, Counter[Tier]] = {}
        self._occupants: dict[tuple[bytes, str], _Occupant] = {}  # (chunk hash, salt) ->
        self._first_salt: dict[bytes, str] = {}  # chunk hash -> the salt claiming it as itself
        self._surrogates: dict[bytes, tuple[bytes, str]] = {}  # -> (chunk hash, salt)

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
                    occupant = self._claim(key.chunk_hash, key.cache_salt)
                    try:
                        self.index.add(
                            chunk.tokens,
                            occupant,
                            chunk.token_offset,
                            self._namespace(key.cache_salt),
                        )
                    except BaseException:
                        self._unclaim(key.chunk_hash, key.cache_salt)
                        raise
                    held.occupant = occupant
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
            if held.occupant is not None:
                assert held.tokens is not None
                self._unclaim(key.chunk_hash, key.cache_salt)
                self.index.remove_claim(held.tokens, held.occupant, self._namespace(key.cache_salt))

    def match(self, tokens: Any, namespace: BlendNamespace) -> list[BlendMatch]:
        """The local index's matches for ``namespace`` (:meth:`BlendIndex.match`), each under
        its real chunk hash: only hits that are claims of the namespace's salt, as they are
        once the scan is done (the index prunes other namespaces; a claim dropped meanwhile
        is left out, so a surrogate is never handed out)."""
        hits = self.index.match(tokens, namespace)
        salt = namespace.cache_salt
        out: list[BlendMatch] = []
        with self._lock:
            for hit in hits:
                h = hit.chunk_hash
                own = self._occupants.get((h, salt))
                if own is not None and own.under == h:
                    out.append(hit)
                elif (real := self._surrogates.get(h)) is not None and real[1] == salt:
                    out.append(BlendMatch(real[0], hit.old_st, hit.cur_st))
        return out

    def _claim(self, chunk_hash: bytes, salt: str) -> bytes:
        """The hash a held key of ``salt`` claims ``chunk_hash`` under in the index: the chunk
        hash itself for the first salt to claim it, else the salt's surrogate (lock held)."""
        own = self._occupants.get((chunk_hash, salt))
        if own is None:
            if self._first_salt.setdefault(chunk_hash, salt) == salt:
                own = _Occupant(chunk_hash)
            else:
                surrogate = occupant_hash(chunk_hash, salt)
                self._surrogates[surrogate] = (chunk_hash, salt)
                own = _Occupant(surrogate)
            self._occupants[(chunk_hash, salt)] = own
        own.claims += 1
        return own.under

    def _unclaim(self, chunk_hash: bytes, salt: str) -> None:
        """One claim of ``salt`` on ``chunk_hash`` is gone; its occupant hash with the last
        (lock held)."""
        own = self._occupants[(chunk_hash, salt)]
        own.claims -= 1
        if own.claims > 0:
            return
        del self._occupants[(chunk_hash, salt)]
        if own.under == chunk_hash:
            del self._first_salt[chunk_hash]
        else:
            del self._surrogates[own.under]

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
