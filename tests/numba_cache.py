"""Numba's on-disk cache, keyed by the package's sources for test runs.

Numba keys a cached kernel by the file of the function it compiles; a callee or a constant in
another file (``blend/kernels/occupants.py`` called from ``scan.py``, ``layout.py``'s offsets)
is not part of the key, so after such an edit a warm tree runs the old machine code and tests
pass on broken code. Test runs therefore use ``.numba-cache/<hash of every kvatlas source>``:
any edit starts a fresh cache (kernels recompile once, then are cached again), older ones are
removed. ``tests/conftest.py`` sets it before anything imports numba; processes the tests
start inherit it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = ROOT / ".numba-cache"


def sources_key(package: Path = ROOT / "kvatlas") -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def use_keyed_cache() -> Path:
    """Point ``NUMBA_CACHE_DIR`` at this tree's keyed cache (unless the caller chose one)."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return Path(os.environ["NUMBA_CACHE_DIR"])
    here = CACHE_ROOT / sources_key()
    if CACHE_ROOT.is_dir():
        for old in CACHE_ROOT.iterdir():
            if old != here and "PYTEST_XDIST_WORKER" not in os.environ:
                shutil.rmtree(old, ignore_errors=True)
    os.environ["NUMBA_CACHE_DIR"] = str(here)
    return here


def warm_keyed_cache() -> None:
    """Compile the coordinator's kernels into the keyed cache once, in one process, before the
    test workers start: a cold cache costs every process that starts before it is written
    ≈28 s of CPU (``warm_up_kernels``), and a fleet of processes compiling side by side on 2
    cores ran past its start timeout. The test workers skip it (the controller did it)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    marker = Path(os.environ["NUMBA_CACHE_DIR"]) / ".warm"
    if marker.exists():
        return
    warm = "from kvatlas.directory import warm_up_kernels; warm_up_kernels()"
    subprocess.run([sys.executable, "-c", warm], check=True, timeout=900, cwd=ROOT)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
