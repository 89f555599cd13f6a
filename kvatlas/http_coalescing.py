"""A connection's transport whose writes made in one turn of the event loop leave in one
``send`` (:class:`CoalescingTransport`): what :mod:`kvatlas.http_guard`'s protocol writes
through.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

COALESCE_BYTES: Final = 64 * 1024
"""What :class:`CoalescingTransport` holds at most before sending (asyncio's default high-water
mark of a transport's buffer)."""


class CoalescingTransport:
    """A connection's transport whose writes made in one turn of the event loop leave in one
    ``send``: uvicorn writes a reply's head and its body separately, which on a socket with
    ``TCP_NODELAY`` (asyncio's default) are two segments — two system calls here, and often two
    wake-ups and reads for the client (the router's score call read 1.5 times per reply). The
    buffer is flushed at the end of the turn (``call_soon``), before a ``close`` or a
    ``write_eof`` and never after an ``abort``; once it holds :data:`COALESCE_BYTES` it is
    flushed at once, and a write that large goes out as it is after what is pending (no extra
    copy of a large body; the transport's own flow control sees it within the turn).
    Everything else is the transport's own."""

    __slots__ = ("_loop", "_pending", "_pending_bytes", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        if len(data) >= COALESCE_BYTES:
            self._flush()
            if not self._transport.is_closing():
                self._transport.write(data)
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))
        self._pending_bytes += len(data)
        if self._pending_bytes >= COALESCE_BYTES:
            self._flush()

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending, self._pending_bytes = [], 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._pending_bytes

    def __getattr__(self, name: str) -> Any:  # everything else: the transport's own
        return getattr(self._transport, name)
