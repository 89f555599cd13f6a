"""The router's lean HTTP client (``kvatlas.client.keepalive``) against real loopback servers:
connections are reused, a connection the server closed while idle is replaced without the
caller noticing (once, and only for a connection that had served), chunked replies are read
whole, and a caller's timeout closes the connection instead of returning it to the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvatlas.client.keepalive import KeepAliveClient, Refused

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


# ---------------------------------------------------------------------------- streamed replies


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_a_streamed_reply_comes_piece_by_piece_and_its_connection_is_reused() -> None:
    """Chunked server-sent events: the first event reaches the caller while the server still
    holds the rest (nothing buffered), the framing is removed, and the connection serves the
    next request (a Content-Length reply, also read as it comes)."""

    async def main() -> None:
        go_on = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b"data: 1\n\n"))  # fmt: skip
            await go_on.wait()
            writer.write(_chunk(b"data: 2\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await _read_request(reader)
            writer.write(_ok(b"whole"))
            await writer.drain()

        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        reply = await client.stream("POST", "/v1/completions", b"{}", "accept: */*\r\n")
        assert (reply.status, reply.header(b"content-type")) == (200, b"text/event-stream")
        assert await reply.read_some() == b"data: 1\n\n"  # the server still holds the rest
        go_on.set()
        assert await reply.read_all() == b"data: 2\n\ndata: [DONE]\n\n"
        assert reply.complete
        reply.close()  # a whole reply: back to the pool, not closed
        second = await client.stream("POST", "/v1/completions", b"{}")
        assert (second.header(b"content-length"), await second.read_all()) == (b"5", b"whole")
        assert len(connections) == 1
        client.close()
        server.close()

    asyncio.run(main())


def test_a_body_delimited_by_the_close_is_read_to_its_end() -> None:
    """No Content-Length, no chunking (HTTP/1.0 style): the close ends the body; the
    connection is not reused."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"part two")
        writer.close()

    async def main() -> None:
        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        for _ in range(2):
            assert await client.request("POST", "/x", b"{}") == (200, b"part one, part two")
        assert len(connections) == 2
        client.close()
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nonly this\r\n",
    ],
    ids=["content-length", "chunked"],
)
def test_a_reply_cut_mid_body_is_an_error_not_a_hang_nor_an_end(reply: bytes) -> None:
    """The server dies after part of the body: the caller gets what came, then an error (not
    ``b""``, which would pass a cut reply off as complete)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(reply)
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, url, _ = await _serve(handler)
        client = KeepAliveClient(url)
        streamed = await client.stream("POST", "/v1/completions", b"{}", read_timeout_s=10)
        assert await streamed.read_some() == b"only this"
        with pytest.raises(ConnectionError):
            await streamed.read_some()
        assert not streamed.complete
        assert client._idle == []
        server.close()

    asyncio.run(main())


def test_refusals_before_any_reply_byte_are_refused() -> None:
    """A port nobody listens on, a connect not made in time, and a server that closes a fresh
    connection without a byte: each :class:`Refused` (the caller may try another server)."""

    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    async def main() -> None:
        server, url, _ = await _serve(closes)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(Refused):
            await KeepAliveClient(url).stream("POST", "/v1/completions", b"{}")
        server.close()
        await server.wait_closed()
        with pytest.raises(Refused):  # nobody listens there any more
            await KeepAliveClient(f"http://127.0.0.1:{port}").stream("GET", "/")
        with pytest.raises(Refused):  # no time at all to connect
            await KeepAliveClient(url).stream("GET", "/", connect_timeout_s=0)

    asyncio.run(main())


def test_a_read_timeout_before_the_head_or_between_pieces_closes_the_connection() -> None:
    """No head within the read timeout: ``TimeoutError`` (not :class:`Refused`: the request
    went out and the server may be working on it); a stream that stalls between pieces:
    ``TimeoutError`` after the pieces that came. The connection never serves again."""

    async def main() -> None:
        stall = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (request := await _read_request(reader)) is not None:
                if b"/silent" in request:
                    await stall.wait()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + _chunk(b"first"))  # fmt: skip
                await stall.wait()

        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        with pytest.raises(TimeoutError):
            await client.stream("POST", "/silent", b"{}", read_timeout_s=0.2)
        reply = await client.stream("POST", "/stall", b"{}", read_timeout_s=0.2)
        assert await reply.read_some() == b"first"
        with pytest.raises(TimeoutError):
            await reply.read_some()
        assert client._idle == [] and len(connections) == 2
        stall.set()
        server.close()

    asyncio.run(main())


def test_an_interim_reply_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await _read_request(reader) is not None:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b"0123456789"))

    async def main() -> None:
        server, url, connections = await _serve(handler)
        client = KeepAliveClient(url)
        reply = await client.stream("POST", "/x", b"{}")
        assert (reply.status, reply.header(b"content-length")) == (200, b"10")
        reply.close()  # the body came with the head: the reply is whole, the connection kept
        assert len(client._idle) == 1
        reply = await client.stream("POST", "/x", b"{}")
        assert await reply.read_all() == b"0123456789"
        assert len(connections) == 1
        client.close()
        server.close()

    asyncio.run(main())
