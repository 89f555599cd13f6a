"""``tests/conftest.py``'s ``LONG_FILES`` name files that exist: a renamed or split file would
silently lose its place at the start of the run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_FILES

ROOT = Path(__file__).resolve().parent.parent


def test_every_long_file_exists_once() -> None:
    assert [f for f in LONG_FILES if not (ROOT / f).is_file()] == []
    assert len(set(LONG_FILES)) == len(LONG_FILES)
