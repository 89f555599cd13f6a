"""``id_lists.tally``: each distinct id and its count, ascending, as ``np.bincount`` gives
them, on both sides of the Python/numpy cut-over (and one id alone)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory.blend.id_lists import TALLY_IN_PYTHON, tally


def brute(ids: list[int]) -> list[tuple[int, int]]:
    return sorted(Counter(ids).items())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 40), max_size=3 * TALLY_IN_PYTHON)
    | st.lists(st.sampled_from([0, 7, 300]), max_size=2 * TALLY_IN_PYTHON)
)
def test_tally_counts_each_id(ids: list[int]) -> None:
    got = tally(np.array(ids, np.int64))
    assert got == brute(ids)
    assert all(type(i) is int and type(n) is int for i, n in got)


def test_tally_at_the_cut_over_and_of_one_id() -> None:
    for n in (TALLY_IN_PYTHON - 1, TALLY_IN_PYTHON, TALLY_IN_PYTHON + 1):
        ids = np.arange(n, dtype=np.int64) % 3
        assert tally(ids) == brute(ids.tolist())
        assert tally(np.full(n, 5, np.int64)) == [(5, n)]
    assert tally(np.empty(0, np.int64)) == []
