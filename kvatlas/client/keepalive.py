"""A lean HTTP/1.1 client for one origin, on an event loop: persistent connections, the request
head built from fixed parts, the reply parsed by httptools (uvicorn's parser: content-length,
chunked, keep-alive). What :class:`~kvatlas.client.route_client.AsyncRouteClient` asks the
coordinator with once per routed request: a general client (aiohttp) spends about 2.5× the
CPU of this one per call (docs/router.md, "The router's own cost").

Invariants: a connection carries one request at a time and goes back to the pool only after a
whole reply that allows keep-alive; anything else (an error, a cancellation, a timeout of the
caller) closes it. A request that finds its reused connection closed by the server before any
reply byte (the server's keep-alive timeout) is sent again once on a fresh one — the only
retry, and only for a connection that had served before (the requests made through this client
are read-only: a score, a listing).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

import httptools

MAX_IDLE: Final = 64
"""Idle connections kept; more are closed when they come back."""


class _Stale(Exception):
    """A reused connection the server had closed: no byte of the reply came."""


class _Reply:
    """httptools' callbacks: the body's pieces and whether the message is complete."""

    __slots__ = ("body", "done", "keep_alive", "parser")

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.done = False
        self.keep_alive = False
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()  # reset once the message is over


class _Connection:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class KeepAliveClient:
    """``await request(method, path, body)`` → ``(status, body bytes)``; ``OSError`` (e.g.
    ``ConnectionError``) when no whole reply came. The caller bounds the time
    (``asyncio.timeout``)."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.base_path = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        fixed = {"Host": host, **(headers or {})}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Connection] = []

    async def request(
        self, method: str, path: str, body: bytes | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, bytes]:  # fmt: skip
        head = f"{method} {self.base_path}{path} HTTP/1.1\r\n{self._fixed}"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        data = (head + "\r\n").encode("latin-1") + (body or b"")
        while self._idle:
            conn = self._idle.pop()
            if not conn.usable():
                conn.close()
                continue
            try:
                return await self._exchange(conn, data)
            except _Stale:
                continue  # closed by the server while idle: the next one, or a new one
        reader, writer = await asyncio.open_connection(
            self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None
        )
        try:
            return await self._exchange(_Connection(reader, writer), data)
        except _Stale:
            raise ConnectionResetError("the server closed the connection before replying") from None

    async def _exchange(self, conn: _Connection, data: bytes) -> tuple[int, bytes]:
        reply = _Reply()
        parser = reply.parser
        received = False
        try:
            conn.writer.write(data)
            while not reply.done:
                try:
                    chunk = await conn.reader.read(65_536)
                except ConnectionResetError:
                    if conn.reused and not received:
                        raise _Stale from None
                    raise
                if not chunk:
                    if conn.reused and not received:
                        raise _Stale
                    raise ConnectionResetError("the connection closed before the reply ended")
                received = True
                try:
                    parser.feed_data(chunk)
                except httptools.HttpParserError as exc:
                    raise ConnectionError(f"malformed HTTP reply: {exc}") from None
        except BaseException:
            conn.close()
            raise
        if reply.keep_alive and len(self._idle) < MAX_IDLE:
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()
        return parser.get_status_code(), b"".join(reply.body)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
