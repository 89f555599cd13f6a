"""Serve an ASGI app with uvicorn in a daemon thread: real sockets on loopback, same app.

What the embedded services, the demo and the tests use to run a coordinator or a node's peer
API next to the code that talks to it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ThreadedServer:
    def __init__(
        self, app: Any, *, port: int, host: str = "127.0.0.1", name: str = "server"
    ) -> None:
        if port == 0:
            raise ValueError("pick a port (free_port()) so clients know where to connect")
        self.host = host
        self.port = port
        self.name = name
        self._server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        self._thread = threading.Thread(
            target=self._server.run, name=f"kvatlas-{self.name}", daemon=True
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
