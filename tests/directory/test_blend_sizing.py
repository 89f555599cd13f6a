"""The blend index's own memory stays ≤ 128 B per chunk at every size from 10,000 chunks on
(the quality target; ``BlendStats.index_bytes``, the 32-byte hashes it reads included): its
arrays grow in small steps, and the table is sized by the live contents."""

from __future__ import annotations

import numpy as np

from kvatlas.directory import BlendIndex
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
