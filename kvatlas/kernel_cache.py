"""Where numba keeps kvatlas's compiled kernels: a directory keyed by the package's sources.

Numba keys a cached kernel by the one file of the function it compiles (its bytes); a callee
or a constant in another file (``blend/kernels/occupants.py`` called from ``scan.py``,
``layout.py``'s offsets) is not part of the key, so after an upgrade that changes only such a
file, numba's default cache (``__pycache__`` beside the sources) loads the old machine code.
Unless ``NUMBA_CACHE_DIR`` is set, importing :mod:`kvatlas` therefore points numba at
``$XDG_CACHE_HOME/kvatlas/numba/<version>-<hash of every kvatlas source>`` (``~/.cache`` without
``XDG_CACHE_HOME``): any change to any source starts a fresh cache. Stdlib only, and numba is
not imported here (clients never load it); the hash is computed once a process, by the first
``import kvatlas`` (≈30 ms on 2 busy cores: docs/performance.md, "Numba's cache directory").
Old directories are left in place (another installed version may use its own; a few MB each).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent

SET_BY_KVATLAS = "KVATLAS_NUMBA_CACHE_DIR"
"""Names the ``NUMBA_CACHE_DIR`` an ``import kvatlas`` set (inherited by the processes it
starts): one inherited from another tree's import is replaced by this tree's, not taken as
the caller's choice."""

chosen: Path | None = None
"""The directory ``import kvatlas`` chose (:func:`choose_cache_dir`; ``None``: it chose none,
e.g. the caller had set ``NUMBA_CACHE_DIR``)."""


def sources_key(package: Path = PACKAGE) -> str:
    """A hash of every ``.py`` file under ``package``: their paths relative to it and their
    bytes (20 hex digits)."""
    digest = hashlib.sha256()
    for relative, path in sorted(_sources(package, "")):
        digest.update(relative.encode() + b"\0")
        with open(path, "rb") as source:
            digest.update(source.read() + b"\0")
    return digest.hexdigest()[:20]


def _sources(directory: Path | str, prefix: str) -> list[tuple[str, str]]:
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__" and not entry.name.startswith("."):
                    found += _sources(entry.path, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".py"):
                found.append((prefix + entry.name, entry.path))
    return found


@functools.cache
def cache_key(package: Path = PACKAGE) -> str:
    """``<version>-<sources_key(package)>`` (computed once a process)."""
    from kvatlas import __version__

    return f"{__version__}-{sources_key(package)}"


def default_cache_dir(
    environ: Mapping[str, str] = os.environ, package: Path = PACKAGE
) -> Path | None:
    """``<user cache>/kvatlas/numba/<cache_key(package)>``: the user cache is
    ``XDG_CACHE_HOME`` when it is an absolute path, else ``~/.cache``; ``None`` when neither
    can be named (no home directory)."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        root = Path(xdg)
    else:
        home = environ.get("HOME") or os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        root = Path(home) / ".cache"
    return root / "kvatlas" / "numba" / cache_key(package)


def choose_cache_dir(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Set ``NUMBA_CACHE_DIR`` to :func:`default_cache_dir` unless it is set (the caller's
    choice stands; one an ``import kvatlas`` set, :data:`SET_BY_KVATLAS`, is chosen again for
    this tree), before any kernel is compiled or loaded: in the environment (numba reads it
    when imported; processes started from this one inherit it) and, when numba is already
    imported, in its config too (numba picks a kernel's cache directory when the kernel is
    defined). Numba creates the directory when it first writes there; one it cannot create is
    skipped for its default. Returns the directory set, else ``None``."""
    given = environ.get("NUMBA_CACHE_DIR")
    if given and given != environ.get(SET_BY_KVATLAS):
        return None
    try:
        where = default_cache_dir(environ)
    except OSError:  # the sources are not files (a zip import): numba's default
        return None
    if where is None:
        return None
    environ["NUMBA_CACHE_DIR"] = environ[SET_BY_KVATLAS] = str(where)
    config = sys.modules.get("numba.core.config")
    if config is not None:
        setattr(config, "CACHE_DIR", str(where))  # noqa: B010 (a module's setting, by name)
    return where
