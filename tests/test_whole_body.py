"""The guarded protocol's whole-body read (:data:`kvatlas.http_guard.WHOLE_BODY`, what
``receive_body`` uses under kvatlas's services) gives what reading through ASGI ``receive``
gives: the same bytes, the same 413 past the limit, ``None`` for a client gone mid-body;
whatever pieces the body came in (Content-Length or chunked, written in many sends, pipelined,
``Expect: 100-continue``). One server on loopback, two paths: ``/whole`` reads with the
extension, ``/receive`` through ``receive`` as any ASGI server offers it."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.config import Config
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.errors import PayloadTooLarge
from kvatlas.http_guard import WHOLE_BODY, guarded_protocol
from kvatlas.http_limits import HttpLimits
from kvatlas.memory_transport import MemoryTransport
from kvatlas.web import receive_body
from tests.helpers import exchange

LIMIT = 300_000


class App:
    """Replies with what it read: the body's length and digest, or the 413's detail; records
    how many times ``receive`` was called and what a request whose client left got."""

    def __init__(self) -> None:
        self.gone: list[object] = []
        self.gone_event = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        calls = 0

        async def counted() -> Any:
            nonlocal calls
            calls += 1
            return await receive()

        whole = scope["path"] == "/whole"
        offered = WHOLE_BODY in (scope.get("extensions") or {})
        status, reply = 200, {}
        try:
            body = await receive_body(counted, LIMIT, scope if whole else None)
        except PayloadTooLarge as exc:
            status, reply = 413, {"detail": exc.detail}
        else:
            if body is None:
                self.gone.append(scope["path"])
                self.gone_event.set()
                return
            reply = {"length": len(body), "sha": hashlib.sha256(body).hexdigest()}
        reply |= {"offered": offered, "receive_calls": calls if whole else None}
        data = json.dumps(reply).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        if status == 413:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[App, int]]:
    app = App()
    port = free_port()
    server = ThreadedServer(app, port=port, name="whole-body", limits=HttpLimits())
    server.start()
    yield app, port
    server.stop()


def _request(path: str, body: bytes, *, chunked: bool, expect: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n"
    if expect:
        head += "Expect: 100-continue\r\n"
    if chunked:
        head += "Transfer-Encoding: chunked\r\n\r\n"
        pieces, at = [], 0
        while at < len(body):
            size = min(len(body) - at, 70_000)
            pieces.append(b"%x\r\n%s\r\n" % (size, body[at : at + size]))
            at += size
        return head.encode() + b"".join(pieces) + b"0\r\n\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _replies(
    port: int, wire: bytes, cuts: list[int], count: int
) -> list[tuple[int, dict[str, Any]]]:
    """Send ``wire`` in pieces cut at ``cuts`` on one connection; read ``count`` replies."""
    replies, _ = exchange(port, wire, cuts, count)
    return [(int(head.split()[1]), json.loads(body)) for head, body in replies]


CASES = [
    pytest.param(0, False, False, id="empty"),
    pytest.param(100, False, False, id="small"),
    pytest.param(250_000, False, False, id="large"),
    pytest.param(250_000, True, False, id="large-chunked"),
    pytest.param(200_000, False, True, id="expect-100-continue"),
    pytest.param(LIMIT, True, False, id="at-the-limit-chunked"),
    pytest.param(LIMIT + 1, True, False, id="over-the-limit-chunked"),
]


@pytest.mark.parametrize(("size", "chunked", "expect"), CASES)
def test_the_whole_body_read_equals_the_receive_read(
    served: tuple[App, int], size: int, chunked: bool, expect: bool
) -> None:
    _, port = served
    rng = random.Random(size)
    body = rng.randbytes(size)
    answers = []
    for path in ("/whole", "/receive"):
        wire = _request(path, body, chunked=chunked, expect=expect)
        cuts = [rng.randrange(len(wire)) for _ in range(12)]
        (answer,) = _replies(port, wire, cuts, 1)
        answers.append(answer)
    (status, whole), (status_r, plain) = answers
    assert status == status_r == (413 if size > LIMIT else 200)
    assert whole.pop("offered") is True and whole.pop("receive_calls") == 0  # never ``receive``
    plain.pop("receive_calls")
    assert plain.pop("offered") is True
    assert whole == plain
    if status == 200:
        assert whole == {"length": size, "sha": hashlib.sha256(body).hexdigest()}
    else:
        assert whole == {"detail": f"body exceeds {LIMIT} bytes"}


def test_pipelined_requests_each_get_their_own_body(served: tuple[App, int]) -> None:
    _, port = served
    bodies = [random.Random(i).randbytes(n) for i, n in enumerate((90_000, 10, 150_000))]
    wire = b"".join(
        _request(path, b, chunked=False) for b in bodies for path in ("/whole", "/receive")
    )
    replies = _replies(port, wire, [len(wire) // 3], 6)
    assert [status for status, _ in replies] == [200] * 6
    got = [(r["length"], r["sha"]) for _, r in replies]
    want = [(len(b), hashlib.sha256(b).hexdigest()) for b in bodies for _ in range(2)]
    assert got == want


def test_a_client_gone_mid_body_reads_as_none(served: tuple[App, int]) -> None:
    app, port = served
    app.gone_event.clear()
    head = b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head + b"x" * 40_000)
    assert app.gone_event.wait(10)
    assert app.gone[-1] == "/whole"


def _post_in_memory(
    app: App, path: str, body: bytes, pieces: list[int], *, guarded: bool = True
) -> tuple[int, int]:
    """``body`` posted to ``app`` behind the guarded protocol (``guarded``; else uvicorn's
    own) without sockets, the request's bytes handed over cut at ``pieces``: the reply's
    status and the peak of memory allocated while it was served, beyond what was allocated
    before."""
    protocol_class = (
        guarded_protocol(HttpLimits(), lambda _reason: None) if guarded else AutoHTTPProtocol
    )
    config = Config(app, lifespan="off", log_level="warning", http=protocol_class)
    config.load()
    loop = asyncio.new_event_loop()
    transport = MemoryTransport()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    wire = _request(path, body, chunked=False)
    parts = [wire[a:b] for a, b in itertools.pairwise([0, *sorted(pieces), len(wire)])]

    async def post() -> int:
        protocol.connection_made(transport)
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        for part in parts:
            protocol.data_received(part)
            await asyncio.sleep(0)
        while not transport.written:
            await asyncio.sleep(0)
        return tracemalloc.get_traced_memory()[1] - start

    tracemalloc.start()
    try:
        peak = loop.run_until_complete(post())
    finally:
        tracemalloc.stop()
        loop.close()
    return int(transport.written[0].split()[1]), peak


def test_a_body_in_one_piece_is_not_copied_on_its_way_to_the_app() -> None:
    """The parser's ``bytes`` of a body that came in one read reach the app as they are,
    through the extension or ``receive``: uvicorn's own protocol copies them into a buffer and
    out of it again (another body's worth of memory at once, and the copies' time). The peak
    while serving a body stays below 1.5 bodies."""
    app = App()
    body = random.Random(7).randbytes(LIMIT - 1000)
    status, peak = _post_in_memory(app, "/whole", body, [])
    assert status == 200
    assert peak < 1.5 * len(body), peak
    status, peak = _post_in_memory(app, "/receive", body, [])
    assert status == 200
    assert peak < 1.5 * len(body), peak  # ``receive`` takes the one piece as it is too
    status, peak = _post_in_memory(app, "/receive", body, [], guarded=False)
    assert status == 200 and peak >= 1.5 * len(body)  # the control: uvicorn's own copies


@settings(max_examples=60, deadline=None)
@given(
    body=st.binary(min_size=0, max_size=3000),
    cuts=st.lists(st.integers(0, 4000), max_size=6),
    path=st.sampled_from(["/whole", "/receive"]),
)
def test_any_cut_of_a_body_reads_the_same_in_memory(
    body: bytes, cuts: list[int], path: str
) -> None:
    """Whatever pieces a request comes in (the body kept as pieces until the app asks), both
    reads give the body's bytes."""
    app = Recorder()
    wire_len = len(_request(path, body, chunked=False))
    status, _ = _post_in_memory(app, path, body, [c for c in cuts if c < wire_len])
    assert status == 200
    assert app.bodies == [body]


class Recorder(App):
    """:class:`App` that also keeps each body it read."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            whole = scope["path"] == "/whole"
            self.bodies.append(await receive_body(receive, LIMIT, scope if whole else None) or b"")
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("cut", [40, 10_000, 100_000, 150_000])
def test_a_large_body_is_read_straight_into_its_bytes(
    served: tuple[App, int], direct_reads: list[bool], cut: int
) -> None:
    """Past what came before the app asked, a body whose length the headers declare is read
    by the socket into the ``bytes`` the app gets (``kvatlas.http_body``): the same bytes,
    and the request pipelined right behind it is the next one's (read only once the body is
    complete, by the parser again)."""
    _, port = served
    body = random.Random(cut).randbytes(LIMIT - 10)
    after = b"after"
    wire = _request("/whole", body, chunked=False) + _request("/whole", after, chunked=False)
    cuts = [cut, cut + 70_000, len(wire) - 100]
    replies, _ = exchange(port, wire, cuts, 2, pause=0.1)
    assert [(int(h.split()[1]), json.loads(b)["sha"]) for h, b in replies] == [
        (200, hashlib.sha256(body).hexdigest()),
        (200, hashlib.sha256(after).hexdigest()),
    ]
    assert direct_reads[0] is True  # the control: the case under test was the direct read


def test_a_body_declared_past_the_limit_is_not_read_directly(
    served: tuple[App, int], direct_reads: list[bool]
) -> None:
    """The ``bytes`` is as long as the declared length: never made for a length past the
    app's limit (413 as before, from what came)."""
    _, port = served
    wire = _request("/whole", b"y" * (LIMIT + 100_000), chunked=False)
    ((head, payload),), _ = exchange(port, wire, [100], 1, pause=0.1)
    assert head.startswith(b"HTTP/1.1 413") and b"exceeds" in payload
    assert True not in direct_reads


def test_a_client_gone_mid_direct_body_reads_as_none(
    served: tuple[App, int], direct_reads: list[bool]
) -> None:
    app, port = served
    app.gone_event.clear()
    head = b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 290000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head + b"x" * 1000)
        time.sleep(0.1)
        conn.sendall(b"x" * 100_000)
        time.sleep(0.1)
    assert app.gone_event.wait(10)
    assert app.gone[-1] == "/whole"
    assert direct_reads == [True]


def test_what_follows_a_direct_body_is_parsed_afresh(
    served: tuple[App, int], direct_reads: list[bool]
) -> None:
    """The parser that takes over after a body read directly starts at the next request, as
    at a connection's start: bytes that are no request are a 400 (and the close), the
    body's reply having gone first."""
    _, port = served
    body = random.Random(5).randbytes(LIMIT - 10)
    garbage = b"NOT HTTP AT ALL\r\n\r\n"  # (sent after the body's reply: uvicorn answers a
    wire = _request("/whole", body, chunked=False) + garbage  # bad request at once, and closes)
    cuts = [100, len(wire) - len(garbage)]
    replies, closed = exchange(port, wire, cuts, 2, linger=10, pause=0.3)
    assert [head.split()[1] for head, _ in replies] == [b"200", b"400"]
    assert json.loads(replies[0][1])["sha"] == hashlib.sha256(body).hexdigest()
    assert closed and direct_reads[0] is True


def test_the_direct_read_on_asyncios_own_event_loop(direct_reads: list[bool]) -> None:
    """The services run on uvloop; asyncio's selector transport changes protocols too (to a
    ``BufferedProtocol`` and back), so a server on asyncio's loop reads the same bytes."""
    port = free_port()
    config = uvicorn.Config(
        App(), host="127.0.0.1", port=port, lifespan="off", loop="asyncio", log_level="warning",
        http=guarded_protocol(HttpLimits(), lambda _reason: None),
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="whole-body-asyncio", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        body = random.Random(11).randbytes(LIMIT - 10)
        wire = _request("/whole", body, chunked=False) + _request("/whole", b"next", chunked=False)
        replies, _ = exchange(port, wire, [100, 70_000, len(wire) - 100], 2, pause=0.1)
    finally:
        server.should_exit = True
        thread.join(10)
    assert [json.loads(payload)["sha"] for _, payload in replies] == [
        hashlib.sha256(body).hexdigest(),
        hashlib.sha256(b"next").hexdigest(),
    ]
    assert direct_reads[0] is True
