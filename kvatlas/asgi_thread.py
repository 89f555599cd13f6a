"""Serve an ASGI app with uvicorn: in a daemon thread (real sockets on loopback, same app), or
in the foreground of a service process until SIGINT or SIGTERM.

The thread is what the embedded services, the demo and the tests use to run a coordinator or a
node's peer API next to the code that talks to it. :func:`serve` is what ``kvatlas
coordinator`` and ``kvatlas node`` run: it *returns* after the graceful shutdown for either
signal, so the caller's shutdown work runs — the coordinator's shutdown snapshot, the node's
outbox flush and deregistration (docs/coordinator.md, docs/node.md). SIGTERM is what systemd
and Kubernetes send. uvicorn catches both signals and afterwards re-raises the one it caught
with the handler installed before it started: the default SIGTERM handler kills the process on
the spot (exit 143, no ``finally``); the one :func:`serve` installs only records it.
"""

from __future__ import annotations

import logging
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from kvatlas.http_guard import ErrorBody, guarded_protocol
from kvatlas.http_limits import HttpLimits, OnRefused

log = logging.getLogger(__name__)

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound *before* a service does any start-up work,
    so a second instance on a port in use stops before it touches shared state. Raises
    :class:`OSError` with a message naming the address when it cannot bind."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


class StopServing:
    """A reason to stop a foreground :func:`serve` that a background thread found after
    start-up (the coordinator's: Redis appeared and refused its credentials). :meth:`stop`
    shuts the server down gracefully, as a signal would (given before it serves: as soon as
    it has started); :attr:`reason` says why, for the exit code."""

    def __init__(self) -> None:
        self.reason: BaseException | None = None
        self._server: uvicorn.Server | None = None
        self._lock = threading.Lock()

    def stop(self, reason: BaseException) -> None:
        with self._lock:
            self.reason = self.reason or reason
            if self._server is not None:
                self._server.should_exit = True

    def bind(self, server: uvicorn.Server) -> None:
        with self._lock:
            self._server = server
            server.should_exit = self.reason is not None

    def exit_code(self) -> int:
        """After :func:`serve` returned: 1 (the reason logged) if this stopped it, else 0."""
        if self.reason is None:
            return 0
        log.error("stopped: %s", self.reason)
        return 1


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    sock: socket.socket | list[socket.socket] | None = None,
    limits: HttpLimits | None = None,
    on_refused: OnRefused = lambda _reason: None,
    error_body: ErrorBody | None = None,
    stopper: StopServing | None = None,
    **kwargs: Any,
) -> None:
    """``uvicorn.run(app, ...)`` that returns normally after a graceful shutdown on SIGINT or
    SIGTERM (the previous handlers are back in place when it returns), or ``stopper``'s stop.
    With ``sock`` (from :func:`bind_listener`; or several) uvicorn serves on those
    already-bound sockets; with ``limits``, under them (:mod:`kvatlas.http_guard`;
    ``on_refused`` counts, ``error_body`` is the body of the guard's own refusals), an idle
    connection kept for the header timeout (the time a client has to send its next request;
    uvicorn's own keep-alive is 5 s)."""
    if limits is not None:
        kwargs["http"] = guarded_protocol(limits, on_refused, error_body)
        kwargs.setdefault("timeout_keep_alive", limits.header_timeout_s)
    received: list[int] = []

    def remember(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, remember) for sig in SHUTDOWN_SIGNALS}
    try:
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **kwargs))
        if stopper is not None:
            stopper.bind(server)
        server.run(sockets=None if sock is None else sock if isinstance(sock, list) else [sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.info("%s received: shut down", signal.Signals(received[0]).name)


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
_PICK = random.SystemRandom()  # not the seeded ``random``: processes started alike pick apart
LOWEST_PORT = 10_000
"""The lowest port :func:`free_port` picks."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    """Where the kernel's range for outgoing connections' ports begins (Linux's default
    32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and never handed out before by this process, at random below
    the kernel's range for outgoing connections: between the pick and the server binding it,
    no client's connection (of this process or another) is given it, and processes picking at
    the same moment (test workers) rarely meet; the ports picked for a fleet before any of them
    is bound are distinct. Where that range leaves fewer than 1,000 ports below it, the kernel
    picks (any port it would give a listener)."""
    top = _ephemeral_start()
    while True:
        wanted = _PICK.randrange(LOWEST_PORT, top) if top - LOWEST_PORT >= 1_000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, wanted))
            except OSError:  # taken (or just released): another
                continue
            port = int(sock.getsockname()[1])
        with _HANDED_OUT_LOCK:
            if port not in _HANDED_OUT or len(_HANDED_OUT) > 20_000:
                _HANDED_OUT.add(port)
                return port


class ThreadedServer:
    def __init__(
        self,
        app: Any,
        *,
        port: int,
        host: str = "127.0.0.1",
        name: str = "server",
        limits: HttpLimits | None = None,
        on_refused: OnRefused = lambda _reason: None,
    ) -> None:
        if port == 0:
            raise ValueError("pick a port (free_port()) so clients know where to connect")
        self.host = host
        self.port = port
        self.name = name
        options: dict[str, Any] = {"log_level": "warning", "lifespan": "off"}
        if limits is not None:
            options["http"] = guarded_protocol(limits, on_refused)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **options))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0, sock: socket.socket | None = None) -> None:
        """Serve in a daemon thread (on ``sock`` from :func:`bind_listener` when given)."""
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={} if sock is None else {"sockets": [sock]},
            name=f"kvatlas-{self.name}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=20)
