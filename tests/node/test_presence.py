"""Presence: tier membership per key and per hash, the local index claim that follows it, each
salt's matches carrying its own offsets whatever other salts hold, and the fetch cost read from
it (at any number of chunks held)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

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


def ids(i: int) -> np.ndarray:
    return np.arange(i * C, (i + 1) * C, dtype=np.uint32)


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


def own_matches(p: Presence, salt: str, *chunks: int) -> list[tuple[bytes, int, int]]:
    """``p.match`` of a query holding ``chunks``' ids back to back, from position 0."""
    query = np.concatenate([ids(i) for i in chunks])
    return [(m.chunk_hash, m.old_st, m.cur_st) for m in p.match(query, namespace(salt))]


def test_each_salt_matches_its_own_offset_under_the_real_hash() -> None:
    """Equal ids under one chunk hash at two offsets for two salts: each salt's match is its
    own (the index's one occupant per content and hash once gave both the later offset)."""
    p, h = presence(), key(1).chunk_hash
    p.gain(chunk(1, "a", offset=4 * C), "l1")
    p.gain(chunk(1, "b", offset=8 * C), "l1")
    assert own_matches(p, "a", 1) == [(h, 4 * C, 0)]
    assert own_matches(p, "b", 1) == [(h, 8 * C, 0)]
    assert own_matches(p, "c", 1) == []
    p.lose(key(1, "a"), "l1")  # the salt under the hash itself goes; the surrogate's stays
    assert own_matches(p, "a", 1) == [] and own_matches(p, "b", 1) == [(h, 8 * C, 0)]
    p.gain(chunk(1, "a", offset=2 * C), "l2")
    assert own_matches(p, "a", 1) == [(h, 2 * C, 0)]
    assert own_matches(p, "b", 1) == [(h, 8 * C, 0)]
    p.lose(key(1, "b"), "l1")
    assert own_matches(p, "a", 1) == [(h, 2 * C, 0)] and own_matches(p, "b", 1) == []
    p.lose(key(1, "a"), "l2")
    assert len(p) == 0 and p.index.stats().occupants == 0
    assert not (p._occupants or p._first_salt or p._surrogates)


def test_a_claim_dropped_during_the_scan_is_left_out() -> None:
    """A hit whose claim went while the index was scanned is not handed out (a surrogate
    never leaves :meth:`Presence.match`)."""
    p = presence()
    p.gain(chunk(1, "a", offset=4 * C), "l1")
    p.gain(chunk(1, "b", offset=8 * C), "l1")
    scan = p.index.match

    def scan_then_drop(tokens: Any, ns: BlendNamespace) -> Any:
        hits = scan(tokens, ns)
        assert len(hits) == 1
        p.lose(key(1, ns.cache_salt), "l1")
        return hits

    p.index.match = scan_then_drop  # type: ignore[method-assign]
    assert own_matches(p, "b", 1) == [] and own_matches(p, "a", 1) == []


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 2),
            st.sampled_from("abc"),
            st.sampled_from(["l1", "l2"]),
            st.integers(0, 6),
        ),
        max_size=40,
    )
)
def test_matches_follow_each_salts_own_holdings(
    steps: list[tuple[bool, int, str, str, int]],
) -> None:
    """Random gains and losses of three chunks (ids equal for every salt) by three salts at
    random offsets: after each step each salt's matches are exactly its held chunks, at the
    offset its first tier got them with, under their real hashes."""
    p = presence()
    held: dict[tuple[int, str], tuple[set[str], int]] = {}
    for gain, i, salt, tier, at in steps:
        if gain:
            p.gain(chunk(i, salt, offset=at * C), tier)
            held.setdefault((i, salt), (set(), at * C))[0].add(tier)
        else:
            p.lose(key(i, salt), tier)
            tiers, _ = held.get((i, salt), (set(), 0))
            tiers.discard(tier)
            if not tiers:
                held.pop((i, salt), None)
        for s in "abc":
            want = sorted(
                (key(j).chunk_hash, off, j * C) for (j, t), (_, off) in held.items() if t == s
            )
            assert sorted(own_matches(p, s, 0, 1, 2)) == want
    assert p.index.stats().occupants == len(held)
