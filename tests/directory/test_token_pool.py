"""The token pool (``directory/token_pool.py``): new chunks' contents as read-only views of
shared slabs, against the array-per-content path, and freed with their chunks."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory
from kvatlas.directory.blend._cpython import ARRAY_DATA_OFFSET, array_handles
from kvatlas.directory.records import record_stored_tokens
from kvatlas.directory.token_pool import TokenPool
from kvatlas.directory.token_store import COMPACT_LIMIT, TokenSlab, arena_rows, stored_one
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank
from tests.directory.helpers import CS, Emitter, captured, entry

BIG = [COMPACT_LIMIT - 1, COMPACT_LIMIT, (1 << 32) - 1]
ids = st.one_of(st.integers(0, COMPACT_LIMIT - 1), st.sampled_from(BIG))
batches = st.lists(st.lists(st.lists(ids, max_size=9), max_size=8), min_size=1, max_size=6)


def check_view(stored: Any, values: list[int], pool: TokenPool) -> None:
    """The ids of the array-per-content path, at its width; a read-only view of one of the
    pool's slabs that nobody can make writable."""
    want = stored_one(np.array(values, dtype=np.uint32))
    assert stored.dtype == want.dtype and stored.tolist() == values
    assert stored.flags.c_contiguous and not stored.flags.writeable
    assert any(stored.base is slab.buffer for slab in pool.slabs)
    with pytest.raises(ValueError):
        stored.flags.writeable = True


@settings(max_examples=150, deadline=None)
@given(batches, st.sampled_from([16, 40, 4096]), st.booleans())
def test_rows_are_the_ids_the_reference_path_stores(
    rows_of: list[list[list[int]]], slab_bytes: int, arena: bool
) -> None:
    """Batch after batch into small slabs (rows straddle slab ends, batches outgrow a slab):
    every row equals :func:`stored_one` of its ids, and no later batch changes an earlier
    row. Rows read from an arena (``src_off`` -1) and from arrays (``ARRAY_DATA_OFFSET``)."""
    pool = TokenPool([], slab_bytes)
    kept: list[tuple[Any, list[int]]] = []
    for rows in rows_of:
        arrays = [np.array(r, dtype=np.uint32) for r in rows]
        lens = np.array([len(r) for r in rows], np.int64)
        if arena:
            flat = np.concatenate([np.zeros(0, np.uint32), *arrays])
            out = pool.rows(arena_rows(flat, np.cumsum(lens) - lens), -1, lens)
        else:
            handles = np.array(array_handles(arrays), np.int64)
            out = pool.rows(handles, ARRAY_DATA_OFFSET, lens)
        assert len(out) == len(rows)
        for stored, r in zip(out, rows, strict=True):
            if r:
                kept.append((stored, r))
            else:
                assert stored is None
    for stored, r in kept:
        check_view(stored, r, pool)
    assert sum(slab.live() for slab in pool.slabs) == len(kept) == sum(s.views for s in pool.slabs)


def test_pool_slabs_are_seen_by_tracemalloc() -> None:
    """Memory measurements (``bench directory``) see the slabs, not only numpy's arrays."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        slab = TokenSlab.pooled(1 << 20)
        assert tracemalloc.get_traced_memory()[0] - before >= 1 << 20
        del slab
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - before < 1 << 16
    finally:
        tracemalloc.stop()


def wide_key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(4, "big") * 8, "m", pack_kv_rank(1, 0, 1, 0))


def content(i: int) -> np.ndarray[Any, Any]:
    return np.array([i, i + 1, i + 2, BIG[i % 3]], dtype=np.uint32)


def test_slabs_of_dead_chunks_are_freed_and_the_rest_still_answers() -> None:
    """Store many chunks into small slabs, remove most: every slab but the one being filled
    is freed (its live contents copied out first), and lookups and blend matches of the
    chunks left are what they were."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    d._chunks.pool.slab_bytes = 64  # 4 contents of 4 ids a slab at most
    n = 120
    for lo in range(0, n, 10):
        d.consume(
            em.batch("store", [entry(wide_key(i), content(i), 4 * i) for i in range(lo, lo + 10)])
        )
    slabs = d._chunks.slabs
    assert len(slabs) > 10 and all(
        any(record_stored_tokens(rec).base is s.buffer for s in slabs)  # type: ignore[union-attr]
        for rec in captured(d).values()
    )
    buffers = [weakref.ref(s.buffer) for s in slabs]
    del slabs
    survivors = [i for i in range(n) if i % 7 == 0]
    d.consume(em.batch("delete", [entry(wide_key(i)) for i in range(n) if i % 7]))
    for ts in range(1, 20):  # any change is a reclaim step
        d.consume(em.batch("access", [entry(wide_key(0))], ts=float(ts)))
    gc.collect()
    filling = d._chunks.pool.slab
    assert [s for s in d._chunks.slabs if s is not filling] == []
    alive = [b for b in buffers if b() is not None]
    assert alive in ([], [weakref.ref(filling.buffer)] if filling is not None else [])
    namespace = BlendNamespace("m")
    for i in survivors:
        (kp,) = d.lookup([wide_key(i)])
        assert kp.content is not None and kp.content.tolist() == content(i).tolist()
        query = np.concatenate([np.array([7], np.uint32), content(i)])
        got = [(m.chunk_hash, m.old_st, m.cur_st) for m in d.blend_match(query, namespace)]
        assert (wide_key(i).chunk_hash, 4 * i, 1) in got
    for i in range(n):
        if i % 7:
            query = np.concatenate([np.array([7], np.uint32), content(i)])
            got = [m.chunk_hash for m in d.blend_match(query, namespace)]
            assert wide_key(i).chunk_hash not in got
