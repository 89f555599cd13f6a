"""Running the coordinator: ``kvatlas coordinator`` and an in-process background server.

The background server (uvicorn in a thread on a chosen or free port) is what the embedded
demo and the tests use: real HTTP on loopback, real sockets, the same app. See
docs/coordinator.md.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import sys
import time
from collections.abc import Callable

from kvatlas.asgi_thread import ThreadedServer, free_port, serve
from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.logs import configure_logging

__all__ = ["BackgroundServer", "announce_security", "free_port", "run_coordinator"]

log = logging.getLogger(__name__)


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
    """The coordinator (service + HTTP) in this process, served in a daemon thread."""

    def __init__(
        self, config: CoordinatorConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock`` times instance heartbeats (tests inject a fake one)."""
        self.config = config
        self.service = CoordinatorService(config, clock)
        self.app = create_app(self.service)
        self._http = ThreadedServer(
            self.app, port=config.port, host=config.host, name="coordinator"
        )

    @property
    def url(self) -> str:
        return self._http.url

    def start(self, timeout: float = 20.0) -> BackgroundServer:
        self.service.start()
        self._http.start(timeout)
        return self

    def stop(self) -> None:
        self._http.stop()
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
    app = create_app(service)
    # Everything allocated so far (framework, routes, compiled kernels) lives for the whole
    # process: move it out of the collector's sight so a full collection triggered by event
    # decoding scans only what requests allocate.
    gc.freeze()
    try:
        serve(app, host=config.host, port=config.port, log_level=config.log_level)
    finally:
        service.stop()
    return 0
