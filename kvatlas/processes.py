"""Start kvatlas services as real processes and wait until they answer (demo, benchmarks,
multi-process tests): one place that knows how to tell "started" from "still importing"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


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
    out: Any = subprocess.DEVNULL if quiet else None
    if log is not None:
        with open(log, "ab") as sink:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
    else:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=out, stderr=out, env=dict(os.environ)
        )
    deadline = time.monotonic() + timeout
    while not is_healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{' '.join(args[:4])} did not come up at {url}")
        time.sleep(0.05)
    return proc


def stop(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait(timeout=timeout)
