"""The test run's numba cache is keyed by every kvatlas source (tests/numba_cache.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.numba_cache import CACHE_ROOT, ROOT, sources_key


def test_this_run_uses_the_cache_of_these_sources() -> None:
    assert Path(os.environ["NUMBA_CACHE_DIR"]) == CACHE_ROOT / sources_key()


def test_editing_a_callee_in_another_file_changes_the_key(tmp_path: Path) -> None:
    """The case numba's own key misses: a kernel's callee, in another file."""
    copy = tmp_path / "kvatlas"
    shutil.copytree(ROOT / "kvatlas", copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = sources_key(copy)
    assert before == sources_key(ROOT / "kvatlas")
    occupants = copy / "directory" / "blend" / "kernels" / "occupants.py"
    occupants.write_text(occupants.read_text() + "\n# edited\n")
    assert sources_key(copy) != before
