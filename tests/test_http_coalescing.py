"""The coordinator's and the node's replies (uvicorn under :mod:`kvatlas.http_guard`) leave in
one ``send`` per turn of the event loop: uvicorn writes a reply's head and its body apart, two
segments on a ``TCP_NODELAY`` socket, and a client (the router's score call) then often woke
and read twice per reply. The transport wrapper on its own (order, close, abort), then a real
guarded server on loopback whose reply's head and body come in one read."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from kvatlas.asgi_thread import free_port, serve
from kvatlas.http_coalescing import CoalescingTransport
from kvatlas.http_limits import HttpLimits
from kvatlas.processes import spawn_service, stop


class Recorder:
    """A transport that records what it was asked to do."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def write_eof(self) -> None:
        self.writes.append(b"<eof>")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default


def _run(check: Any) -> None:
    async def main() -> None:
        recorder = Recorder()
        await check(recorder, CoalescingTransport(recorder, asyncio.get_running_loop()))  # type: ignore[arg-type]

    asyncio.run(main())


def test_the_writes_of_one_turn_leave_in_one_write_in_order() -> None:
    async def check(recorder: Recorder, transport: CoalescingTransport) -> None:
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        transport.write(b"")
        transport.writelines([b"bo", b"dy"])
        assert recorder.writes == [] and transport.get_write_buffer_size() == 42
        await asyncio.sleep(0)  # the turn ends
        assert recorder.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]
        transport.write(b"next")
        await asyncio.sleep(0)
        assert recorder.writes[1:] == [b"next"]
        assert transport.get_extra_info("peername") == ("127.0.0.1", 1)  # the transport's own

    _run(check)


def test_a_large_write_goes_out_at_once_after_what_is_pending_and_is_not_copied() -> None:
    """What passes the bound (64 KiB) is not held to the end of the turn: the transport's own
    flow control sees it at once (uvicorn waits only when the transport paused), and a large
    body is not joined into one more copy."""

    async def check(recorder: Recorder, transport: CoalescingTransport) -> None:
        body = b"x" * (1 << 20)
        transport.write(b"head")
        transport.write(body)
        assert recorder.writes == [b"head", body] and recorder.writes[1] is body
        for _ in range(20):  # small writes of one turn: sent once they pass the bound
            transport.write(b"y" * 4096)
        assert [len(w) for w in recorder.writes[2:]] == [64 * 1024]
        await asyncio.sleep(0)
        assert [len(w) for w in recorder.writes[2:]] == [64 * 1024, 4 * 4096]

    _run(check)


def test_write_eof_sends_what_is_pending_first() -> None:
    async def check(recorder: Recorder, transport: CoalescingTransport) -> None:
        transport.write(b"tail")
        transport.write_eof()
        assert recorder.writes == [b"tail", b"<eof>"]

    _run(check)


def test_close_sends_what_is_pending_first_and_abort_drops_it() -> None:
    async def check(recorder: Recorder, transport: CoalescingTransport) -> None:
        transport.write(b"a 408 reply")
        transport.close()
        assert recorder.writes == [b"a 408 reply"] and recorder.closing
        await asyncio.sleep(0)
        assert recorder.writes == [b"a 408 reply"]  # not twice

    _run(check)

    async def aborted(recorder: Recorder, transport: CoalescingTransport) -> None:
        transport.write(b"never sent")
        transport.abort()
        await asyncio.sleep(0)
        assert recorder.writes == [] and recorder.aborted

    _run(aborted)


def test_nothing_is_written_to_a_transport_that_is_closing() -> None:
    async def check(recorder: Recorder, transport: CoalescingTransport) -> None:
        transport.write(b"late")
        recorder.closing = True  # the connection was lost meanwhile
        await asyncio.sleep(0)
        assert recorder.writes == []

    _run(check)


async def _two_part_reply(scope: Any, receive: Any, send: Any) -> None:
    """An app answering as every ASGI app does: the head, then the body, two messages."""
    if scope["type"] != "http":
        return
    await receive()
    body = b"x" * 300
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"300")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def serve_two_part_replies(port: int) -> None:
    """The guarded server of the test below, in a process of its own."""
    serve(_two_part_reply, host="127.0.0.1", port=port, limits=HttpLimits(), log_level="warning")


def test_a_guarded_servers_reply_comes_in_one_read() -> None:
    """Over a real socket to a server process, on a kept-alive connection: the first read
    after each request holds the whole reply. On the unwrapped transport the head left as a
    segment of its own and the client, woken by it on the other core, read it alone: 19 of
    200 first reads held the whole reply (b0078bf, load ≈5); with the wrapper, 200 of 200."""
    port = free_port()
    code = f"from tests.test_http_coalescing import serve_two_part_replies as s; s({port})"
    proc = spawn_service(["-c", code], f"http://127.0.0.1:{port}")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            for _ in range(50):
                conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                first = conn.recv(65536)
                assert first.startswith(b"HTTP/1.1 200") and first.endswith(
                    b"\r\n\r\n" + b"x" * 300
                )
    finally:
        stop([proc])
