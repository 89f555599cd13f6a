"""Anchors (``kernels/anchors.py``): a query's window minima against brute force, a content's
anchor among the minima of every window that holds it, ties (repeated k-grams) included, and
the lazily kept anchor table through removals, reused ids and rebuilds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory import BlendIndex
from kvatlas.directory.blend.kernels.anchors import (
    content_anchor,
    kgram_size,
    new_keys,
    query_kgrams,
    query_minima,
    window_minima,
)
from kvatlas.keys import BlendNamespace

NS = BlendNamespace("m", "", 1)


def _leftmost_minima(values: np.ndarray, width: int) -> list[int]:
    return sorted(
        {o + int(np.argmin(values[o : o + width])) for o in range(len(values) - width + 1)}
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=300),  # few values: ties everywhere
    st.integers(1, 40),
    st.sampled_from([0, 0xFFFFFFFC]),
)
def test_window_minima_are_each_windows_leftmost_least(
    small: list[int], width: int, offset: int
) -> None:
    values = np.array(small, np.uint32) + np.uint32(offset)  # (also at the top of the range)
    out = np.empty(len(values), np.int64)
    n = window_minima(values, len(values), width, out)
    assert out[:n].tolist() == _leftmost_minima(values, width)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 80)), min_size=1, max_size=12),
    st.integers(1, 40),
)
def test_window_minima_through_long_runs(runs: list[tuple[int, int]], width: int) -> None:
    """Runs of one k-gram (a query of one repeated token) longer and shorter than a window,
    broken by smaller and larger values: each window's least is the run's first in it."""
    values = np.concatenate([np.full(n, v, np.uint32) for v, n in runs])
    out = np.empty(len(values), np.int64)
    n = window_minima(values, len(values), width, out)
    assert out[:n].tolist() == _leftmost_minima(values, width)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(st.integers(0, 2), min_size=40, max_size=40),
    st.integers(0, 60),
    st.integers(0, 60),
    st.booleans(),
)
def test_a_contents_anchor_is_a_minimum_of_every_window_holding_it(
    chunk: int, ids: list[int], before: int, after: int, wide: bool
) -> None:
    """Content and query share the hash's secret: the window holding the content has its
    leftmost least k-gram at the content's anchor, whatever the ids around it (repeats
    included: ids from a tiny alphabet, or a run of one id)."""
    keys = new_keys()
    rng = np.random.default_rng(chunk + before)
    scale = 1 << 31 if wide else 1
    content = (np.array(ids[:chunk], np.uint64) * scale).astype(np.uint32)
    filler = rng.integers(0, 3, before + after).astype(np.uint32)
    q = np.concatenate([filler[:before], content, filler[before:]])
    k = kgram_size(chunk)
    _, offset = content_anchor(content, chunk, k, keys, np.empty(chunk, np.uint32))
    minima = np.empty(len(q), np.int64)
    kgrams = np.empty(len(q), np.uint32)
    n = query_minima(q, chunk, keys, kgrams, minima)
    assert before + int(offset) in minima[:n].tolist()
    hashes = np.empty(chunk, np.uint32)
    query_kgrams(content, k, keys, hashes)
    assert int(offset) == int(np.argmin(hashes[: chunk - k + 1]))


def test_runs_of_one_id_are_found_where_they_are() -> None:
    """A run of one id: every k-gram ties, every window's least is its first."""
    index = BlendIndex(chunk_size=16)
    run = np.full(16, 7, np.uint32)
    index.add(run, b"run", 3, NS)
    q = np.concatenate([np.arange(100, 150, dtype=np.uint32), np.full(40, 7, np.uint32)])
    assert [(m.old_st, m.cur_st) for m in index.match(q, NS)] == [(3, 50)]


def _brute(stored: dict[bytes, np.ndarray], q: np.ndarray, chunk: int) -> dict[bytes, int]:
    found: dict[bytes, int] = {}
    for o in range(len(q) - chunk + 1):
        for h, c in stored.items():
            if h not in found and np.array_equal(q[o : o + chunk], c):
                found[h] = o
    return found


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_adds_and_removes_between_lookups_match_brute_force(data: st.DataObject) -> None:
    """Writes between lookups only note their contents; each lookup anchors them first.
    Removed contents leave slots behind, their ids are reused by others, the table is
    rebuilt as it fills: every lookup equals a brute-force search of the live contents."""
    chunk = data.draw(st.sampled_from([2, 5, 8]))
    alphabet = data.draw(st.integers(2, 6))
    pool = [
        np.array(data.draw(st.lists(st.integers(0, alphabet), min_size=chunk, max_size=chunk)),
                 np.uint32)
        for _ in range(12)
    ]  # fmt: skip
    index = BlendIndex(chunk_size=chunk)
    stored: dict[bytes, np.ndarray] = {}
    for _ in range(data.draw(st.integers(1, 60))):
        i = data.draw(st.integers(0, len(pool) - 1))
        h = bytes([i])
        if data.draw(st.booleans()) and h in stored:
            index.remove_claim(stored.pop(h), h, NS)
        elif h not in stored:
            index.add(pool[i], h, 0, NS)
            stored[h] = pool[i]
        if data.draw(st.booleans()):
            q = np.concatenate([pool[j] for j in data.draw(st.lists(st.integers(0, 11)))]
                               or [np.zeros(0, np.uint32)]).astype(np.uint32)  # fmt: skip
            got = {m.chunk_hash: m.cur_st for m in index.match(q, NS)}
            assert got == _brute(stored, q, chunk)


def test_an_index_that_is_only_written_keeps_no_list_of_its_contents() -> None:
    """Without lookups the notes would grow with every content made (a coordinator that
    only ingests): past what the table takes without a rebuild they are dropped, the next
    lookup anchoring every live content instead."""
    from kvatlas.directory import AddColumns

    index = BlendIndex(chunk_size=4)
    rows = np.arange(4 * 20_000, dtype=np.uint32).reshape(-1, 4)
    rows.setflags(write=False)
    for i in range(2_000):  # single writes
        index.add(rows[i], i.to_bytes(32, "big"), 0, NS)
    for start in range(2_000, 20_000, 500):  # batches
        index.apply([AddColumns(list(rows[start : start + 500]),
                                [i.to_bytes(32, "big") for i in range(start, start + 500)],
                                [0] * 500, [NS])])  # fmt: skip
    anchors = index._state.anchors
    kept = sum(map(len, anchors._noted)) + len(anchors._noted_one)
    assert kept <= anchors.slots.shape[0]  # (64 slots: nothing was ever anchored)
    q = np.concatenate([rows[7], rows[19_999]])
    assert [m.cur_st for m in index.match(q, NS)] == [0, 4]
