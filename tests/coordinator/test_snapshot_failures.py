"""A snapshot that fails, whatever the reason, is counted and the next one is taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.coordinator import snapshots
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.errors import InvalidInput


def test_a_failed_snapshot_is_counted_and_the_next_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only ``OSError`` was caught: an ``OverflowError`` from encoding a counter past 2^64
    ended the snapshot thread for good, with ``kvatlas_snapshot_failures`` still 0."""
    service = CoordinatorService(CoordinatorConfig(chunk_size=16, snapshot_path=tmp_path / "s"))
    real = snapshots.save_snapshot

    def overflowing(*args: object, **kwargs: object) -> object:
        raise OverflowError("can't serialize ints > 2**64 - 1")

    monkeypatch.setattr(snapshots, "save_snapshot", overflowing)
    assert service.snapshots.take() is None
    assert service.metrics.snapshot_failures._value.get() == 1
    monkeypatch.setattr(snapshots, "save_snapshot", real)
    assert service.snapshots.take() is not None
    assert service.metrics.snapshot_failures._value.get() == 1


def test_a_snapshot_that_cannot_be_read_is_kept_aside_not_overwritten(tmp_path: Path) -> None:
    """A snapshot a restart cannot read (truncated, garbage, a newer release's) was logged
    and then overwritten by the next snapshot, an empty one: what it held was lost for good,
    a rollback's too. It is moved aside (``<name>.unreadable-<time>``), counted as a snapshot
    failure, and the coordinator starts empty."""
    path = tmp_path / "dir.snap"
    path.write_bytes(b"KVAS\x09" + b"\x00" * 100)  # not a snapshot this release reads
    service = CoordinatorService(CoordinatorConfig(chunk_size=16, snapshot_path=path))
    assert service.snapshots.restore() is None
    aside = list(tmp_path.glob("dir.snap.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == b"KVAS\x09" + b"\x00" * 100
    assert service.metrics.snapshot_failures._value.get() == 1
    assert not path.exists()
    assert service.snapshots.take() is not None and path.exists()  # the next one is written
    assert aside[0].exists()


def test_a_snapshot_of_another_key_scheme_is_refused(tmp_path: Path) -> None:
    """A snapshot written under ``--hash-scheme blake3`` restored into a ``blake3-x1``
    coordinator without a word: keys no lookup of the new scheme can reach. It is refused
    at start, naming both schemes, as a chunk size that differs is; a snapshot written before
    the scheme was recorded restores as before."""
    path = tmp_path / "dir.snap"
    old = CoordinatorService(CoordinatorConfig(chunk_size=16, snapshot_path=path))
    assert old.snapshots.take() is not None
    other = CoordinatorService(
        CoordinatorConfig(chunk_size=16, snapshot_path=path, hash_scheme="blake3-x1")
    )
    with pytest.raises(InvalidInput, match=r"blake3, not blake3-x1"):
        other.snapshots.restore()
    same = CoordinatorService(CoordinatorConfig(chunk_size=16, snapshot_path=path))
    assert same.snapshots.restore() is not None


@pytest.mark.parametrize("snapshot", [True, False])
def test_temp_files_left_by_a_killed_writer_are_removed_at_start(
    tmp_path: Path, snapshot: bool
) -> None:
    """A coordinator killed while writing a snapshot leaves ``.<name>.tmp-<pid>-<ns>`` beside it
    (up to a snapshot's size, every tenant's token ids): none was ever removed, so a crash loop
    during snapshots filled the disk. At start the coordinator removes its snapshot's temp files
    whose process is gone (this process's pid included: a restart may be given its
    predecessor's); a live process's and other files stay. (``snapshot``: with a snapshot
    beside them to restore, or none yet.)"""
    import os
    import subprocess

    path = tmp_path / "dir.snap"
    if snapshot:
        CoordinatorService(CoordinatorConfig(chunk_size=16, snapshot_path=path)).snapshots.take()
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = [
        tmp_path / f".dir.snap.tmp-{gone.pid}-12345",
        tmp_path / f".dir.snap.tmp-{os.getpid()}-7",
    ]
    kept = [tmp_path / ".dir.snap.tmp-1-99",  # pid 1 runs: not a leftover
            tmp_path / ".dir.snap.tmpx", tmp_path / ".other.snap.tmp-5-5", tmp_path / "dir.snap.tmp-5-5"]  # fmt: skip
    for p in [*left, *kept]:
        p.write_bytes(b"x" * 1000)
    service = CoordinatorService(CoordinatorConfig(chunk_size=16, snapshot_path=path))
    assert (service.snapshots.restore() is not None) == snapshot
    assert [p.exists() for p in left] == [False, False]
    assert [p.exists() for p in kept] == [True] * len(kept)


def test_a_directory_as_the_snapshot_path_is_refused_and_left_alone(tmp_path: Path) -> None:
    """``--snapshot-path`` naming an existing directory (the state directory instead of a
    file in it) was read as an unreadable snapshot: the whole directory, every file in it,
    was renamed ``<dir>.unreadable-<time>`` and the snapshot written in its place. It is a bad
    setting: refused at start (exit 2, naming the flag), nothing moved."""
    import subprocess
    import sys

    from kvatlas.asgi_thread import free_port
    from kvatlas.coordinator.config import parse_config

    state = tmp_path / "state"
    state.mkdir()
    (state / "other-service.db").write_text("not the coordinator's")
    with pytest.raises(ValueError, match=r"--snapshot-path .* is a directory"):
        parse_config(["--snapshot-path", str(state)], environ={})
    with pytest.raises(ValueError, match="--snapshot-path"):
        parse_config([], environ={"KVATLAS_SNAPSHOT_PATH": str(state)})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvatlas.cli", "coordinator", "--port", str(free_port()),
             "--snapshot-path", str(state), "--log-level", "warning"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:  # it started (and was killed by the timeout)
        raise AssertionError(f"started with a directory as its snapshot file: {exc}") from None
    finally:
        assert state.is_dir() and (state / "other-service.db").exists(), sorted(
            p.name for p in tmp_path.iterdir()
        )
    assert proc.returncode == 2, proc.stderr
    assert "--snapshot-path" in proc.stderr and "is a directory" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
