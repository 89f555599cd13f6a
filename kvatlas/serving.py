"""Serve an ASGI app in the foreground until SIGINT or SIGTERM, then *return*, so the caller's
shutdown work (the coordinator's shutdown snapshot, the node's outbox flush and deregistration)
runs for either signal — SIGTERM is what systemd and Kubernetes send (docs/coordinator.md,
docs/node.md).

uvicorn captures both signals for its graceful shutdown and afterwards re-raises the one it
caught with whatever handler was installed before it started: the default SIGTERM handler kills
the process on the spot (exit 143, no ``finally``), the default SIGINT handler raises
``KeyboardInterrupt`` out of the caller. Here the handler it restores only records the signal.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(app: Any, *, host: str, port: int, **kwargs: Any) -> None:
    """``uvicorn.run(app, ...)`` that returns normally after a graceful shutdown on SIGINT or
    SIGTERM (the default handlers are back in place when it returns)."""
    received: list[int] = []

    def remember(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, remember) for sig in SHUTDOWN_SIGNALS}
    try:
        uvicorn.run(app, host=host, port=port, **kwargs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        log.info("%s received: shutting down", signal.Signals(received[0]).name)
