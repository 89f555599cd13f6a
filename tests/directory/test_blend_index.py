"""Pinned behaviours of BlendIndex (blend-index.md, "Contract")."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from kvatlas.directory import (
    AddOp,
    BlendIndex,
    BlendMatch,
    RemoveChunkOp,
    RemoveClaimOp,
)
from kvatlas.keys import BlendNamespace

C = 8
NS = BlendNamespace("model-a")


def chunk(seed: int, size: int = C) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size, dtype=np.uint32)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def filler(n: int, seed: int = 99) -> np.ndarray:
    # tokens >= 60_000 never occur in chunk(): filler never forms a stored window
    return np.random.default_rng(seed).integers(60_000, 70_000, n, dtype=np.uint32)


def test_constructor_validates() -> None:
    for kwargs in ({"chunk_size": 0}, {"probe_stride": 0}, {"chunk_size": -1}):
        with pytest.raises(ValueError):
            BlendIndex(**kwargs)  # type: ignore[arg-type]
    index = BlendIndex()
    assert (index.chunk_size, index.probe_stride) == (256, 1)


def test_match_at_unaligned_offsets_reports_both_positions() -> None:
    index = BlendIndex(chunk_size=C)
    a, b = chunk(1), chunk(2)
    index.add(a, h(1), 512, NS)
    index.add(b, h(2), 0, NS)
    query = np.concatenate([filler(3), b, filler(5), a, filler(2)])
    assert index.match(query, NS) == [
        BlendMatch(h(2), 0, 3),
        BlendMatch(h(1), 512, 3 + C + 5),
    ]


def test_results_ascending_and_first_occurrence_only() -> None:
    index = BlendIndex(chunk_size=C)
    a, b = chunk(1), chunk(2)
    index.add(a, h(1), 8, NS)
    index.add(b, h(2), 16, NS)
    query = np.concatenate([b, filler(1), a, b, a, filler(4), b])
    result = index.match(query, NS)
    assert [m.cur_st for m in result] == [0, C + 1]
    assert [m.chunk_hash for m in result] == [h(2), h(1)]


def test_overlapping_matches_are_all_returned() -> None:
    index = BlendIndex(chunk_size=4)
    index.add([1, 2, 3, 4], h(1), 0, NS)
    index.add([3, 4, 5, 6], h(2), 4, NS)
    assert index.match([1, 2, 3, 4, 5, 6], NS) == [BlendMatch(h(1), 0, 0), BlendMatch(h(2), 4, 2)]


@pytest.mark.parametrize("where", [0, C // 2, C - 1])
def test_one_token_different_window_is_rejected(where: int) -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(a, h(1), 0, NS)
    near = a.copy()
    near[where] += 1
    assert index.match(np.concatenate([filler(3), near, filler(3)]), NS) == []
    assert index.match(np.concatenate([near, a]), NS) == [BlendMatch(h(1), 0, C)]


def test_add_is_idempotent_and_updates_offset() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(a, h(1), 0, NS)
    before = index.stats()
    index.add(a, h(1), 0, NS)
    assert index.stats() == before
    index.add(list(map(int, a)), h(1), 40, NS)
    assert index.stats() == before
    assert index.match(a, NS) == [BlendMatch(h(1), 40, 0)]
    assert before.contents == before.occupants == before.claims == 1


def test_same_content_under_two_hashes_survives_one_eviction() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(a, h(1), 0, NS)
    index.add(a, h(2), 256, NS)
    stats = index.stats()
    assert (stats.contents, stats.occupants) == (1, 2)
    assert sorted(index.match(a, NS), key=lambda m: m.old_st) == [
        BlendMatch(h(1), 0, 0),
        BlendMatch(h(2), 256, 0),
    ]
    index.remove_claim(a, h(1), NS)
    assert index.match(a, NS) == [BlendMatch(h(2), 256, 0)]
    index.add(a, h(1), 0, NS)
    index.remove_chunk(a, h(2))
    assert index.match(a, NS) == [BlendMatch(h(1), 0, 0)]
    index.remove_chunk(a, h(1))
    assert index.match(a, NS) == []
    assert index.stats().contents == 0


def test_stride_equal_to_chunk_matches_only_aligned_positions() -> None:
    index = BlendIndex(chunk_size=C, probe_stride=C)
    a, b = chunk(1), chunk(2)
    index.add(a, h(1), 0, NS)
    index.add(b, h(2), 0, NS)
    query = np.concatenate([filler(3), a, filler(C - 3), b])
    assert index.match(query, NS) == [BlendMatch(h(2), 0, 2 * C)]
    dense = BlendIndex(chunk_size=C, probe_stride=1)
    dense.add(a, h(1), 0, NS)
    assert dense.match(query, NS) == [BlendMatch(h(1), 0, 3)]


def test_stride_two_probes_even_positions() -> None:
    index = BlendIndex(chunk_size=4, probe_stride=2)
    index.add([1, 2, 3, 4], h(1), 0, NS)
    assert index.match([9, 1, 2, 3, 4], NS) == []
    assert index.match([9, 9, 1, 2, 3, 4], NS) == [BlendMatch(h(1), 0, 2)]


@pytest.mark.parametrize(
    "other",
    [
        BlendNamespace("model-b"),
        BlendNamespace("model-a", cache_salt="tenant-2"),
        BlendNamespace("model-a", world_size=2),
    ],
)
def test_namespace_scoping(other: BlendNamespace) -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(a, h(1), 0, NS)
    assert index.match(a, other) == []
    assert index.match(a, NS) == [BlendMatch(h(1), 0, 0)]
    index.add(a, h(1), 0, other)  # same chunk_hash, second namespace: one occupant, two claims
    stats = index.stats()
    assert (stats.occupants, stats.claims, stats.namespaces) == (1, 2, 2)
    index.remove_claim(a, h(1), NS)
    assert index.match(a, NS) == []
    assert index.match(a, other) == [BlendMatch(h(1), 0, 0)]


def test_own_chunk_found_behind_foreign_identical_content() -> None:
    index = BlendIndex(chunk_size=C)
    foreign = BlendNamespace("model-a", cache_salt="other")
    a = chunk(1)
    index.add(a, h(7), 100, foreign)  # stored first: heads the content's occupant chain
    index.add(a, h(1), 0, NS)
    index.add(a, h(8), 200, foreign)
    assert index.match(np.concatenate([filler(2), a]), NS) == [BlendMatch(h(1), 0, 2)]


def test_skipped_hash_does_not_consume_its_chance() -> None:
    """One chunk_hash on two contents: the foreign one earlier in the query must not hide
    the requester's later one."""
    index = BlendIndex(chunk_size=C)
    foreign = BlendNamespace("model-z")
    a, b = chunk(1), chunk(2)
    index.add(a, h(5), 0, foreign)
    index.add(b, h(5), 64, NS)
    assert index.match(np.concatenate([a, b]), NS) == [BlendMatch(h(5), 64, C)]


def test_query_shorter_than_chunk_is_empty() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(a, h(1), 0, NS)
    assert index.match(a[:-1], NS) == []
    assert index.match([], NS) == []


def test_wrong_length_content_is_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    index = BlendIndex(chunk_size=C)
    with caplog.at_level(logging.INFO):
        index.add(chunk(1, C - 1), h(1), 0, NS)
        index.add(chunk(1, C + 1), h(1), 0, NS)
    assert index.stats().occupants == 0
    assert "not indexing" in caplog.text
    index.remove_claim(chunk(1, C - 1), h(1), NS)  # no-op, no error
    index.remove_chunk(chunk(1, C + 1), h(1))


def test_negative_offset_is_rejected() -> None:
    index = BlendIndex(chunk_size=C)
    with pytest.raises(ValueError):
        index.add(chunk(1), h(1), -1, NS)
    assert index.stats().occupants == 0


def test_unknown_removals_are_noops() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.remove_claim(a, h(1), NS)
    index.remove_chunk(a, h(1))
    index.add(a, h(1), 0, NS)
    before = index.stats()
    index.remove_claim(a, h(2), NS)
    index.remove_claim(a, h(1), BlendNamespace("model-b"))
    index.remove_claim(chunk(2), h(1), NS)
    index.remove_chunk(chunk(2), h(1))
    index.remove_chunk(a, h(2))
    assert index.stats() == before
    assert index.match(a, NS) == [BlendMatch(h(1), 0, 0)]


def test_remove_chunk_drops_every_claim() -> None:
    index = BlendIndex(chunk_size=C)
    spaces = [BlendNamespace("model-a", cache_salt=f"t{i}") for i in range(5)]
    a = chunk(1)
    for ns in spaces:
        index.add(a, h(1), 0, ns)
    assert index.stats().claims == 5
    index.remove_chunk(a, h(1))
    stats = index.stats()
    assert (stats.contents, stats.occupants, stats.claims, stats.namespaces) == (
        0,
        0,
        0,
        0,
    )
    assert all(index.match(a, ns) == [] for ns in spaces)
    index.add(a, h(1), 0, spaces[3])  # ids are recycled cleanly
    assert index.match(a, spaces[3]) == [BlendMatch(h(1), 0, 0)]
    assert index.match(a, spaces[0]) == []


@pytest.mark.parametrize(
    "convert",
    [
        lambda a: a,
        lambda a: a.astype(np.int64),
        lambda a: [int(t) for t in a],
        lambda a: a[::-1].copy()[::-1],  # non-contiguous view
    ],
)
def test_token_input_types(convert: object) -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(convert(a), h(1), 3, NS)  # type: ignore[operator]
    query = np.concatenate([filler(2), a])
    assert index.match(convert(query), NS) == [BlendMatch(h(1), 3, 2)]  # type: ignore[operator]
    index.remove_claim(convert(a), h(1), NS)  # type: ignore[operator]
    assert index.match(query, NS) == []


def test_out_of_range_tokens_raise() -> None:
    index = BlendIndex(chunk_size=4)
    with pytest.raises(ValueError):
        index.add([1, 2, 3, -1], h(1), 0, NS)
    with pytest.raises(ValueError):
        index.match([1, 2, 3, 1 << 32], NS)


def test_caller_array_is_never_mutated_or_aliased_when_writable() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.add(a, h(1), 0, NS)
    original = a.copy()
    a[0] += 1  # caller reuses its buffer: the index kept its own copy
    assert index.match(original, NS) == [BlendMatch(h(1), 0, 0)]
    assert index.match(a, NS) == []
    assert index.stats().token_bytes_owned == C * 4


def test_read_only_array_is_shared_not_copied() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    a.setflags(write=False)
    index.add(a, h(1), 0, NS)
    stats = index.stats()
    assert (stats.token_bytes_shared, stats.token_bytes_owned) == (C * 4, 0)
    index.remove_claim(a, h(1), NS)
    assert index.stats().token_bytes == 0


def test_blend_match_is_frozen_value() -> None:
    m = BlendMatch(h(1), 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.cur_st = 3  # type: ignore[misc]
    assert m == BlendMatch(h(1), 1, 2)
    assert not hasattr(m, "__dict__")


def test_short_and_long_chunk_hashes() -> None:
    index = BlendIndex(chunk_size=C)
    a, b = chunk(1), chunk(2)
    index.add(a, b"short", 0, NS)
    index.add(b, b"x" * 32, 0, NS)
    assert [m.chunk_hash for m in index.match(np.concatenate([a, b]), NS)] == [b"short", b"x" * 32]
    with pytest.raises(ValueError):
        index.add(a, b"y" * 33, 0, NS)


def test_stats_counts_and_bytes() -> None:
    index = BlendIndex(chunk_size=C)
    other = BlendNamespace("model-b")
    for i in range(10):
        index.add(chunk(i), h(i), 0, NS)
    index.add(chunk(0), h(100), 0, NS)
    index.add(chunk(0), h(0), 0, other)
    stats = index.stats()
    assert stats.contents == 10
    assert stats.occupants == 11
    assert stats.claims == 12
    assert stats.namespaces == 2
    assert stats.token_bytes == 10 * C * 4
    assert stats.index_bytes > 0
    for key in ("table_slots", "content_capacity", "occupant_capacity"):
        assert getattr(stats, key) > 0


def test_growth_keeps_everything_findable() -> None:
    index = BlendIndex(chunk_size=4)
    rng = np.random.default_rng(5)
    contents = rng.integers(0, 1 << 32, (5000, 4), dtype=np.uint64).astype(np.uint32)
    for i, c in enumerate(contents):
        index.add(c, h(i), i, NS)
    for i in range(0, 5000, 2):  # enough removals to trigger a filter rebuild
        index.remove_chunk(contents[i], h(i))
    query = contents.reshape(-1)
    result = index.match(query, NS)
    by_hash = {m.chunk_hash: m for m in result}
    for i in range(1, 5000, 2):
        assert by_hash[h(i)].cur_st == 4 * i and by_hash[h(i)].old_st == i
    assert all(int.from_bytes(k, "big") % 2 == 1 for k in by_hash)


# ---------------------------------------------------------------- batched writes (apply)


def test_add_many_equals_repeated_add() -> None:
    other = BlendNamespace("model-b")
    items = [(chunk(i % 7), h(i % 9), 8 * i, NS if i % 3 else other) for i in range(40)]
    one, many = BlendIndex(chunk_size=C), BlendIndex(chunk_size=C)

    def counts(index: BlendIndex) -> list[int]:  # capacities may differ (batches pre-grow)
        stats = index.stats()
        return [
            getattr(stats, k)
            for k in ("contents", "occupants", "claims", "namespaces", "token_bytes")
        ]

    for item in items:
        one.add(*item)
    many.add_many(items)
    assert counts(one) == counts(many)
    query = np.concatenate([chunk(i) for i in range(7)])
    for ns in (NS, other):
        assert one.match(query, ns) == many.match(query, ns)
    removals = [(chunk(i % 7), h(i % 9), NS) for i in range(0, 40, 2)]
    for item in removals:
        one.remove_claim(*item)
    many.remove_claims(removals)
    assert counts(one) == counts(many)
    for ns in (NS, other):
        assert one.match(query, ns) == many.match(query, ns)


def test_apply_mixed_ops_in_order() -> None:
    index = BlendIndex(chunk_size=C)
    a, b = chunk(1), chunk(2)
    index.apply(
        [
            AddOp(a, h(1), 0, NS),
            RemoveChunkOp(a, h(1)),  # same batch: removed again
            AddOp(b, h(1), 16, NS),  # re-stored with new content
            RemoveClaimOp(a, h(1), NS),  # unknown by now: no-op
            AddOp(a, h(2), 24, NS),
        ]
    )
    assert index.match(np.concatenate([a, b]), NS) == [
        BlendMatch(h(2), 24, 0),
        BlendMatch(h(1), 16, C),
    ]
    stats = index.stats()
    assert (stats.contents, stats.occupants, stats.claims, stats.namespaces) == (
        2,
        2,
        2,
        1,
    )
    index.apply([])  # empty batch: nothing happens
    assert index.stats() == stats


def test_apply_rejects_subclasses_of_the_op_types() -> None:
    class Add(AddOp):
        pass

    index = BlendIndex(chunk_size=C)
    with pytest.raises(ValueError):
        index.apply([Add(chunk(1), h(1), 0, NS)])
    assert index.stats().occupants == 0


def test_apply_validates_every_op_before_changing_anything() -> None:
    index = BlendIndex(chunk_size=C)
    index.add(chunk(1), h(1), 0, NS)
    before = index.stats()
    with pytest.raises(ValueError):
        index.apply([RemoveChunkOp(chunk(1), h(1)), AddOp(chunk(2), h(2), -1, NS)])
    with pytest.raises(ValueError):
        index.apply([RemoveChunkOp(chunk(1), h(1)), ("replace", chunk(2), h(2))])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        index.apply([RemoveChunkOp(chunk(1), h(1)), AddOp(chunk(2), b"x" * 33, 0, NS)])
    assert index.stats() == before
    assert index.match(chunk(1), NS) == [BlendMatch(h(1), 0, 0)]


def test_apply_ignores_wrong_length_content_and_copies_writable_arrays() -> None:
    index = BlendIndex(chunk_size=C)
    a = chunk(1)
    index.apply([AddOp(chunk(3, C - 1), h(3), 0, NS), AddOp(a, h(1), 0, NS)])
    a[0] += 1  # the caller's writable buffer: the index kept a copy
    assert index.stats().occupants == 1
    assert index.stats().token_bytes_owned == C * 4
    assert index.match(chunk(1), NS) == [BlendMatch(h(1), 0, 0)]


def test_apply_namespace_claims_across_one_batch() -> None:
    index = BlendIndex(chunk_size=C)
    other = BlendNamespace("model-b")
    a = chunk(1)
    index.apply(
        [
            RemoveClaimOp(a, h(1), other),  # namespace unknown yet: no-op
            AddOp(a, h(1), 0, NS),
            AddOp(a, h(1), 0, other),  # second claim: the extra set
            RemoveClaimOp(a, h(1), NS),
            AddOp(a, h(1), 4, NS),
        ]
    )
    stats = index.stats()
    assert (stats.occupants, stats.claims, stats.namespaces) == (1, 2, 2)
    assert index.match(a, NS) == [BlendMatch(h(1), 4, 0)]
    index.apply([RemoveChunkOp(a, h(1)), AddOp(chunk(2), h(5), 0, other)])
    stats = index.stats()
    assert (stats.occupants, stats.claims, stats.namespaces) == (1, 1, 1)
    assert index.match(a, NS) == [] and index.match(a, other) == []


@pytest.mark.parametrize("where", [0, 63, 64, 99])
def test_near_miss_rejected_in_every_comparison_block(where: int) -> None:
    """Tokens are compared in blocks of 64: a difference in any block, including a partial
    last one (chunk_size 100), rejects the window."""
    size = 100
    index = BlendIndex(chunk_size=size)
    a = chunk(1, size)
    index.add(a, h(1), 0, NS)
    near = a.copy()
    near[where] ^= 1
    assert index.match(np.concatenate([filler(5), near, filler(5)]), NS) == []
    assert index.match(np.concatenate([near, filler(1), a]), NS) == [BlendMatch(h(1), 0, size + 1)]


def test_many_hits_in_one_query_are_all_returned_in_order() -> None:
    """More hits (and candidates) than any initial buffer size, every content claimed by
    two occupants: all are resolved, ascending, one per chunk_hash."""
    index = BlendIndex(chunk_size=C)
    contents = [chunk(1000 + i) for i in range(300)]
    for i, c in enumerate(contents):
        index.add(c, h(2 * i), 8 * i, NS)
        index.add(c, h(2 * i + 1), 8 * i + 1, NS)
    query = np.concatenate([np.concatenate([c, filler(1, seed=i)]) for i, c in enumerate(contents)])
    got = index.match(query, NS)
    assert sorted((m.cur_st, m.chunk_hash, m.old_st) for m in got) == [
        ((C + 1) * i, h(2 * i + k), 8 * i + k) for i in range(300) for k in (0, 1)
    ]
    assert [m.cur_st for m in got] == sorted(m.cur_st for m in got)


def test_scan_buffers_are_kept_between_queries() -> None:
    """Per-thread scratch is reused (fresh large arrays cost page faults on every query)."""
    index = BlendIndex(chunk_size=C)
    index.add(chunk(1), h(1), 0, NS)
    query = filler(100_000)
    index.match(query, NS)
    first = index._state.anchors._scratch.buffers
    index.match(query, NS)
    index.match(query[:5_000], NS)
    assert index._state.anchors._scratch.buffers is first
