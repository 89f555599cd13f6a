"""Start kvatlas services as real processes and wait until they answer (demo, benchmarks,
multi-process tests): one place that knows how to tell "started" from "still importing"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def _start(args: list[str], quiet: bool, log: Path | None) -> subprocess.Popen[bytes]:
    out: Any = subprocess.DEVNULL if quiet else None
    if log is not None:
        with open(log, "ab") as sink:  # the child keeps its own descriptor
            return subprocess.Popen(
                [sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
    return subprocess.Popen([sys.executable, *args], stdout=out, stderr=out, env=dict(os.environ))


def spawn_service(
    args: list[str],
    url: str,
    *,
    timeout: float = 60.0,
    quiet: bool = True,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Run ``python <args>`` and return once ``<url>/healthz`` answers; kill it on timeout.
    ``log``: append the process's output to this file (else ``quiet`` discards it)."""
    return spawn_services([(args, url)], timeout=timeout, quiet=quiet, log=log)[0]


def spawn_services(
    services: Sequence[tuple[list[str], str]],
    *,
    timeout: float = 60.0,
    quiet: bool = True,
    log: Path | None = None,
) -> list[subprocess.Popen[bytes]]:
    """:func:`spawn_service` for each ``(args, url)``, all started at once (a fleet's nodes come
    up side by side, not one after the other); returns once every one answers. If one exits or
    does not answer within ``timeout``, all are killed."""
    procs = [_start(args, quiet, log) for args, _ in services]
    deadline = time.monotonic() + timeout
    waiting = list(range(len(procs)))
    while waiting:
        waiting = [i for i in waiting if not is_healthy(services[i][1])]
        failed = [i for i in waiting if procs[i].poll() is not None]
        if waiting and (failed or time.monotonic() > deadline):
            for proc in procs:
                proc.kill()
            args, url = services[(failed or waiting)[0]]
            raise RuntimeError(f"{' '.join(args[:4])} did not come up at {url}")
        if waiting:
            time.sleep(0.05)
    return procs


def stop(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait(timeout=timeout)
