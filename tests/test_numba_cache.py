"""Numba's cache directory is keyed by every kvatlas source: an installed package's
(kvatlas.kernel_cache) and the test run's (tests/numba_cache.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvatlas import __version__, kernel_cache
from kvatlas.kernel_cache import SET_BY_KVATLAS, choose_cache_dir, default_cache_dir, sources_key
from tests.numba_cache import CACHE_ROOT, ROOT, remove_other_keys


def test_this_run_uses_the_cache_of_these_sources() -> None:
    assert Path(os.environ["NUMBA_CACHE_DIR"]) == CACHE_ROOT / sources_key(ROOT / "kvatlas")


@pytest.fixture(scope="module")
def two_trees(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two copies of the package, the second with one constant changed in a kernel's callee
    file (``layout.py``'s, used by ``scan.py`` and ``writes.py``): the case numba's own
    per-file key misses."""
    trees = []
    for name in ("a", "b"):
        copy = tmp_path_factory.mktemp(name) / "kvatlas"
        shutil.copytree(ROOT / "kvatlas", copy, ignore=shutil.ignore_patterns("__pycache__"))
        trees.append(copy)
    layout = trees[1] / "directory" / "blend" / "kernels" / "layout.py"
    text = layout.read_text()
    constant = "O_OFF, O_HASH = 0, 1"
    assert constant in text
    layout.write_text(text.replace(constant, "O_OFF, O_HASH = 1, 0", 1))
    return trees[0], trees[1]


def test_a_changed_constant_in_a_callee_file_changes_the_key(two_trees: tuple[Path, Path]) -> None:
    a, b = two_trees
    assert sources_key(a) == sources_key(ROOT / "kvatlas")  # a copy keys as the original
    assert sources_key(b) != sources_key(a)


def test_the_installed_package_caches_under_the_user_cache_by_its_sources(
    two_trees: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = two_trees
    env = {"XDG_CACHE_HOME": str(tmp_path), "HOME": "/nonexistent"}
    dir_a, dir_b = default_cache_dir(env, a), default_cache_dir(env, b)
    assert dir_a == tmp_path / "kvatlas" / "numba" / f"{__version__}-{sources_key(a)}"
    assert dir_b is not None and dir_b.parent == dir_a.parent and dir_b != dir_a
    home = {"HOME": str(tmp_path), "XDG_CACHE_HOME": "relative"}  # not absolute: ignored
    assert default_cache_dir(home, a) == tmp_path / ".cache" / "kvatlas" / "numba" / dir_a.name
    assert default_cache_dir({"HOME": "relative"}, a) is None


_NUMBA_SEES = """
import sys
import time
if sys.argv[1] == "numba first":
    import numba
import kvatlas, os
import numba
print(os.environ.get("NUMBA_CACHE_DIR"))
print(numba.config.CACHE_DIR)
"""


@pytest.mark.parametrize("order", ["kvatlas first", "numba first"])
def test_importing_kvatlas_points_numba_at_its_keyed_cache(order: str, tmp_path: Path) -> None:
    """Without ``NUMBA_CACHE_DIR``, ``import kvatlas`` sets it (and numba's config, when numba
    was imported first) to the keyed user cache; a directory the caller set stands."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("NUMBA_CACHE_DIR")
    expected = default_cache_dir(env, ROOT / "kvatlas")

    def seen(environ: dict[str, str]) -> list[str]:
        run = subprocess.run([sys.executable, "-c", _NUMBA_SEES, order], env=environ,
                             capture_output=True, text=True, check=True, cwd=tmp_path)  # fmt: skip
        return run.stdout.split()

    assert seen(env) == [str(expected)] * 2
    own = str(tmp_path / "own")
    assert seen({**env, "NUMBA_CACHE_DIR": own}) == [own] * 2


def test_a_cache_directory_another_trees_import_set_is_chosen_again() -> None:
    """A process started by another kvatlas tree inherits its ``NUMBA_CACHE_DIR``: that one
    is this tree's to choose, while a directory the caller set stands."""
    inherited = {"HOME": "/home/u", "NUMBA_CACHE_DIR": "/elsewhere", SET_BY_KVATLAS: "/elsewhere"}
    assert choose_cache_dir(inherited) == default_cache_dir(inherited)
    assert inherited["NUMBA_CACHE_DIR"] == str(default_cache_dir(inherited))
    own = {"HOME": "/home/u", "NUMBA_CACHE_DIR": "/mine", SET_BY_KVATLAS: "/elsewhere"}
    assert choose_cache_dir(own) is None and own["NUMBA_CACHE_DIR"] == "/mine"


def test_sources_that_are_not_files_leave_numbas_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Imported from a zip, the sources cannot be listed: no directory is chosen."""

    def unlistable(package: Path = ROOT) -> str:
        raise NotADirectoryError(str(package))

    monkeypatch.setattr(kernel_cache, "sources_key", unlistable)
    kernel_cache.cache_key.cache_clear()
    try:
        environ = {"HOME": "/home/u"}
        assert choose_cache_dir(environ) is None and "NUMBA_CACHE_DIR" not in environ
    finally:
        kernel_cache.cache_key.cache_clear()


_CLIENT_ONLY = """
import os, sys
import kvatlas.client
from kvatlas import kernel_cache
print("numba" in sys.modules, kernel_cache.cache_key.cache_info().currsize,
      os.environ.get("NUMBA_CACHE_DIR"))
"""


def test_a_process_that_never_loads_numba_never_hashes_the_sources(tmp_path: Path) -> None:
    """``import kvatlas`` (a client's) defers the choice to the first ``import numba``: a
    client never pays for hashing every source (≈30 ms)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("NUMBA_CACHE_DIR")
    run = subprocess.run([sys.executable, "-c", _CLIENT_ONLY], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path)  # fmt: skip
    assert run.stdout.split() == ["False", "0", "None"]


def test_a_test_run_removes_only_the_other_keyed_caches(tmp_path: Path) -> None:
    """Other keys' caches go; the benchmarks' ``manual`` one and anything else stay."""
    here, old = tmp_path / sources_key(ROOT / "kvatlas"), tmp_path / ("0" * 20)
    kept = [here, tmp_path / "manual", tmp_path / ("0" * 19), tmp_path / ("g" * 20)]
    for directory in [*kept, old]:
        directory.mkdir()
        (directory / "index.nbi").write_bytes(b"x")
    remove_other_keys(tmp_path, here)
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def test_a_new_directory_deletes_the_keyed_ones_not_chosen_for_a_week(tmp_path: Path) -> None:
    """Choosing a directory not made yet deletes the keyed directories beside it last chosen
    (touched) a week ago or more: not newer ones, not other names, not what a stale-looking
    symbolic link points at; choosing an existing one touches it and deletes nothing."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    root, now, week = tmp_path / "kvatlas" / "numba", time.time(), kernel_cache.STALE_AFTER_S

    def made(path: Path, age: float) -> Path:
        path.mkdir(parents=True)
        (path / "kernel.nbi").write_bytes(b"x")
        os.utime(path, (now - age, now - age))
        return path

    stale = made(root / f"0.0.9-{'a' * 20}", week + 60)
    recent = made(root / f"0.0.9-{'b' * 20}", week - 3600)
    other = made(root / "notes", 2 * week)
    outside = made(tmp_path / f"0.0.8-{'c' * 20}", 2 * week)
    link = root / outside.name
    link.symlink_to(outside)
    os.utime(link, (now - 2 * week, now - 2 * week), follow_symlinks=False)
    where = choose_cache_dir(dict(env))
    assert where is not None and where.parent == root and not where.exists()
    assert not stale.exists()
    assert sorted(root.iterdir()) == sorted([recent, other, link])
    assert (outside / "kernel.nbi").exists()
    where.mkdir()
    os.utime(where, (now - 2 * week, now - 2 * week))
    older = made(root / f"0.0.7-{'d' * 20}", 2 * week)
    assert choose_cache_dir(dict(env)) == where
    assert time.time() - where.stat().st_mtime < week and older.exists()
