"""LMCache's own coordinator, the reference of ``bench service``'s HTTP rows (quality.md,
"Performance": "LMCache 0.5.6's coordinator measured here with the same load generator in the
same run").

It lives in a virtual environment of its own (``make lmcache`` installs ``./.venv-lmcache``:
LMCache pins older numpy and FastAPI than kvatlas) and runs as a real process,
``lmcache coordinator``, as an operator starts it: nothing of ours is imported into it, and
only what must match our coordinator is set (the chunk size, the blend index on). Refuse rather
than guess: an environment named on the command line that holds no usable LMCache is an error,
never a run without the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvatlas.asgi_thread import free_port
from kvatlas.errors import InvalidInput, Unavailable
from kvatlas.processes import stop, wait_until_up

REFERENCE_VERSION = "0.5.6"
"""The version quality.md's reference figures and targets are stated against."""

DEFAULT_VENV = ".venv-lmcache"
STARTUP_S = 180.0
"""How long its start may take: it imports torch; seconds on a warm page cache, tens of seconds
from a cold one on 2 busy cores."""

QUIET_ENV = {
    "LMCACHE_DISABLE_BANNER": "1",
    "LMCACHE_TRACK_USAGE": "false",  # LMCache's telemetry opt-out: nothing of ours phones home
    "DO_NOT_TRACK": "1",
    "PYTHONWARNINGS": "ignore",
}
"""Set for every LMCache process we start (benchmarks and the interop tests alike)."""


@dataclass(frozen=True)
class LMCacheEnv:
    """A virtual environment holding LMCache: its ``bin`` directory and LMCache's version."""

    bin_dir: Path
    version: str

    @property
    def label(self) -> str:
        return f"LMCache {self.version}"


def find_lmcache(choice: str, cwd: Path | None = None) -> LMCacheEnv | None:
    """The environment ``--lmcache`` names: ``off`` → ``None``; ``auto`` → ``./.venv-lmcache``
    when there (``None`` with a note on stderr when it is absent or unusable); a path → that
    environment (its directory or its ``bin`` directory), or :class:`InvalidInput` saying why
    it cannot be used."""
    if choice == "off":
        return None
    if choice == "auto":
        venv = (cwd or Path.cwd()) / DEFAULT_VENV
        if not venv.exists():
            _note(f"{venv} is absent (`make lmcache` installs it; --lmcache PATH names another)")
            return None
        try:
            return _usable(venv, "auto")
        except InvalidInput as e:
            _note(f"{e} (--lmcache off says not to look)")
            return None
    return _usable(Path(choice).absolute(), choice)  # (LMCache starts in a directory of its own)


def _note(why: str) -> None:
    print(f"kvatlas bench service: LMCache is not measured: {why}", file=sys.stderr)


def _usable(where: Path, flag: str) -> LMCacheEnv:
    """The environment at ``where`` (a venv or its ``bin``), checked without starting LMCache:
    its ``lmcache`` command and its Python, which must report an installed ``lmcache``."""
    for bin_dir in (where, where / "bin"):
        if (bin_dir / "lmcache").is_file():
            break
    else:
        raise InvalidInput(
            f"--lmcache {flag}: no `lmcache` command in {where} or {where / 'bin'} "
            f"(give a virtual environment with LMCache {REFERENCE_VERSION} installed, or its bin "
            "directory; `make lmcache` makes ./.venv-lmcache)"
        )
    python = bin_dir / "python"
    if not os.access(bin_dir / "lmcache", os.X_OK) or not os.access(python, os.X_OK):
        raise InvalidInput(f"--lmcache {flag}: {bin_dir} has no executable `lmcache` and `python`")
    try:
        version = installed_version(python)
    except InvalidInput as exc:
        raise InvalidInput(f"--lmcache {flag}: {exc}") from None
    if version != REFERENCE_VERSION:
        print(
            f"kvatlas bench service: warning: {bin_dir} holds LMCache {version}; quality.md's "
            f"reference is {REFERENCE_VERSION} (the table names the version measured)",
            file=sys.stderr,
        )
    return LMCacheEnv(bin_dir, version)


def installed_version(python: Path) -> str:
    """The LMCache version installed for ``python`` (an LMCache environment's interpreter), as
    that environment's package metadata states it; :class:`InvalidInput` with the probe's
    error output when it has none."""
    try:
        probe = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
            capture_output=True, text=True, env=lmcache_env(), timeout=60, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InvalidInput(f"{python} could not report its LMCache: {exc}") from None
    version = probe.stdout.strip()
    if probe.returncode != 0 or not version:
        raise InvalidInput(f"{python} has no LMCache installed: {probe.stderr.strip()[-300:]}")
    return version


def lmcache_env() -> dict[str, str]:
    """The environment an LMCache process runs with: ours, :data:`QUIET_ENV`, and no
    ``PYTHONPATH`` (LMCache's own environment, nothing of ours)."""
    env = {**os.environ, **QUIET_ENV}
    env.pop("PYTHONPATH", None)
    return env


@contextmanager
def lmcache_coordinator(
    lmcache: LMCacheEnv, chunk_size: int, workdir: Path, name: str = "lmcache-coordinator"
) -> Iterator[tuple[str, int]]:
    """One ``lmcache coordinator`` process on a free loopback port, blend lookup on,
    ``chunk_size`` tokens a chunk: its URL and pid (for its CPU time). Its output goes to
    ``workdir/<name>.log``. Stopped on exit, whatever happened (:func:`~kvatlas.processes.stop`:
    killed if SIGTERM does not end it); :class:`Unavailable` with its log's tail when it exits
    or does not answer within :data:`STARTUP_S`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{name}.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [str(lmcache.bin_dir / "lmcache"), "coordinator", "--host", "127.0.0.1",
             "--port", str(port), "--chunk-size", str(chunk_size), "--enable-blend-lookup"],
            stdout=out, stderr=subprocess.STDOUT, env=lmcache_env(), cwd=workdir,
        )  # fmt: skip
    try:
        if wait_until_up([proc], [url], STARTUP_S) is not None:
            why = (
                f"exited ({proc.returncode}) before answering {url}"
                if proc.poll() is not None
                else f"did not answer {url}/healthz within {STARTUP_S:g} s"
            )
            tail = log.read_text(errors="replace")[-2000:]
            raise Unavailable(f"{lmcache.label}'s coordinator {why}: {tail}")
        yield url, proc.pid
    finally:
        stop([proc])
