"""A lean HTTP/1.1 client for one origin, on an event loop: persistent connections, the request
head built from fixed parts, the reply parsed by httptools (uvicorn's parser: content-length,
chunked, close-delimited, keep-alive) and read either whole (:meth:`KeepAliveClient.request`:
the router's score call, a listing) or as it comes (:meth:`KeepAliveClient.stream`: the
router's engine call, server-sent events passed on piece by piece). A general client (aiohttp)
spends several times the CPU of this one per call (docs/router.md, "The router's own cost").

Invariants: a connection carries one request at a time and goes back to the pool only after a
whole reply that allows keep-alive; anything else (an error, a cancellation, a timeout, a reply
left unread) closes it. A request that finds its reused connection closed by the server before
any reply byte (the server's keep-alive timeout) is sent again once on a fresh one — the only
retry, and only for a connection that had served before: the server never saw that request.
A fresh connection that fails before any reply byte raises :class:`Refused` (the caller may try
another server: nothing was answered); after the first byte a failure is never retried here.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

import httptools

MAX_IDLE: Final = 64
"""Idle connections kept by default; more are closed when they come back."""
_READ: Final = 65_536


class Refused(ConnectionError):
    """No byte of the reply came: the connection was refused, not made in time, or closed or
    reset before the reply's first byte. The server answered nothing."""


class _Stale(Exception):
    """A reused connection the server had closed: no byte of the reply came."""


class _Parse:
    """httptools' callbacks for one reply: its headers, body pieces not yet handed out, and
    where the message stands."""

    __slots__ = ("body", "done", "has_length", "head_done", "headers", "keep_alive", "parser")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.head_done = False
        self.has_length = False
        self.done = False
        self.keep_alive = False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.headers.append((name, value))
        if name == b"content-length" or (
            name == b"transfer-encoding" and value.strip().lower().endswith(b"chunked")
        ):
            self.has_length = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim reply (100 Continue): the real one follows
            self.headers.clear()
            self.has_length = False
            return
        self.head_done = True
        if status in (204, 304):
            self.has_length = True

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.done = True
            self.keep_alive = self.parser.should_keep_alive()  # reset once the message is over

    def eof(self) -> bool:
        """The connection ended: ``True`` if that ends the reply (a body delimited by the
        close, HTTP/1.0 style), ``False`` if the reply was cut."""
        if self.head_done and not self.has_length and not self.done:
            self.done = True
            self.keep_alive = False
        return self.done


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


class StreamedReply:
    """A reply whose head has been read: ``status``, ``headers`` (lower-case names, in order),
    and the body through :meth:`read_some` as it arrives. :meth:`close` (always safe) drops the
    connection unless the whole reply was read."""

    __slots__ = ("_client", "_conn", "_parse", "_read_timeout_s", "headers", "status")

    def __init__(self, client: KeepAliveClient, conn: _Connection, parse: _Parse,
                 read_timeout_s: float | None) -> None:  # fmt: skip
        self._client = client
        self._conn: _Connection | None = conn
        self._parse = parse
        self._read_timeout_s = read_timeout_s
        self.status = parse.parser.get_status_code()
        self.headers = parse.headers

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def complete(self) -> bool:
        """The whole reply was received."""
        return self._parse.done

    async def read_some(self) -> bytes:
        """The body's next bytes as they came (chunked framing removed), ``b""`` once it is
        over. ``ConnectionError`` when the connection ends before the reply does,
        ``TimeoutError`` when nothing came within the read timeout: the connection is closed
        either way."""
        parse = self._parse
        while not parse.body:
            if parse.done:
                return b""
            conn = self._conn
            if conn is None:
                raise ConnectionResetError("the reply was closed before its end")
            try:
                data = await _read(conn.reader, self._read_timeout_s)
                if not data:
                    if not parse.eof():
                        raise ConnectionResetError("the connection closed before the reply ended")
                else:
                    _feed(parse, data)
            except BaseException:
                self.close()
                raise
            if parse.done:
                self._release()
        pieces = parse.body
        parse.body = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def read_all(self) -> bytes:
        pieces = []
        while piece := await self.read_some():
            pieces.append(piece)
        return b"".join(pieces)

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(conn, self._parse.keep_alive)

    def close(self) -> None:
        if self._parse.done:
            self._release()
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


async def _read(reader: asyncio.StreamReader, timeout_s: float | None) -> bytes:
    if timeout_s is None:
        return await reader.read(_READ)
    async with asyncio.timeout(timeout_s):
        return await reader.read(_READ)


def _feed(parse: _Parse, data: bytes) -> None:
    try:
        parse.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        raise ConnectionError("the server switched protocols") from None
    except httptools.HttpParserError as exc:
        raise ConnectionError(f"malformed HTTP reply: {exc}") from None


class KeepAliveClient:
    """``await request(method, path, body)`` → ``(status, body bytes)``; ``await stream(...)``
    → a :class:`StreamedReply` once its head is in. ``OSError`` (e.g. ``ConnectionError``,
    :class:`Refused`) when no reply came. ``request`` leaves the time to its caller
    (``asyncio.timeout``); ``stream`` takes a connect and a read timeout."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None, *,
                 max_idle: int = MAX_IDLE) -> None:  # fmt: skip
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
        self._max_idle = max_idle

    async def request(
        self, method: str, path: str, body: bytes | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, bytes]:  # fmt: skip
        extra = "" if body is None else f"Content-Type: {content_type}\r\n"
        reply = await self.stream(method, path, body, extra)
        try:
            return reply.status, await reply.read_all()
        finally:
            reply.close()

    async def stream(
        self, method: str, path: str, body: bytes | None = None, headers: str = "", *,
        connect_timeout_s: float | None = None, read_timeout_s: float | None = None,
    ) -> StreamedReply:  # fmt: skip
        """Send the request (``headers``: extra header lines, each ending ``\\r\\n``) and
        read the reply's head: :class:`Refused` when no byte of it came, ``TimeoutError`` when
        none came within ``read_timeout_s`` after the request went out."""
        head = f"{method} {self.base_path}{path} HTTP/1.1\r\n{self._fixed}{headers}"
        if body is not None:
            head += f"Content-Length: {len(body)}\r\n"
        data = (head + "\r\n").encode("latin-1") + (body or b"")
        while self._idle:
            conn = self._idle.pop()
            if not conn.usable():
                conn.close()
                continue
            try:
                return await self._exchange(conn, data, read_timeout_s)
            except _Stale:
                continue  # closed by the server while idle: the next one, or a new one
        try:
            async with asyncio.timeout(connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )  # fmt: skip
        except TimeoutError:
            raise Refused(
                f"no connection to {self.host}:{self.port} in {connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise Refused(f"no connection to {self.host}:{self.port}: {exc}") from exc
        try:
            return await self._exchange(_Connection(reader, writer), data, read_timeout_s)
        except _Stale:
            raise Refused("the server closed the connection before replying") from None

    async def _exchange(
        self, conn: _Connection, data: bytes, read_timeout_s: float | None
    ) -> StreamedReply:
        parse = _Parse()
        received = False
        try:
            conn.writer.write(data)
            while not parse.head_done:
                try:
                    chunk = await _read(conn.reader, read_timeout_s)
                except ConnectionResetError:
                    if not received:
                        raise (
                            _Stale if conn.reused else Refused("reset before any reply byte")
                        ) from None
                    raise
                if not chunk:
                    if not received:
                        raise _Stale if conn.reused else Refused("closed before any reply byte")
                    raise ConnectionResetError("the connection closed inside the reply's head")
                received = True
                _feed(parse, chunk)
        except BaseException:
            conn.close()
            raise
        conn.reused = True
        reply = StreamedReply(self, conn, parse, read_timeout_s)
        if parse.done:
            reply._release()
        return reply

    def release(self, conn: _Connection, keep_alive: bool) -> None:
        """A connection whose reply was read whole: back to the pool if it may serve again."""
        if keep_alive and len(self._idle) < self._max_idle and conn.usable():
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
