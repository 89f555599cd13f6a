"""Segments: union, prefix cut and overlap resolution against brute-force oracles."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.keys import BlendMatch
from kvatlas.node.segments import (
    Candidate,
    FetchCost,
    Segment,
    filter_prefix,
    merge_union,
    resolve_overlaps,
)

HASHES = [bytes([i]) * 32 for i in range(4)]

# ---------------------------------------------------------------- oracles and invariants


def disjoint(segments: list[Segment]) -> bool:
    spans = sorted((s.cur_st, s.end) for s in segments)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def best_selection(candidates: list[Segment]) -> tuple[int, int]:
    """Brute force over every subset: (max tokens covered, max segments kept) by disjoint
    subsets (each maximised on its own)."""
    best_tokens = best_count = 0
    for r in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, r):
            if disjoint(list(subset)):
                best_tokens = max(best_tokens, sum(s.length for s in subset))
                best_count = max(best_count, r)
    return best_tokens, best_count


def check_invariants(out: list[Segment], candidates: list[Segment]) -> None:
    pool = list(candidates)
    for s in out:  # a sub-multiset of the input
        pool.remove(s)
    assert [s.cur_st for s in out] == sorted(s.cur_st for s in out)
    assert disjoint(out)
    for dropped in pool:  # maximal: nothing left out would still fit
        assert not disjoint([*out, dropped]), f"{dropped} fits but was dropped"


def segment(start: int, length: int, cost: int = FetchCost.UNKNOWN, h: int = 0) -> Segment:
    return Segment(HASHES[h], 0, start, length, "local", cost=cost)


equal_length_sets = st.integers(1, 6).flatmap(
    lambda size: st.tuples(
        st.just(size),
        st.lists(
            st.builds(
                lambda start, cost, h: segment(start, size, cost, h),
                st.integers(0, 30),
                st.sampled_from(list(FetchCost)),
                st.integers(0, 3),
            ),
            max_size=9,
        ),
    )
)

mixed_length_sets = st.lists(
    st.builds(
        segment,
        st.integers(0, 30),
        st.integers(1, 8),
        st.sampled_from(list(FetchCost)),
        st.integers(0, 3),
    ),
    max_size=9,
)

# ---------------------------------------------------------------- resolve_overlaps


@settings(max_examples=300, deadline=None)
@given(equal_length_sets)
def test_leftmost_greedy_is_optimal_for_equal_lengths(case: tuple[int, list[Segment]]) -> None:
    size, candidates = case
    out = resolve_overlaps(candidates)
    check_invariants(out, candidates)
    best_tokens, best_count = best_selection(candidates)
    assert sum(s.length for s in out) == best_tokens == best_count * size


@settings(max_examples=300, deadline=None)
@given(equal_length_sets)
def test_prefer_cheaper_keeps_at_least_half_of_optimal(case: tuple[int, list[Segment]]) -> None:
    _, candidates = case
    out = resolve_overlaps(candidates, prefer_cheaper=True)
    check_invariants(out, candidates)
    _, best_count = best_selection(candidates)
    assert 2 * len(out) >= best_count


@settings(max_examples=300, deadline=None)
@given(mixed_length_sets, st.booleans())
def test_any_lengths_sorted_disjoint_maximal(candidates: list[Segment], cheaper: bool) -> None:
    check_invariants(resolve_overlaps(candidates, prefer_cheaper=cheaper), candidates)


@settings(max_examples=200, deadline=None)
@given(mixed_length_sets, st.integers(0, 3))
def test_prefer_cheaper_with_equal_costs_is_leftmost_greedy(
    candidates: list[Segment], cost: int
) -> None:
    same = [Segment(s.chunk_hash, s.old_st, s.cur_st, s.length, s.source, cost) for s in candidates]
    assert resolve_overlaps(same, prefer_cheaper=True) == resolve_overlaps(same)


@settings(max_examples=200, deadline=None)
@given(mixed_length_sets, st.booleans(), st.randoms(use_true_random=False))
def test_result_does_not_depend_on_input_order(
    candidates: list[Segment], cheaper: bool, rng: random.Random
) -> None:
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    assert resolve_overlaps(shuffled, prefer_cheaper=cheaper) == resolve_overlaps(
        candidates, prefer_cheaper=cheaper
    )


def test_earlier_start_wins_then_longer_then_cheaper_then_hash() -> None:
    a, b = segment(0, 4, FetchCost.SHARED_L2), segment(2, 4, FetchCost.LOCAL_L1)
    assert resolve_overlaps([b, a]) == [a]
    long, short = segment(5, 4), segment(5, 2)
    assert resolve_overlaps([short, long]) == [long]
    cheap, dear = segment(5, 4, FetchCost.PEER_L1, h=3), segment(5, 4, FetchCost.SHARED_L2, h=0)
    assert resolve_overlaps([dear, cheap]) == [cheap]
    assert resolve_overlaps([segment(5, 4, h=2), segment(5, 4, h=1)]) == [segment(5, 4, h=1)]


def test_prefer_cheaper_picks_cheapest_overlapping_the_leftmost() -> None:
    C = 4
    dear, cheap, after = (
        segment(0, C, FetchCost.SHARED_L2),
        segment(2, C, FetchCost.LOCAL_L1),
        segment(6, C, FetchCost.SHARED_L2),
    )
    assert resolve_overlaps([dear, cheap, after]) == [dear, segment(6, C, FetchCost.SHARED_L2)]
    assert resolve_overlaps([dear, cheap, after], prefer_cheaper=True) == [cheap, after]


def test_prefer_cheaper_half_bound_is_tight() -> None:
    C = 4
    left = segment(0, C, FetchCost.SHARED_L2)
    middle = segment(C - 1, C, FetchCost.LOCAL_L1)
    right = segment(C, C, FetchCost.SHARED_L2)
    assert resolve_overlaps([left, middle, right]) == [left, right]
    assert resolve_overlaps([left, middle, right], prefer_cheaper=True) == [middle]


def test_prefer_cheaper_fill_pass_keeps_short_segment_before_the_pick() -> None:
    trimmed = Segment(HASHES[0], 0, 20, 2, "local", FetchCost.SHARED_L2, trim=14)  # [20, 22)
    whole = segment(20, 16, FetchCost.SHARED_L2, h=1)  # [20, 36): the leftmost-greedy pick
    cheap = segment(23, 16, FetchCost.LOCAL_L1, h=2)  # [23, 39): overlaps `whole` only
    out = resolve_overlaps([trimmed, whole, cheap], prefer_cheaper=True)
    assert out == [trimmed, cheap]


def test_empty() -> None:
    assert resolve_overlaps([]) == resolve_overlaps([], prefer_cheaper=True) == []


# ---------------------------------------------------------------- filter_prefix


candidate_lists = st.lists(
    st.builds(
        Candidate,
        st.sampled_from(HASHES),
        st.integers(0, 64),
        st.integers(0, 40),
        st.sampled_from(["local", "fleet", "both"]),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(candidate_lists, st.integers(0, 45), st.integers(1, 8), st.booleans())
def test_filter_prefix(
    candidates: list[Candidate], prefix_len: int, size: int, allow_trim: bool
) -> None:
    out = filter_prefix(candidates, prefix_len, size, allow_trim)
    expected = [
        c
        for c in candidates
        if c.cur_st >= prefix_len or (allow_trim and c.cur_st + size > prefix_len)
    ]
    assert len(out) == len(expected)
    for s, c in zip(out, expected, strict=True):
        assert (s.chunk_hash, s.old_st, s.source) == (c.chunk_hash, c.old_st, c.source)
        # exactly the chunk's tokens past the prefix, sliced and shifted consistently
        assert (s.cur_st, s.end) == (max(c.cur_st, prefix_len), c.cur_st + size)
        assert s.trim == s.cur_st - c.cur_st and s.trim < size
        assert s.kv_slice == slice(s.trim, size)
        assert s.chunk_cur_st == c.cur_st and s.delta == c.cur_st - c.old_st
        assert allow_trim or s.trim == 0
    for cheaper in (False, True):
        resolved = resolve_overlaps(out, prefer_cheaper=cheaper)
        assert all(s.cur_st >= prefix_len for s in resolved)
        check_invariants(resolved, out)


def test_straddling_match_trimmed_or_dropped() -> None:
    c = Candidate(HASHES[0], 32, 10, "local")
    assert filter_prefix([c], 10, 16, allow_trim=False) == [Segment(HASHES[0], 32, 10, 16, "local")]
    assert filter_prefix([c], 12, 16, allow_trim=False) == []
    [trimmed] = filter_prefix([c], 12, 16, allow_trim=True)
    assert (trimmed.cur_st, trimmed.length, trimmed.trim, trimmed.old_st) == (12, 14, 2, 32)
    assert trimmed.delta == 10 - 32 and trimmed.kv_slice == slice(2, 16)
    assert filter_prefix([c], 26, 16, allow_trim=True) == []  # wholly inside the prefix


def test_filter_prefix_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        filter_prefix([], -1, 16, True)
    with pytest.raises(ValueError):
        filter_prefix([], 0, 0, True)


def test_segment_validation() -> None:
    with pytest.raises(ValueError):
        Segment(HASHES[0], 0, 0, 0, "local")
    with pytest.raises(ValueError):
        Segment(HASHES[0], 0, 1, 4, "local", trim=2)  # chunk would start before position 0
    with pytest.raises(ValueError):
        Segment(HASHES[0], 0, 0, 4, "peer")  # type: ignore[arg-type]
    assert Segment(HASHES[0], 0, 0, 4, "both").cost == FetchCost.UNKNOWN
    assert FetchCost.LOCAL_L1 < FetchCost.PEER_L1 < FetchCost.SHARED_L2 < FetchCost.UNKNOWN


# ---------------------------------------------------------------- merge_union


match_lists = st.lists(
    st.builds(BlendMatch, st.sampled_from(HASHES), st.integers(0, 3), st.integers(0, 5)),
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(match_lists, match_lists)
def test_union_has_everything_once(local: list[BlendMatch], fleet: list[BlendMatch]) -> None:
    out = merge_union(local, fleet)
    keys = [(c.chunk_hash, c.cur_st) for c in out]
    assert len(keys) == len(set(keys))
    local_keys = {(m.chunk_hash, m.cur_st) for m in local}
    fleet_keys = {(m.chunk_hash, m.cur_st) for m in fleet}
    assert set(keys) == local_keys | fleet_keys
    assert [(c.cur_st, c.chunk_hash) for c in out] == sorted((c.cur_st, c.chunk_hash) for c in out)
    first_local = {}
    for m in reversed(local):
        first_local[(m.chunk_hash, m.cur_st)] = m.old_st
    for c in out:
        key = (c.chunk_hash, c.cur_st)
        assert (
            c.source
            == {
                (True, True): "both",
                (True, False): "local",
                (False, True): "fleet",
            }[(key in local_keys, key in fleet_keys)]
        )
        if key in local_keys:
            assert c.old_st == first_local[key]  # the node's own index is authoritative


def test_union_of_disjoint_legs() -> None:
    a, b, c = (BlendMatch(HASHES[i], 16 * i, 5 * i) for i in range(3))
    out = merge_union([a, b], [b, c])
    assert [(x.chunk_hash, x.source) for x in out] == [
        (HASHES[0], "local"),
        (HASHES[1], "both"),
        (HASHES[2], "fleet"),
    ]
    assert merge_union([], []) == []
