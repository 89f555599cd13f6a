"""The capture/install protocol snapshots are built on (docs/directory.md)."""

from __future__ import annotations

import pytest

from kvatlas.directory import KeyDirectory, Restored
from kvatlas.directory.chunk_counts import PARTS, ChunkCounts, Partition
from kvatlas.errors import Conflict
from tests.directory.helpers import CS, Emitter, entry, key, toks


def populated() -> KeyDirectory:
    d, em = KeyDirectory(CS), Emitter("a")
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 30)]))
    d.consume(em.batch("store", [entry(key(n, salt="t")) for n in range(20, 40)], tier="l2"))
    d.consume(Emitter("b").batch("store", [entry(key(n)) for n in range(1, 5)], shared=True))
    return d


def restored_from(d: KeyDirectory, counts: ChunkCounts | None = None) -> Restored:
    parts: list[Partition] = [{} for _ in range(PARTS)]
    with d.capture() as capture:
        for part in capture.parts():
            for h, rec in part.records():
                parts[h[0]][h] = rec
    return Restored(capture.state, capture.shapes, parts, counts)


def test_install_of_a_capture_reproduces_the_directory() -> None:
    d = populated()
    copy = KeyDirectory(CS)
    copy.install(restored_from(d))  # counts computed by a pass over the records
    assert copy.list_keys(limit=1000).items == d.list_keys(limit=1000).items
    assert copy.emitters() == d.emitters()
    mine, theirs = copy.stats(), d.stats()
    assert (mine.keys, mine.chunks, mine.placements, mine.bytes_by_tier) == (
        theirs.keys, theirs.chunks, theirs.placements, theirs.bytes_by_tier,
    )  # fmt: skip
    assert mine.l1_placements_by_instance == theirs.l1_placements_by_instance
    assert copy.fence_instance("a") == d.fence_instance("a")  # the L1 sets came along


def test_one_capture_at_a_time_and_no_install_during_one() -> None:
    d = populated()
    restored = restored_from(d)
    with d.capture() as capture:
        with pytest.raises(Conflict):
            d.capture()
        with pytest.raises(RuntimeError):  # Conflict is a RuntimeError
            d.install(restored)
        parts = list(capture.parts())
        assert len(parts) == PARTS and all(p.lock_held_s >= 0 for p in parts)
        with pytest.raises(Conflict):
            next(capture.parts())  # partitions are taken once
    with d.capture():  # closed: a new one may start
        pass
    d.install(restored)


def test_install_refuses_another_chunk_size_and_changes_nothing() -> None:
    d = populated()
    restored = restored_from(d)
    other = KeyDirectory(CS * 2)
    with pytest.raises(ValueError, match="chunk_size"):
        other.install(restored)
    assert other.stats().keys == 0
