"""Start kvatlas services as real processes and wait until they answer (demo, benchmarks,
multi-process tests): one place that knows how to tell "started" from "still importing"."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGTERM: a service manager's stop, ``timeout``, ``kill``) raised where
    it arrived, under :func:`sigterm_as_interrupt`: it unwinds like Ctrl-C, through every
    ``finally`` that stops a process it started."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Interrupted` while processes are ours to stop (the main thread
    only; in another thread the caller handles its own signals). Python's default SIGTERM
    ends the process at once: the services it started would outlive it."""
    try:
        previous = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def is_healthy(url: str, client: httpx.Client | None = None) -> bool:
    """Whether ``<url>/healthz`` answers 200. A poller passes its ``client``: each
    ``httpx.get`` builds a client and its TLS context, ≈60 ms of CPU on a busy 2-core machine
    against ≈0.5 ms for a request on a kept client, taken from the service being waited for."""
    try:
        if client is None:
            return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
        return client.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def listens(pid: int, url: str) -> bool:
    """Whether the socket listening on ``url``'s port belongs to process ``pid`` (or one of
    its children). A port handed out free can be taken by another service before ``pid`` binds
    it: then *that* service answers ``/healthz`` while ``pid`` is exiting. True where ``/proc``
    cannot tell (not Linux)."""
    port = urlsplit(url).port
    if port is None or not Path("/proc/net/tcp").exists():
        return True
    if not any(Path(f"/proc/{pid}/task").glob("*/children")):  # no CONFIG_PROC_CHILDREN
        return True
    inodes = _listening_inodes(port)
    return any(f"socket:[{inode}]" in _sockets_of(p) for p in _family(pid) for inode in inodes)


def _listening_inodes(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                found.add(fields[9])
    return found


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    family, i = [pid], 0
    while i < len(family):
        for children in Path(f"/proc/{family[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                family += [int(c) for c in children.read_text().split()]
        i += 1
    return family


def _sockets_of(pid: int) -> set[str]:
    found = set()
    with contextlib.suppress(OSError):  # the process is gone
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed since it was listed
                found.add(os.readlink(fd))
    return found


def _start(
    args: list[str], quiet: bool, log: Path | None, outputs: contextlib.ExitStack
) -> _Started:
    """Run ``python <args>``. A quiet process's output goes to an unnamed file, read back only
    if it does not come up (this side's handle is closed with ``outputs``; the file is gone
    with the process: long-lived services that log much take ``log``).
    ``PYTHONFAULTHANDLER`` makes a process that does not answer print every thread's stack
    when it is sent SIGABRT."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if log is not None:
        with open(log, "ab") as sink:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT, env=env
            )
        return _Started(proc, None)
    kept = outputs.enter_context(tempfile.TemporaryFile()) if quiet else None  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=kept, stderr=subprocess.STDOUT if quiet else None, env=env
    )
    return _Started(proc, kept)


@dataclass
class _Started:
    proc: subprocess.Popen[bytes]
    output: IO[bytes] | None  # a quiet process's output, None where it went elsewhere

    def tail(self, limit: int = 4_000) -> str:
        if self.output is None:
            return ""
        self.output.seek(0, os.SEEK_END)
        self.output.seek(max(0, self.output.tell() - limit))
        return self.output.read().decode(errors="replace")


def spawn_service(
    args: list[str],
    url: str,
    *,
    timeout: float = 60.0,
    quiet: bool = True,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Run ``python <args>`` and return once ``<url>/healthz`` answers; kill it on timeout.
    ``log``: append the process's output to this file; else a ``quiet`` one's is kept only to
    say why it did not come up (in the error raised), and a loud one's is this process's."""
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
    does not answer within ``timeout``, all are killed and reaped (no zombie is left)."""
    with contextlib.ExitStack() as outputs:  # the processes keep their own descriptors
        started: list[_Started] = []
        try:
            for args, _ in services:
                started.append(_start(args, quiet, log, outputs))
            procs = [s.proc for s in started]
            stuck = wait_until_up(procs, [url for _, url in services], timeout)
        except BaseException:  # Ctrl-C or SIGTERM while they come up: none is left behind
            _kill([s.proc for s in started])
            raise
        if stuck is not None:
            why = _why_not_up(started[stuck], timeout, log)
            _kill(procs)
            args, url = services[stuck]
            raise RuntimeError(f"{' '.join(args[:4])} did not come up at {url}: {why}")
    return procs


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def _why_not_up(started: _Started, timeout: float, log: Path | None) -> str:
    """What a process that did not come up printed: one still running is sent SIGABRT first,
    so its output ends with its threads' stacks."""
    proc = started.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        what = f"no answer in {timeout:g} s (sent SIGABRT for its stacks)"
    else:
        what = f"it exited with status {proc.returncode}"
    if log is not None:
        return f"{what}; its output is in {log}"
    output = started.tail()
    return f"{what}; its output ends:\n{output}" if output else what


def wait_until_up(
    procs: Sequence[subprocess.Popen[bytes]], urls: Sequence[str], timeout: float
) -> int | None:
    """Wait until each process answers ``<url>/healthz`` on a socket of its own
    (:func:`listens`); ``None`` then, else the index of the first that exited or did not
    answer within ``timeout`` (nothing is killed)."""
    deadline = time.monotonic() + timeout
    waiting = list(range(len(procs)))
    with httpx.Client(timeout=0.5) as client:  # one for every poll (is_healthy says why)
        while waiting:
            waiting = [
                i
                for i in waiting
                if not (is_healthy(urls[i], client) and listens(procs[i].pid, urls[i]))
            ]
            failed = [i for i in waiting if procs[i].poll() is not None]
            if waiting and (failed or time.monotonic() > deadline):
                return (failed or waiting)[0]
            if waiting:
                time.sleep(0.05)
    return None


def stop(procs: Sequence[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each; one still running ``timeout``
    seconds after its SIGTERM is killed (SIGKILL). None outlives this call."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
