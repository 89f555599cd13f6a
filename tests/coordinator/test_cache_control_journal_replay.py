"""The cache-control journal (:mod:`kvatlas.coordinator.cache_control.journal`) against an
oracle: whatever the changes, however snapshots fall among them and wherever the process dies,
the last snapshot plus the journal replayed equals the state that was acknowledged — with
snapshots taken concurrently with changes (the rotation must come before the state is read),
a last record cut by the crash, a damaged record, and a disk that refuses a write (the change
is refused, not applied unrecorded)."""

from __future__ import annotations

import logging
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.api.cache_control import TokenFields
from kvatlas.coordinator.cache_control import CacheControl
from kvatlas.coordinator.cache_control.commands import restored_commands
from kvatlas.coordinator.cache_control.journal import Journal, PinCounts, _decode
from kvatlas.coordinator.cache_control.service import wire_key
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.errors import Unavailable

C = 16


def control() -> CacheControl:
    return CacheControl(C, is_instance={"a"}.__contains__, usage_by_salt=dict)


def tokens(doc: int, chunks: int) -> list[int]:
    return [doc * 1000 + i for i in range(chunks * C)]


def fields(doc: int, chunks: int, salt: str = "") -> TokenFields:
    return TokenFields(model_name="m", world_size=1, token_ids=tokens(doc, chunks), cache_salt=salt)


def state(c: CacheControl) -> Any:
    """Everything the journal must carry, every command as a restart resumes it."""
    commands = sorted(restored_commands(c.commands.to_snapshot()), key=lambda x: x.command_id)
    return (c.pins.rows(), c.quotas.default_limit_gb, c.quotas.limits(), commands)


class Coordinator:
    """A coordinator's cache control and snapshots (:class:`CoordinatorService`, not started):
    restored from the snapshot and the journal beside it, as at a start."""

    def __init__(self, path: Path) -> None:
        self.service = CoordinatorService(CoordinatorConfig(chunk_size=C, snapshot_path=str(path)))
        self.service.snapshots.restore()
        self.control = self.service.cache_control
        journal = self.service.snapshots.journal
        assert journal is not None
        self.journal = journal

    def snapshot(self) -> None:
        assert self.service.take_snapshot() is not None

    def crash(self) -> None:
        self.journal.close()  # the fd goes with the process; nothing else is written


OPS = st.lists(
    st.tuples(
        st.sampled_from(["pin", "unpin", "quota", "unquota", "default", "delete", "fail",
                         "send", "finish", "snapshot"]),
        st.integers(0, 5),
        st.integers(1, 3),
    ),
    max_size=40,
)  # fmt: skip


def run(c: Coordinator, op: str, doc: int, n: int) -> None:
    control = c.control
    salt = "t" if doc % 2 else ""
    if op == "pin":
        control.pin(fields(doc, n, salt))
    elif op == "unpin":
        control.unpin(fields(doc, n, salt))
    elif op == "quota":
        control.quotas.set(salt, doc * 0.5)
    elif op == "unquota":
        control.quotas.remove(salt)
    elif op == "default":
        control.quotas.set_default(None if doc == 0 else float(doc))
    elif op == "delete":
        keys = control.resolve(fields(doc, n, salt)).keys
        control.commands.new("delete", ["a"], [wire_key(k) for k in keys], force=True)
    elif op == "snapshot":
        c.snapshot()
    else:
        unfinished = control.commands.unfinished()
        if unfinished:
            target = unfinished[doc % len(unfinished)].command_id
            if op == "fail":
                control.commands.delivery_failed(target, f"refused {doc}")
            elif op == "send":
                control.commands.delivered(target)
            else:
                control.commands.finish(target, "completed")


@settings(max_examples=60, deadline=None)
@given(OPS, OPS, st.booleans())
def test_the_snapshot_and_the_journal_give_back_what_was_acknowledged(
    tmp_path_factory: pytest.TempPathFactory,
    first: list[tuple[str, int, int]],
    second: list[tuple[str, int, int]],
    cut: bool,
) -> None:
    path = tmp_path_factory.mktemp("j") / "snap"
    live = Coordinator(path)
    for step in first:
        run(live, *step)
    expected = state(live.control)
    live.crash()
    if cut:  # a record whose write the kill cut: never acknowledged, ignored
        with open(live.journal.path(live.journal.generation), "ab") as f:
            f.write(b"\x40\x00\x00\x00\x01\x02")
    again = Coordinator(path)
    assert state(again.control) == expected
    for step in second:  # the restarted one journals on, and dies again
        run(again, *step)
    expected = state(again.control)
    again.crash()
    third = Coordinator(path)
    assert state(third.control) == expected
    third.snapshot()  # one generation per start until a snapshot holds them
    assert third.journal.generations() == [third.journal.generation]
    third.crash()
    assert state(Coordinator(path).control) == expected


def test_snapshots_taken_while_changes_go_on_lose_none(tmp_path: Path) -> None:
    """Pins and unpins from four threads while snapshots are taken in a loop: the state read
    after the rotation, so a change is in the older generation (and applied before the read)
    or in the newer one (replayed). Reading first, then rotating, loses changes here."""
    live = Coordinator(tmp_path / "snap")
    stop = threading.Event()

    def changes(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            doc, n = rng.randrange(8), rng.randrange(1, 4)
            (live.control.pin if rng.random() < 0.6 else live.control.unpin)(fields(doc, n))

    def snapshots() -> None:
        while not stop.is_set():
            live.snapshot()

    taker = threading.Thread(target=snapshots)
    taker.start()
    workers = [threading.Thread(target=changes, args=(s,)) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    taker.join()
    expected = live.control.pins.rows()
    assert expected  # the run pinned something
    live.crash()
    assert Coordinator(tmp_path / "snap").control.pins.rows() == expected


def test_a_change_made_as_the_journal_rotates_is_in_the_snapshot(tmp_path: Path) -> None:
    """Deterministic: a pin made at the last moment before the rotation (in the older
    generation, which the snapshot's write removes) must be in the snapshot, so the snapshot
    must read the state after the rotation. Reading it first, then rotating, loses the pin
    (checked by swapping the two in ``Snapshots.take``)."""
    live = Coordinator(tmp_path / "snap")
    rotate = live.journal.rotate

    def pin_then_rotate() -> int:
        live.control.pin(fields(7, 2))
        return rotate()

    live.journal.rotate = pin_then_rotate  # type: ignore[method-assign]
    live.snapshot()
    expected = state(live.control)
    assert len(expected[0]) == 2
    live.crash()
    assert state(Coordinator(tmp_path / "snap").control) == expected


def test_journal_files_older_than_a_snapshot_written_without_a_journal_are_not_replayed(
    tmp_path: Path,
) -> None:
    """A snapshot written on the Redis transport (no journal: generation -1) beside journal
    files an earlier HTTP run left: its state is the newer, so none of them is replayed over
    it (they were, as generation 0 meant every file: a pin Redis no longer had came back, a
    stale quota removal deleted one)."""
    from kvatlas.coordinator.cache_control import SECTION, encode_state
    from kvatlas.directory import KeyDirectory
    from kvatlas.directory.snapshot import save_snapshot

    path = tmp_path / "snap"
    live = Coordinator(path)
    live.control.pin(fields(1, 1))  # in the journal only
    live.crash()
    redis_era = control()
    redis_era.quotas.set("t", 3.0)
    section = encode_state(redis_era, -1)
    save_snapshot(KeyDirectory(C), path, sections={SECTION: section})
    again = Coordinator(path)
    assert state(again.control) == state(redis_era)
    again.snapshot()  # the stale files go with the first snapshot
    assert again.journal.generations() == [again.journal.generation]


def test_a_journal_that_cannot_open_its_next_file_leaks_nothing_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the shutdown's close, a change opens the next generation; a directory that
    cannot be synced refuses it naming that file, and closes what it opened (each refusal
    leaked a descriptor)."""
    from kvatlas.coordinator.cache_control import journal as journal_module

    live = Coordinator(tmp_path / "snap")
    live.journal.close()

    def eio(_path: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_module, "fsync_directory", eio)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(Unavailable) as refused:
            live.control.pin(fields(1, 1))
    assert str(live.journal.path(live.journal.generation + 1)) in str(refused.value)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert live.control.pins.rows() == []


def test_a_refused_record_that_cannot_be_cut_off_seals_the_file_until_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fdatasync fails after the whole frame was written, and the file cannot be cut back:
    the refused record is whole in it. Every change is refused until a snapshot starts a new
    generation (which removes the sealed file): a restart then holds only what was
    acknowledged."""
    live = Coordinator(tmp_path / "snap")
    live.control.pin(fields(1, 1))

    def fails(*_args: object) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as broken:
        broken.setattr(os, "fdatasync", fails)
        broken.setattr(os, "ftruncate", fails)
        with pytest.raises(Unavailable):
            live.control.pin(fields(2, 1))  # refused, but whole in the file
    with pytest.raises(Unavailable, match="sealed"):
        live.control.pin(fields(3, 1))  # the disk is back: still refused until a snapshot
    live.snapshot()
    live.control.pin(fields(4, 1))
    expected = state(live.control)
    assert len(expected[0]) == 2  # documents 1 and 4
    live.crash()
    assert state(Coordinator(tmp_path / "snap").control) == expected


def test_a_journal_file_that_cannot_be_removed_does_not_stop_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    live = Coordinator(tmp_path / "snap")

    def refuse(_generation: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(live.journal, "forget_before", refuse)
    live.control.pin(fields(1, 1))
    before = live.journal.generations()
    with caplog.at_level(logging.WARNING):
        live.snapshot()  # written; the old file left, and said
        live.snapshot()
    assert set(before) <= set(live.journal.generations())  # left for a later snapshot
    assert "older generations not removed" in caplog.text


def test_a_damaged_record_ends_its_files_replay_and_is_counted(tmp_path: Path) -> None:
    live = Coordinator(tmp_path / "snap")
    for doc in range(3):
        live.control.pin(fields(doc, 1))
    live.crash()
    journal = live.journal.path(live.journal.generation)
    data = bytearray(journal.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the second of three records
    journal.write_bytes(bytes(data))
    again = control()
    replayed = Journal(tmp_path / "snap").replay(again, 0)
    assert (replayed.records, replayed.damaged) == (1, 1)
    assert len(again.pins.rows()) == 1


def test_a_write_the_disk_refuses_refuses_the_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No change is applied that the journal does not hold (a 503 for the route), and each
    refusal is logged and counted; what the failed write left is cut off the file, so the next
    change, the disk back, is appended to the same generation (not a new file per refusal),
    and a restart holds exactly the changes acknowledged."""
    live = Coordinator(tmp_path / "snap")
    live.control.pin(fields(1, 1))
    before, files = state(live.control), live.journal.generations()
    failures = live.service.metrics.journal_failures.labels("write")
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        real_write(fd, data[:5])  # a frame cut short, as a full disk leaves it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(Unavailable) as refused:
        live.control.pin(fields(2, 1))
    assert refused.value.status == 503 and "No space left" in str(refused.value)
    with pytest.raises(Unavailable):
        live.control.quotas.set("t", 1.0)
    assert state(live.control) == before
    assert failures._value.get() == 2  # type: ignore[attr-defined]
    assert [r.levelname for r in caplog.records if "No space left" in r.getMessage()] == [
        "ERROR"
    ] * 2
    monkeypatch.setattr(os, "write", real_write)
    live.control.pin(fields(3, 1))
    assert live.journal.generations() == files
    expected = state(live.control)
    live.crash()
    assert state(Coordinator(tmp_path / "snap").control) == expected


def test_journal_files_without_their_snapshot_are_replayed_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The snapshot gone (deleted, or moved aside as unreadable) and its journal files kept:
    what they hold is replayed, and the state before them — in the snapshot — is reported
    missing (logged, counted), not passed off as the whole of it."""
    live = Coordinator(tmp_path / "snap")
    live.control.pin(fields(1, 1))
    live.snapshot()
    live.control.pin(fields(2, 1))
    live.crash()
    (tmp_path / "snap").unlink()
    again = Coordinator(tmp_path / "snap")
    assert len(again.control.pins.rows()) == 1  # the pin after the snapshot only
    orphaned = again.service.metrics.journal_failures.labels("orphaned")
    assert orphaned._value.get() == 1  # type: ignore[attr-defined]
    assert any(
        r.levelname == "WARNING" and "not restored" in r.getMessage() for r in caplog.records
    ), caplog.text


def test_a_record_is_absolute_so_replaying_one_the_snapshot_holds_changes_nothing(
    tmp_path: Path,
) -> None:
    """Records are counts, not increments: a change in both the snapshot and the journal (it
    landed between the rotation and the read) is not applied twice."""
    live = Coordinator(tmp_path / "snap")
    live.control.pin(fields(1, 2))
    live.control.pin(fields(1, 1))
    written = live.journal.path(live.journal.generation).read_bytes()
    frames, records = written, []
    while frames:
        length = int.from_bytes(frames[:4], "little")
        records.append(_decode(frames[8 : 8 + length]))
        frames = frames[8 + length :]
    assert [type(r) for r in records] == [PinCounts, PinCounts]
    assert [[n for _k, n in r.rows] for r in records] == [[1, 1], [2]]  # type: ignore[union-attr]
    live.snapshot()  # holds counts 2 and 1; the journal's new generation is empty
    with open(live.journal.path(live.journal.generation), "ab") as f:
        f.write(written)  # the same changes again, after the snapshot
    live.crash()
    assert [n for _k, n in Coordinator(tmp_path / "snap").control.pins.rows()] == [2, 1]
