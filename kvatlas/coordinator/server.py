"""Running the coordinator: ``kvatlas coordinator`` and an in-process background server.

The background server (uvicorn in a thread on a chosen or free port) is what the embedded
demo and the tests use: real HTTP on loopback, real sockets, the same app.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.logs import configure_logging

log = logging.getLogger("kvatlas.coordinator")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def announce_security(config: CoordinatorConfig) -> None:
    if config.auth_token_file is not None:
        log.info("auth enabled (tokens from %s)", config.auth_token_file)
    elif _is_loopback(config.host):
        log.info("auth disabled: bound to loopback %s only", config.host)
    else:
        log.warning(
            "auth disabled and bound to %s: anyone who can reach this port can post events "
            "and query every namespace; use --auth-token-file",
            config.host,
        )


class BackgroundServer:
    """The coordinator served by uvicorn in a daemon thread (``with`` it, or start/stop)."""

    def __init__(self, config: CoordinatorConfig, **uvicorn_kwargs: Any) -> None:
        if config.port == 0:
            raise ValueError("pick a port (free_port()) so clients know where to connect")
        self.config = config
        self.service = CoordinatorService(config)
        self.app = create_app(self.service)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.port,
                log_level="warning",
                lifespan="off",
                **uvicorn_kwargs,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout: float = 20.0) -> BackgroundServer:
        self.service.start()
        self._thread = threading.Thread(
            target=self._server.run, name="kvatlas-uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=20)
        self.service.stop()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_coordinator(config: CoordinatorConfig) -> int:
    configure_logging(config.log_level)
    # The event loop and the match threads share the GIL; the default 5 ms switch interval
    # lets one request's Python work stall the others' responses (p99). 1 ms keeps them fair.
    sys.setswitchinterval(0.001)
    announce_security(config)
    service = CoordinatorService(config)
    service.start()
    log.info(
        "kvatlas coordinator on http://%s:%d (scheme %s/%d, blend %s, transport %s)",
        config.host, config.port, config.hash_scheme, config.chunk_size,
        "on" if config.enable_blend_lookup else "off", config.event_transport,
    )  # fmt: skip
    try:
        uvicorn.run(
            create_app(service), host=config.host, port=config.port, log_level=config.log_level
        )
    finally:
        service.stop()
    return 0
