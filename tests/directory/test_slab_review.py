"""Review of token slabs (issue 13): references that must not keep a slab alive, and
answers that must not change while one is copied out."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from tests.directory.helpers import CS, Emitter, entry, key, toks
from tests.directory.test_snapshot_restore import BIG, NAMESPACES


@pytest.mark.parametrize("last", [8, BIG], ids=["uint16", "uint32"])
def test_a_slab_is_freed_when_chunks_share_a_content(tmp_path: Path, last: int) -> None:
    """Chunks of one content (different hashes) are one content in the blend index, kept
    as the first chunk's array: copying each chunk out must not leave the index holding a
    view that pins the whole slab."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    n = 40
    d.consume(em.batch("store", [entry(key(i), toks(7, 7, 7, last), 4 * i) for i in range(n)]))
    save_snapshot(d, tmp_path / "s.snap")
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, tmp_path / "s.snap")
    (slab,) = restored._chunks.slabs
    buffer = weakref.ref(slab.buffer)
    del slab
    restored.consume(em.batch("delete", [entry(key(i)) for i in range(n // 2 + 2)]))
    restored.consume(em.batch("access", [entry(key(n - 1))], ts=1.0))
    restored.consume(em.batch("access", [entry(key(n - 1))], ts=2.0))
    gc.collect()
    assert restored._chunks.slabs == [] and restored._chunks._reclaim is None
    assert buffer() is None, "the slab is still alive"
    want = sorted((key(i).chunk_hash, 4 * i, 1) for i in range(n // 2 + 2, n))
    got = restored.blend_match(toks(1, 7, 7, 7, last), NAMESPACES[0])
    assert sorted((m.chunk_hash, m.old_st, m.cur_st) for m in got) == want
    stats = restored.stats().blend
    assert stats is not None and stats.contents == 1 and stats.token_bytes_owned == (2 if last < 1 << 16 else 4) * CS
