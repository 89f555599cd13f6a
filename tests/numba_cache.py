"""Numba's on-disk cache for test runs: ``.numba-cache/<hash of every kvatlas source>``.

Numba keys a cached kernel by its own file only (:mod:`kvatlas.kernel_cache` says why that is
not enough); an installed kvatlas therefore keys its cache directory by its sources, and test
runs do the same inside the tree (:func:`kvatlas.kernel_cache.sources_key`): any edit starts a
fresh cache (kernels recompile once, then are cached again), older ones are removed.
``tests/conftest.py`` sets it before anything imports numba; processes the tests start inherit
it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvatlas import kernel_cache

ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = ROOT / ".numba-cache"


def use_keyed_cache() -> Path:
    """Point ``NUMBA_CACHE_DIR`` at this tree's keyed cache, unless the caller chose one (one
    an ``import kvatlas`` chose, :data:`kvatlas.kernel_cache.SET_BY_KVATLAS`, is replaced)."""
    given = os.environ.get("NUMBA_CACHE_DIR")
    if given and given != os.environ.get(kernel_cache.SET_BY_KVATLAS):
        return Path(given)
    here = CACHE_ROOT / kernel_cache.sources_key(ROOT / "kvatlas")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        remove_other_keys(CACHE_ROOT, here)
    os.environ["NUMBA_CACHE_DIR"] = str(here)
    return here


def remove_other_keys(root: Path, here: Path) -> None:
    """Delete the keyed caches under ``root`` but ``here``: only directories named like a key
    (:func:`kvatlas.kernel_cache.sources_key`), never another one (``manual``: the
    benchmarks' cache, ``NUMBA_CACHE_DIR=.numba-cache/manual``)."""
    if root.is_dir():
        for old in root.iterdir():
            if old != here and KEY.fullmatch(old.name) and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


KEY = re.compile("[0-9a-f]{20}")
"""A key's name: :func:`kvatlas.kernel_cache.sources_key`'s 20 hex digits."""


PARTS = {
    "index": "kvatlas.directory.warm_up:warm_up_index",
    "events": "kvatlas.directory.warm_up:warm_up_events",
    "lookup": "kvatlas.coordinator.warm_up:warm_up_lookup_kernels",
    "keys": "kvatlas.keys:warm_up_mm_values",
}
"""What a service's start-up warms, in processes of their own: both cores compile."""
WARMED = "warmed-{}"
"""The file each finished part leaves in the keyed cache (its first line: ``ok`` or the error)."""
WARMING_ENV = "KVATLAS_TEST_KERNELS_WARMING"
"""Set (to the cache directory) by a run that warms the cache for its workers."""
_WARM_UP = """\
import importlib, sys
from pathlib import Path
done = Path(sys.argv[1]) / f"warmed-{sys.argv[2]}"
try:
    module, function = sys.argv[3].split(":")
    getattr(importlib.import_module(module), function)()
    from kvatlas.kernel_twins import compile_releasing_twins
    compile_releasing_twins()
except BaseException as exc:
    done.write_text(f"{type(exc).__name__}: {exc}\\n")
    raise
done.write_text("ok\\n")
"""


def _warmed(here: Path) -> bool:
    return all((here / WARMED.format(part)).exists() for part in PARTS)


def warm_for_workers() -> None:
    """Compile every kernel into the keyed cache once, in processes of their own started
    now, while the workers start and collect; :func:`wait_until_warm` holds their first test
    until all are done. Without it each worker, and each coordinator or node a test starts,
    compiles the kernels a cold cache lacks by itself, several at once on a cold run (every CI
    run: the key changes with every edit), a service's start-up then takes up to a minute."""
    here = Path(os.environ["NUMBA_CACHE_DIR"])
    if _warmed(here):
        return
    here.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}
    for part, function in PARTS.items():
        subprocess.Popen(
            [sys.executable, "-c", _WARM_UP, str(here), part, function],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    os.environ[WARMING_ENV] = str(here)


def wait_until_warm(timeout: float = 600.0) -> None:
    """Wait for :func:`warm_for_workers`' processes to finish (whatever its outcome: if it
    failed, the tests compile what they need as before)."""
    warming = os.environ.get(WARMING_ENV)
    if warming is None:
        return
    deadline = time.monotonic() + timeout
    while not _warmed(Path(warming)) and time.monotonic() < deadline:
        time.sleep(0.1)
