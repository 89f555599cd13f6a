"""Freeing token slabs (issue 13): references that must not keep a slab alive, and
answers that must not change while one is copied out."""

from __future__ import annotations

import gc
import itertools
import weakref
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.records import record_offset, record_stored_tokens, record_tokens
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks
from tests.directory.test_snapshot_restore import (
    BIG,
    NAMESPACES,
    apply,
    assert_same_answers,
    ops,
    slab_directory,
    view,
)


def restored_of(d: KeyDirectory, tmp: Path) -> tuple[KeyDirectory, weakref.ref[Any]]:
    """``d`` saved and restored (blend on), and a weak reference to its one slab's buffer
    (a strong one would count as a live view)."""
    save_snapshot(d, tmp / "s.snap")
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, tmp / "s.snap")
    (slab,) = restored._chunks.slabs
    return restored, weakref.ref(slab.buffer)


@pytest.mark.parametrize("last", [8, BIG, (1 << 32) - 1], ids=["uint16", "planes", "uint32"])
def test_a_slab_is_freed_when_chunks_share_a_content(tmp_path: Path, last: int) -> None:
    """Chunks of one content (different hashes) are one content in the blend index, kept
    as the first chunk's array: copying each chunk out must not leave the index holding a
    view that pins the whole slab."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    n = 40
    d.consume(em.batch("store", [entry(key(i), toks(7, 7, 7, last), 4 * i) for i in range(n)]))
    restored, buffer = restored_of(d, tmp_path)
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
    assert (
        stats is not None
        and stats.contents == 1
        and stats.token_bytes_owned == {8: 2 * CS, BIG: 12, (1 << 32) - 1: 4 * CS}[last]
    )  # 12: the planes form of 4 ids with one high bit (2 + 2·4 + 2)


def contents_of(records: dict[bytes, Any]) -> dict[bytes, tuple[int, list[int] | None]]:
    return {
        h: (record_offset(rec), None if (t := record_tokens(rec)) is None else t.tolist())
        for h, rec in records.items()
    }


def test_a_copy_out_during_a_capture_leaves_the_capture_as_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvatlas.directory.chunk_slabs._RECLAIM_WORK", 64)  # 4 copies a step
    d, em = slab_directory(tmp_path, True)
    d.consume(em.batch("delete", [entry(key(i)) for i in range(1, 23)]))
    d.consume(em.batch("access", [entry(key(39))], ts=0.5))  # copying starts
    assert d._chunks._reclaim is not None
    before = contents_of(captured(d))
    with d.capture() as capture:
        parts = capture.parts()
        got = dict(next(parts).records)  # partition 0 taken; the rest not yet
        for ts in range(1, 40):  # each change a step: the rest is copied out
            d.consume(em.batch("access", [entry(key(39))], ts=float(ts)))
        assert d._chunks._reclaim is None
        for part in parts:
            got.update(part.records)
    assert contents_of(got) == before == contents_of(captured(d))
    gc.collect()
    assert d._chunks.slabs == [] and all(
        (t := record_stored_tokens(rec)) is None or t.flags.owndata for rec in captured(d).values()
    )


def test_installing_twice_frees_the_first_slab(tmp_path: Path) -> None:
    d, em = slab_directory(tmp_path, True)
    (first,) = d._chunks.slabs
    buffer = weakref.ref(first.buffer)
    del first
    load_snapshot(d, tmp_path / "s.snap")
    gc.collect()
    assert buffer() is None and len(d._chunks.slabs) == 1
    d.consume(em.batch("delete", [entry(key(i)) for i in range(30)]))
    d.consume(em.batch("access", [entry(key(39))], ts=1.0))
    assert d._chunks.slabs == []
    for i in range(30, 40):
        (m,) = d.blend_match(toks(i, i, i, BIG), NAMESPACES[0])
        assert (m.chunk_hash, m.old_st) == (key(i).chunk_hash, 4 * i)


@pytest.mark.parametrize("blend", [True, False], ids=["blend", "plain"])
def test_a_slab_is_freed_by_the_change_that_kills_it(tmp_path: Path, blend: bool) -> None:
    """Not at some later change: the last one may be the last for a long time (a fenced
    fleet, a quiet stream)."""
    d, em = slab_directory(tmp_path, blend)
    (slab,) = d._chunks.slabs
    buffer = weakref.ref(slab.buffer)
    del slab
    d.consume(em.batch("delete", [entry(key(i)) for i in range(40)]))
    gc.collect()
    assert d._chunks.slabs == [] and buffer() is None


BASE = range(20, 60)  # restored chunks beside the random ones, some of one content


def base_content(i: int) -> list[int]:
    return [i % 5, 3, 3, BIG if i % 2 else 8]  # four chunks per content


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(before=ops, after=ops)
def test_answers_hold_while_a_slab_is_copied_out_a_content_at_a_time(
    tmp_path_factory: pytest.TempPathFactory, before: list[Any], after: list[Any]
) -> None:
    """Copying out one content per change (the smallest step), interleaved with stores,
    rebinds, deletes and fencing: the restored directory answers as the saved one does,
    and the slab is freed in the end."""
    tmp = tmp_path_factory.mktemp("slabs")
    d = KeyDirectory(CS, enable_blend_lookup=True)
    emitters = {"a": Emitter("a"), "b": Emitter("b")}
    apply([d], emitters, [("store", "b", ("l2", False), [(i, ("m", ""), base_content(i), 4 * i)
                                                         for i in BASE])])  # fmt: skip
    apply([d], emitters, before)
    restored, buffer = restored_of(d, tmp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvatlas.directory.chunk_slabs._RECLAIM_WORK", 17)  # one copy a step
        doomed = iter(BASE)
        for batch in [*after, *[("delete", "b", ("l2", False), [])] * 30]:
            gone = [(i, ("m", ""), None, -1) for i in itertools.islice(doomed, 3)]
            apply([d, restored], emitters, [batch, ("delete", "b", ("l2", False), gone)])
            assert view(restored) == view(d)
            assert_same_answers(restored, d)
        dropped = d.fence_instance("a")
        assert restored.fence_instance("a") == dropped
        assert view(restored) == view(d)
        assert_same_answers(restored, d)
    gc.collect()
    assert restored._chunks.slabs == [] and buffer() is None
