"""Making a file's name durable: a rename or a creation lives in its directory's entry, which
``fsync`` of the file does not write (:func:`fsync_directory`)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(path: Path) -> None:
    """Make the renames and creations done in the directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["fsync_directory"]
