"""Directory snapshots: durable, atomically written, quick to take and fast to restore.

A snapshot holds the directory as it was when the save started (taken by copy-on-write, the
directory lock held one partition at a time), and a restore installs all of it or nothing.
:mod:`~kvatlas.directory.snapshot.format` is the file layout, :mod:`.writer` and
:mod:`.reader` the two directions. See docs/directory.md.
"""

from kvatlas.directory.snapshot.format import InstanceRow, SnapshotError, SnapshotInfo
from kvatlas.directory.snapshot.reader import load_snapshot
from kvatlas.directory.snapshot.writer import remove_stale_temps, save_snapshot

__all__ = [
    "InstanceRow",
    "SnapshotError",
    "SnapshotInfo",
    "load_snapshot",
    "remove_stale_temps",
    "save_snapshot",
]
