"""The blend index's own memory stays ≤ 128 B per chunk at every size from 10,000 chunks on
(the quality target; ``BlendStats.index_bytes``, the 32-byte hashes it reads included): its
arrays grow in small steps, and the table is sized by the live contents."""

from __future__ import annotations

import numpy as np
import pytest

from kvatlas.directory import AddColumns, BlendIndex
from kvatlas.keys import BlendNamespace

NS = BlendNamespace("m")


def test_index_bytes_per_chunk_stay_within_128_from_10k_chunks_on() -> None:
    index = BlendIndex(chunk_size=4)
    contents = np.arange(4 * 60_000, dtype=np.uint32).reshape(-1, 4)
    contents.setflags(write=False)
    worst = 0.0
    for start in range(0, len(contents), 500):
        rows = contents[start : start + 500]
        index.add_many(
            (row, (start + i).to_bytes(4, "big") + bytes(28), 0, NS) for i, row in enumerate(rows)
        )
        stats = index.stats()
        assert stats.contents == start + len(rows)
        if stats.contents >= 10_000:
            worst = max(worst, stats.index_bytes / stats.contents)
    assert 0 < worst <= 128


def test_an_add_into_a_full_index_takes_a_free_id_without_growing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An index built to its capacity (a restore's ``build``) has room for an add wherever a
    removal left an id free: the add's room check counts free ids as ``_make_room`` does, so
    single adds there do not go through ``_make_room`` (which grows nothing) every time;
    positive control: an add past the capacity does, and grows it."""
    index = BlendIndex(chunk_size=4)
    ns = BlendNamespace("m")
    n = 2000  # (above MIN_CAPACITY: the capacity is then what the build reserved)
    contents = [np.array([i, i + 1, i + 2, i + 3], np.uint32) for i in range(0, 4 * n, 4)]
    index.build(AddColumns(contents, [i.to_bytes(32, "big") for i in range(n)], [0] * n, [ns]))
    state = index._state
    assert state.arrays.content_capacity == len(state.tokens) == n  # full
    calls: list[int] = []
    real = state._make_room
    monkeypatch.setattr(state, "_make_room", lambda *a: calls.append(1) or real(*a))
    for i in range(8):
        index.remove_claim(contents[i], i.to_bytes(32, "big"), ns)
        index.add(contents[i], i.to_bytes(32, "big"), 0, ns)
    assert calls == []
    index.add(np.array([9999, 1, 2, 3], np.uint32), b"new", 0, ns)  # no free id left
    assert calls == [1] and state.arrays.content_capacity > n
