"""Presence: tier membership per key and per hash, the local index claim that follows it, and
the fetch cost read from it (at any number of chunks held)."""

from __future__ import annotations

import numpy as np

from kvatlas.directory import BlendIndex
from kvatlas.keys import BlendNamespace, ObjectKey
from kvatlas.node.presence import Presence
from kvatlas.node.segments import FetchCost, Segment
from kvatlas.node.stored_chunk import StoredChunk

C = 8
KV = np.zeros(4, dtype=np.float32)


def namespace(salt: str) -> BlendNamespace:
    return BlendNamespace("m", salt, 1)


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 1 << 24 | 1 << 8, 0, salt)


def chunk(i: int, salt: str = "", offset: int = 0) -> StoredChunk:
    tokens = np.arange(i * C, (i + 1) * C, dtype=np.uint32)
    return StoredChunk(key(i, salt), KV, tokens, offset)


def segment(i: int, source: str = "local") -> Segment:
    return Segment(key(i).chunk_hash, 0, 0, C, source)  # type: ignore[arg-type]


def presence() -> Presence:
    return Presence(BlendIndex(C), namespace)


def matches(p: Presence, i: int, salt: str = "") -> int:
    return len(p.index.match(np.arange(i * C, (i + 1) * C, dtype=np.uint32), namespace(salt)))


def test_index_claim_follows_the_last_tier() -> None:
    p = presence()
    p.gain(chunk(1), "l1")
    p.gain(chunk(1), "l2")
    assert p.tiers_of(key(1).chunk_hash) == {"l1", "l2"} and matches(p, 1) == 1
    p.lose(key(1), "l1")
    assert p.tiers_of(key(1).chunk_hash) == {"l2"} and matches(p, 1) == 1
    p.lose(key(1), "l2")
    assert p.tiers_of(key(1).chunk_hash) == frozenset() and matches(p, 1) == 0
    assert len(p) == 0


def test_losing_what_is_not_held_is_a_no_op() -> None:
    p = presence()
    p.lose(key(1), "l1")
    p.gain(chunk(1), "l2")
    p.lose(key(1), "l1")
    assert p.tiers_of(key(1).chunk_hash) == {"l2"} and len(p) == 1


def test_unknown_offset_or_partial_tokens_are_held_but_never_indexed() -> None:
    p = presence()
    p.gain(StoredChunk(key(1), KV, np.arange(C, dtype=np.uint32), -1), "l1")
    p.gain(StoredChunk(key(2), KV, np.arange(C - 1, dtype=np.uint32), 0), "l1")
    p.gain(StoredChunk(key(3), KV), "l1")
    assert len(p) == 3 and matches(p, 0) == 0
    for i in (1, 2, 3):
        p.lose(key(i), "l1")  # nothing to remove from the index, and no error
    assert len(p) == 0


def test_tiers_by_hash_span_salts() -> None:
    p = presence()
    p.gain(chunk(1, salt="a"), "l2")
    p.gain(chunk(1, salt="b"), "l1")
    assert p.tiers_of(key(1).chunk_hash) == {"l1", "l2"}
    p.lose(key(1, salt="b"), "l1")
    assert p.tiers_of(key(1).chunk_hash) == {"l2"}


def test_cost_of() -> None:
    p = presence()
    p.gain(chunk(1), "l1")
    p.gain(chunk(2), "l2")
    assert p.cost_of(segment(1)) == FetchCost.LOCAL_L1
    assert p.cost_of(segment(2)) == FetchCost.SHARED_L2
    assert p.cost_of(segment(3, "fleet")) == FetchCost.PEER_L1
    assert p.cost_of(segment(3, "local")) == FetchCost.UNKNOWN
    assert p.cost_of(segment(3, "both")) == FetchCost.UNKNOWN


def test_cost_of_with_1000_chunks_held() -> None:
    """The per-hash map answers at any size (a scan capped at 64 chunks once did not)."""
    p = presence()
    for i in range(1000):
        p.gain(chunk(i, offset=i * C), "l1")
    assert len(p) == 1000
    assert {p.cost_of(segment(i, "both")) for i in range(1000)} == {FetchCost.LOCAL_L1}
    p.lose(key(999), "l1")
    assert p.cost_of(segment(999, "fleet")) == FetchCost.PEER_L1
