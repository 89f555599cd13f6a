"""An asyncio transport kept in memory: what an HTTP protocol (uvicorn's, or the HTTP guard's,
:mod:`kvatlas.http_guard`) writes is kept, nothing is sent. Tests and benchmarks drive an app
behind the protocol with it, without sockets: ``protocol.connection_made(transport)``, then
``protocol.data_received(request_bytes)`` on the protocol's event loop.

Stdlib only: a benchmark comparing source trees loads this file from its own tree by path
(``scripts/bench_blend_lookup.py``), whatever tree's kvatlas it imports.
"""

from __future__ import annotations

import asyncio
from typing import Any


class MemoryTransport(asyncio.Transport):
    """The protocol's transport: every write kept in :attr:`written`, one ``bytes`` each (the
    guard writes a reply's head and body at once), the peer ``127.0.0.1:40000`` and the server
    ``127.0.0.1:8000``; never closing, reading never paused."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass
