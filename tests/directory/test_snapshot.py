"""Snapshots: atomic files, copy-on-write consistency, validation, index rebuild, cursors."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvatlas.directory import KeyDirectory, Restored, load_snapshot, save_snapshot
from kvatlas.directory.blend import BlendIndex
from kvatlas.directory.blend._cpython import BYTES_DATA_OFFSET
from kvatlas.directory.chunk_counts import PARTS, Partition
from kvatlas.directory.records import Record, record_tokens
from kvatlas.directory.snapshot import SnapshotError
from kvatlas.directory.snapshot.token_section import FillTargets
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks

NS = BlendNamespace("m")


def populated() -> tuple[KeyDirectory, Emitter]:
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 40)]))
    d.consume(em.batch("store", [entry(key(n)) for n in range(40, 60)], tier="l2", backend="fs"))
    em.seq += 2
    d.consume(em.batch("config", tier="l1", backend="", capacity_bytes=7, capacity_revision=3))
    return d, em


def state(d: KeyDirectory) -> tuple[object, ...]:
    page = d.list_keys(limit=100_000)
    return (page.items, d.emitters(), d.capacities())


def test_round_trip_restores_everything_and_rebuilds_the_index(tmp_path: Path) -> None:
    d, _ = populated()
    path = tmp_path / "s.snap"
    info = save_snapshot(d, path, stream_position="1700000000-5")
    assert info.keys == 59 and info.chunks == 59
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    got = load_snapshot(restored, path)
    assert got.stream_position == "1700000000-5" and got.keys == 59
    assert state(restored) == state(d)
    cursor = restored.gap_state("a")
    assert cursor is not None and cursor.gaps == 1
    assert [m.old_st for m in restored.blend_match(toks(7, 7, 7, 7), NS)] == [28]
    plain = KeyDirectory(CS)
    load_snapshot(plain, path)
    assert plain.blend_match(toks(7, 7, 7, 7), NS) == [] and state(plain) == state(d)
    tokens = record_tokens(captured(plain)[key(7).chunk_hash])
    assert tokens is not None and tokens.dtype == np.uint32 and not tokens.flags.writeable


def test_changes_during_a_snapshot_do_not_leak_into_it(tmp_path: Path) -> None:
    d, em = populated()
    before = state(d)
    rows: list[tuple[bytes, Record]] = []
    with d.capture() as capture:
        parts = capture.parts()
        for _ in range(128):
            rows += next(parts).records()
        # meanwhile ingestion continues: deletes, re-stores with new content, new keys
        d.consume(em.batch("delete", [entry(key(n)) for n in range(1, 60)]))
        d.consume(em.batch("store", [entry(key(n), toks(1, 1, 1, n), 0) for n in range(60, 90)]))
        d.consume(em.batch("store", [entry(key(n)) for n in range(40, 60)], tier="l2", backend="x"))
        for part in parts:
            rows += part.records()
    assert len(rows) == 59
    assert {h for h, _ in rows} == {key(n).chunk_hash for n in range(1, 60)}
    # the records too (not only which chunks) are the capture-start ones: installed, they give
    # the state before the changes (test_snapshot_cow.py covers every kind of change)
    by_part: list[Partition] = [{} for _ in range(PARTS)]
    for h, rec in rows:
        by_part[h[0]][h] = rec
    copy = KeyDirectory(CS)
    copy.install(Restored(capture.state, capture.shapes, by_part))
    assert state(copy) == before and state(d) != before


def test_snapshot_pause_is_one_partition(tmp_path: Path) -> None:
    d, _ = populated()
    info = save_snapshot(d, tmp_path / "s.snap")
    assert 0 < info.max_pause_s < info.seconds


def test_atomic_write_leaves_no_temp_and_keeps_old_file_on_failure(tmp_path: Path) -> None:
    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    good = path.read_bytes()
    save_snapshot(d, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.snap"]
    with pytest.raises(OSError):
        save_snapshot(d, tmp_path / "missing-dir" / "s.snap")
    assert path.read_bytes() == good
    with pytest.raises(RuntimeError), d.capture():
        save_snapshot(d, path)


@pytest.mark.parametrize("damage", ["magic", "truncate", "header", "arena"])
def test_corrupt_snapshots_are_rejected_and_change_nothing(tmp_path: Path, damage: str) -> None:
    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[:4] = b"XXXX"
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "header":
        raw[20:40] = bytes(20)
    else:
        raw += b"\0\0\0\0"
    path.write_bytes(bytes(raw))
    target, _ = populated()
    before = state(target)
    with pytest.raises(SnapshotError):
        load_snapshot(target, path)
    assert state(target) == before


@pytest.mark.parametrize("blend", [False, True], ids=["plain", "blend"])
def test_a_bit_flipped_anywhere_in_a_snapshot_is_refused_and_changes_nothing(
    tmp_path: Path, blend: bool
) -> None:
    """A snapshot damaged on disk (one bit flipped in its header, its columns, its token ids or
    its checksums) is refused whole: a restore never installs a directory other than the one
    saved (a third of single flips used to load: other placements, other ids, other hashes)."""
    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    good = path.read_bytes()
    for offset in range(0, len(good), 7):
        raw = bytearray(good)
        raw[offset] ^= 1 << (offset % 8)
        path.write_bytes(bytes(raw))
        target = KeyDirectory(CS, enable_blend_lookup=blend)
        with pytest.raises(SnapshotError):
            load_snapshot(target, path)
        assert state(target) == ([], {}, {}), offset


def test_a_file_cut_short_while_its_ids_are_read_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token section is read on a thread of its own while the records are built: a read
    that fails there (the file cut short after its size was checked) fails the restore,
    before anything is installed."""
    from kvatlas.directory.snapshot import token_section

    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    fill, threads = token_section.fill, []

    def cut_short(f: Any, view: memoryview, pos: int) -> None:
        threads.append(threading.current_thread())
        with open(path, "r+b") as out:
            out.truncate(pos + len(view) // 2)
        fill(f, view, pos)

    monkeypatch.setattr(token_section, "fill", cut_short)
    target, _ = populated()
    before = state(target)
    with pytest.raises(SnapshotError, match="truncated snapshot token arena"):
        load_snapshot(target, path)
    assert threads and threads[0] is not threading.main_thread()  # read on its own thread
    assert state(target) == before


def test_contents_are_filled_before_any_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contents are filled (by the reading thread, or by the reader when it waits for a
    piece nobody started) while the reader builds the partitions and the index: here the
    fill ends late, so anything that read a content before it would see zeros; and a failed
    read still waits for the fill (which writes into the contents) before the restore fails
    and drops them."""
    from kvatlas.directory.snapshot import token_section

    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    fill_piece, fills = token_section.fill_piece, []

    def late(*args: Any) -> None:
        time.sleep(0.3)
        fill_piece(*args)
        fills.append(threading.current_thread())

    monkeypatch.setattr(token_section, "fill_piece", late)
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    assert fills
    assert state(restored) == state(d)
    assert [m.old_st for m in restored.blend_match(toks(7, 7, 7, 7), NS)] == [28]

    fill, fills[:] = token_section.fill, []
    monkeypatch.setattr(token_section, "FILL_PIECE", 2)  # pieces read and filled one by one
    save_snapshot(d, path)  # (a version-6 file is read in the pieces it was written in)
    running: list[int] = []

    def counted(*args: Any) -> None:
        running.append(1)
        late(*args)
        running.pop()

    reads: list[int] = []

    def cut_short(f: Any, view: memoryview, pos: int) -> None:
        reads.append(pos)
        if len(reads) == 3:  # the file cut short in the third piece read (once)
            with open(path, "r+b") as out:
                out.truncate(pos + len(view) // 2)
        fill(f, view, pos)

    monkeypatch.setattr(token_section, "fill_piece", counted)
    monkeypatch.setattr(token_section, "fill", cut_short)
    with pytest.raises(SnapshotError, match="truncated snapshot token arena"):
        load_snapshot(KeyDirectory(CS, enable_blend_lookup=True), path)
    assert fills and not running  # pieces were filled, and none was when the restore failed


def test_the_index_reads_each_content_only_once_its_piece_is_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With blend on, the index is built while the reading thread fills the contents, a
    piece at a time: each slice of adds waits for the pieces holding its contents. Here
    pieces of 2 chunks fill slowly and the index is built in slices of 2 adds: every
    content the build's first read of a slice (its layout pass) is handed must be filled
    by then, and the build must start before the last piece is in (the overlap)."""
    from kvatlas.directory.blend import bulk, index
    from kvatlas.directory.snapshot import token_section

    d, _ = populated()
    path = tmp_path / "s.snap"
    monkeypatch.setattr(token_section, "FILL_PIECE", 2)  # (the file's pieces too)
    save_snapshot(d, path)
    monkeypatch.setattr(index, "BUILD_SLICE", 2)
    fill_piece, filled, pieces = token_section.fill_piece, set(), []
    lock = threading.Lock()

    def slow(targets: FillTargets, payloads: Any) -> None:
        time.sleep(0.02)
        fill_piece(targets, payloads)
        with lock:
            filled.update((targets.dsts - BYTES_DATA_OFFSET).tolist())
            pieces.append(len(targets.dsts))

    layout, unfilled, pending = bulk.vouched_layout, [], []

    def checked(handles: Any, *rest: Any) -> Any:
        with lock:
            unfilled.extend(h for h in handles.tolist() if h not in filled)
            pending.append(len(pieces) < -(-59 // 2))
        return layout(handles, *rest)

    monkeypatch.setattr(token_section, "fill_piece", slow)
    monkeypatch.setattr(bulk, "vouched_layout", checked)
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    assert pending and not unfilled
    assert any(pending)  # some slice was built while pieces were still being filled
    assert state(restored) == state(d)
    for n in (1, 7, 39):
        assert [m.old_st for m in restored.blend_match(toks(n, n, n, n), NS)] == [4 * n]


def test_contents_are_filled_only_once_the_ids_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each chunk's content is allocated while the ids are read on another thread, and
    filled from them once the read is in (here the read starts only when the reader waits
    for the contents: a content filled before would hold zeros). Odd lengths and every
    form, one after another in the section."""
    from kvatlas.directory.snapshot import token_section

    d, em = KeyDirectory(CS), Emitter("a")
    big = toks(1 << 16, 1, 2, 3)  # uint32 (a short chunk: the planes form does not pay)
    huge = toks((1 << 32) - 1, 7)
    d.consume(
        em.batch(
            "store",
            [entry(key(1), toks(5), 0), entry(key(2), big, 4), entry(key(3), huge, 8)],
        )
    )
    save_snapshot(d, tmp_path / "s.snap")
    waiting = threading.Event()
    fill, wait = token_section.fill, token_section.Filling.wait

    def held_fill(f: Any, view: memoryview, pos: int) -> None:
        waiting.wait(10)  # (a deadline for liveness only: the outcome does not depend on it)
        fill(f, view, pos)

    def waited(self: Any, *args: Any) -> Any:
        waiting.set()
        return wait(self, *args)

    monkeypatch.setattr(token_section, "fill", held_fill)
    monkeypatch.setattr(token_section.Filling, "wait", waited)  # the read, waited for
    restored = KeyDirectory(CS)
    load_snapshot(restored, tmp_path / "s.snap")
    a, b, c = restored.lookup([key(1), key(2), key(3)])
    assert a.content is not None and a.content.tolist() == [5]
    assert b.content is not None and b.content.tolist() == big.tolist()
    assert c.content is not None and c.content.tolist() == huge.tolist()


def test_the_index_rebuilt_from_the_readers_adds_sees_the_ids_read_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With blend on, the reader builds the records and the index adds (contents not filled
    yet) while the ids are read on another thread; here the read starts only once
    the reader waits for it, so anything that looked at a content before (the adds, the
    records, the index build) would have seen zeros: every answer must be the saved one."""
    from kvatlas.directory.snapshot import token_section

    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    waiting = threading.Event()
    fill, wait = token_section.fill, token_section.Filling.wait

    def held_fill(f: Any, view: memoryview, pos: int) -> None:
        waiting.wait(10)  # (a deadline for liveness only: the outcome does not depend on it)
        fill(f, view, pos)

    def waited(self: Any, *args: Any) -> Any:
        waiting.set()
        return wait(self, *args)

    monkeypatch.setattr(token_section, "fill", held_fill)
    monkeypatch.setattr(token_section.Filling, "wait", waited)  # the read, waited for
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    assert state(restored) == state(d)
    for n in range(1, 40):
        assert [m.old_st for m in restored.blend_match(toks(n, n, n, n), NS)] == [4 * n]
    assert restored.blend_match(toks(0, 0, 0, 0), NS) == []


def test_chunk_size_mismatch_is_refused(tmp_path: Path) -> None:
    d, _ = populated()
    save_snapshot(d, tmp_path / "s.snap")
    with pytest.raises(ValueError, match="chunk_size"):
        load_snapshot(KeyDirectory(CS * 2), tmp_path / "s.snap")


def test_a_restore_whose_index_build_fails_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restores are all or nothing: the blend index is built from the reader's adds before
    the chunks are replaced, so a build that fails (here: out of memory) leaves the directory
    with its own chunks and its own index."""
    d, _ = populated()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    target, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("b")
    target.consume(em.batch("store", [entry(key(n), toks(9, n, 9, n), 4 * n) for n in (70, 71)]))
    before = state(target)

    def fail(*args: Any) -> None:
        raise MemoryError("the index")

    monkeypatch.setattr(BlendIndex, "build", fail)
    with pytest.raises(MemoryError):
        load_snapshot(target, path)
    assert state(target) == before
    assert [m.old_st for m in target.blend_match(toks(9, 71, 9, 71), NS)] == [4 * 71]
    assert target.blend_match(toks(7, 7, 7, 7), NS) == []
