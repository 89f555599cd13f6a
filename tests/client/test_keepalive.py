"""The router's lean HTTP client (``kvatlas.client.keepalive``) against real loopback servers:
connections are reused, a connection the server closed while idle is replaced without the
caller noticing (once, and only for a connection that had served), chunked replies are read
whole, and a caller's timeout closes the connection instead of returning it to the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvatlas.client.keepalive import KeepAliveClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def _serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server on a free port; the list counts its connections."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await handler(reader, writer)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_connections_are_reused_and_chunked_replies_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await _read_request(reader)) is not None:
            assert request.startswith(b"POST /base/route/score HTTP/1.1\r\n")
            assert b"\r\nAuthorization: Bearer t\r\n" in request
            assert request.endswith(b"\r\n\r\n{}")
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
            )

    async def main() -> None:
        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url + "/base/", {"Authorization": "Bearer t"})
        for _ in range(3):
            assert await client.request("POST", "/route/score", b"{}") == (200, b"abcde")
        assert len(connections) == 1
        client.close()
        server.close()

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_is_replaced_once() -> None:
    """The server closes each connection after its reply (as at its keep-alive timeout) without
    saying so: every request still gets its reply, each on a new connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await _read_request(reader) is not None:
            writer.write(_ok(b"{}"))
            await writer.drain()
        writer.close()

    async def main() -> None:
        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        for _ in range(3):
            assert await client.request("GET", "/instances") == (200, b"{}")
            await asyncio.sleep(0.05)  # the close reaches the idle connection
        assert len(connections) == 3
        client.close()
        server.close()

    asyncio.run(main())


def test_a_fresh_connection_closed_before_the_reply_is_an_error_not_a_retry() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()  # no reply at all

    async def main() -> None:
        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        with pytest.raises(ConnectionError):
            await client.request("POST", "/route/score", b"{}")
        assert len(connections) == 1
        server.close()

    asyncio.run(main())


def test_a_timeout_closes_the_connection() -> None:
    """A reply that does not come in time: the caller's timeout cancels the request, and the
    connection (its reply may still arrive) never serves another request."""
    released = asyncio.Event

    async def main() -> None:
        late = released()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await _read_request(reader) is not None:
                if not late.is_set():
                    await late.wait()
                    writer.write(_ok(b"late"))
                else:
                    writer.write(_ok(b"now"))

        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.request("POST", "/route/score", b"{}")
        late.set()
        assert await client.request("POST", "/route/score", b"{}") == (200, b"now")
        assert len(connections) == 2
        client.close()
        server.close()

    asyncio.run(main())
