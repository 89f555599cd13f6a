"""Where numba keeps kvatlas's compiled kernels: a directory keyed by the package's sources.

Numba keys a cached kernel by the one file of the function it compiles (its bytes); a callee
or a constant in another file (``blend/kernels/occupants.py`` called from ``scan.py``,
``layout.py``'s offsets) is not part of the key, so after an upgrade that changes only such a
file, numba's default cache (``__pycache__`` beside the sources) loads the old machine code.
Unless ``NUMBA_CACHE_DIR`` is set, a process that imported :mod:`kvatlas` therefore points
numba at ``$XDG_CACHE_HOME/kvatlas/numba/<version>-<hash of every kvatlas source>``
(``~/.cache`` without ``XDG_CACHE_HOME``) when it imports numba: any change to any source
starts a fresh cache. ``import kvatlas`` only installs the hook that does so
(:func:`choose_before_numba`): the hash (≈30 ms on 2 busy cores: docs/performance.md, "Numba's
cache directory") is computed once, in processes that load numba, never in a client that does
not. Stdlib only, and numba is not imported here.

Old directories are deleted (:func:`remove_stale`): each process that chooses a directory
touches it (its modification time says when it was last chosen); a process that chooses one
not made yet (a new version or source tree) deletes the other keyed directories beside it not
chosen for :data:`STALE_AFTER_S` (7 days). Another installed version still in use keeps its
own: its processes touch it as they start.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent

SET_BY_KVATLAS = "KVATLAS_NUMBA_CACHE_DIR"
"""Names the ``NUMBA_CACHE_DIR`` an ``import kvatlas`` set (inherited by the processes it
starts): one inherited from another tree's import is replaced by this tree's, not taken as
the caller's choice."""

chosen: Path | None = None
"""The directory chosen before numba was imported (:func:`choose_before_numba`; ``None``: none
chosen yet, or none to choose, e.g. the caller had set ``NUMBA_CACHE_DIR``)."""


def sources_key(package: Path = PACKAGE) -> str:
    """A hash of every ``.py`` file under ``package``: their paths relative to it and their
    bytes (20 hex digits)."""
    import hashlib  # here: ``import kvatlas`` stays without it (≈15–45 ms on a busy machine)

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
    mark_chosen(where)
    environ["NUMBA_CACHE_DIR"] = environ[SET_BY_KVATLAS] = str(where)
    config = sys.modules.get("numba.core.config")
    if config is not None:
        setattr(config, "CACHE_DIR", str(where))  # noqa: B010 (a module's setting, by name)
    return where


STALE_AFTER_S = 7 * 24 * 3600.0
"""A keyed directory not chosen for this long (its modification time) is deleted."""

_KEY = re.compile(r"[^/]+-[0-9a-f]{20}")
"""A keyed directory's name: ``<version>-<sources_key>``."""


def mark_chosen(where: Path) -> None:
    """Touch ``where`` (the directory just chosen); if it does not exist yet, a new key is in
    use: :func:`remove_stale` beside it."""
    try:
        os.utime(where)
    except FileNotFoundError:
        remove_stale(where.parent, where)
    except OSError:  # not ours to touch: leave it and its neighbours alone
        pass


def remove_stale(root: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Delete the keyed directories directly under ``root`` (named ``<version>-<key>``, not
    symbolic links) but ``keep`` whose modification time is :data:`STALE_AFTER_S` or more
    before ``now``; returns those deleted. Nothing else is touched, nothing outside ``root``.
    Errors are ignored: another process may delete the same directory at once, or a
    directory be unreadable. (A process choosing a stale directory during the few
    milliseconds between another's check and delete loses its cache: numba compiles again.)"""
    import shutil

    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if path == keep or not _KEY.fullmatch(entry.name):
            continue
        try:
            stale = entry.is_dir(follow_symlinks=False) and (
                now - entry.stat(follow_symlinks=False).st_mtime >= STALE_AFTER_S
            )
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class _BeforeNumba:
    """First on ``sys.meta_path`` (a finder: ``importlib.abc.MetaPathFinder``'s one method,
    without importing ``importlib.abc``, which costs more than the rest of ``import kvatlas``):
    on the first lookup of ``numba``, before numba's modules run (and read
    ``NUMBA_CACHE_DIR``), chooses the cache directory; finds nothing itself."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if not self.done and fullname == "numba":
            self.done = True  # first: the hash's own imports come back here
            global chosen
            chosen = choose_cache_dir()


def choose_before_numba() -> None:
    """Have :func:`choose_cache_dir` run once, right before this process imports numba, or
    now if it has (``import kvatlas``): every numba import goes through ``sys.meta_path``, ours
    and any library's, so no kernel is defined before the choice, and processes that never
    load numba (clients) never hash the sources. Processes started later inherit the
    directory from the environment; one started before, that loads numba, computes the same
    directory itself."""
    if "numba" in sys.modules:
        global chosen
        chosen = choose_cache_dir()
    elif not any(isinstance(finder, _BeforeNumba) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeNumba())
