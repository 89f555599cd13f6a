"""Requests answered in turn (``Route.in_turn``, :class:`kvatlas.http_guard.AnswersInTurn`):
the guarded protocol hands a request whose route may answer it to the dispatcher the moment
its body is complete, without an ASGI cycle. What a client sees must not change: the same
bytes as the ASGI path's reply, every body whatever pieces it came in, pipelined requests in
order, the ASGI path for what the route declines or the protocol does not take (chunked,
``Expect: 100-continue``), errors rendered as the dispatcher's, a connection kept alive while a
pipelined request behind an answer in turn is still being answered. One real server on
loopback, the dispatcher of a small route table, a keep-alive timeout of a fraction of a
second."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from kvatlas.asgi_thread import free_port
from kvatlas.dispatch import Dispatcher
from kvatlas.errors import InvalidInput
from kvatlas.http_guard import guarded_protocol
from kvatlas.http_limits import HttpLimits
from kvatlas.logs import uvicorn_log_options
from kvatlas.memory_transport import MemoryTransport
from kvatlas.routing import OPEN, Call, Reply, Route, RouteTable
from tests.helpers import exchange

LIMIT = 300_000
KEEP_ALIVE_S = 2.0
STILL_OPEN_S = 0.5  # how long a connection must stay open to count as kept (< KEEP_ALIVE_S)
BODY_TIMEOUT_S = 1.0


def _reply(call: Call[None, None], path: str) -> Reply:
    raw = call.raw
    digest = hashlib.sha256(raw).hexdigest()
    payload = json.dumps({"length": len(raw), "sha": digest}).encode()
    return Reply(payload, headers=((b"x-answered", path.encode()),))


def _in_turn(ctx: list[str], call: Call[None, None]) -> Reply | None:
    raw = call.raw
    if raw.startswith((b"decline", b"slow")):
        return None
    if raw == b"bad":
        raise InvalidInput("a bad body")
    if raw == b"bug":
        raise RuntimeError("a bug")
    ctx.append("in_turn")
    return _reply(call, "in_turn")


async def _handler(ctx: list[str], call: Call[None, None]) -> Reply:
    if call.raw.startswith(b"slow"):
        await asyncio.sleep(1.5 * KEEP_ALIVE_S)
    ctx.append("handler")
    return _reply(call, "in_turn" if call.raw.startswith(b"decline-same") else "handler")


TABLE = RouteTable(
    (
        Route(
            "POST",
            "/turn",
            OPEN,
            _handler,
            request=bytes,
            body=lambda _b: LIMIT,
            in_turn=_in_turn,
        ),
        Route("POST", "/plain", OPEN, _handler, request=bytes, body=lambda _b: LIMIT),
    )
)


@contextmanager
def _serving(
    answered: list[str],
    level: str,
    access_log: bool,
    limits: HttpLimits | None = None,
    refused: list[str] | None = None,
) -> Iterator[int]:
    """The dispatcher of :data:`TABLE` on a real server with these log settings and the
    guard's ``limits`` (the body timeout :data:`BODY_TIMEOUT_S`; what it refuses appended to
    ``refused``); its port."""
    app = Dispatcher(answered, TABLE, None, frozenset(), lambda r: LIMIT, 1024)
    port = free_port()
    limits = dataclasses.replace(limits or HttpLimits(), body_timeout_s=BODY_TIMEOUT_S)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
        http=guarded_protocol(limits, (refused if refused is not None else []).append),
        **uvicorn_log_options(level, access_log=access_log),
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="kvatlas-in-turn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[list[str], int]]:
    """The services' settings (``logs.uvicorn_log_options``: no access log, whose lines only
    the ASGI path writes), a short keep-alive timeout."""
    answered: list[str] = []
    with _serving(answered, "warning", access_log=False) as port:
        yield answered, port


def _request(path: str, body: bytes, *, chunked: bool = False, head: str = "") -> bytes:
    start = f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}"
    if chunked:
        return (start + "Transfer-Encoding: chunked\r\n\r\n").encode() + (
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        )
    return (start + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _digest(body: bytes) -> dict[str, Any]:
    return {"length": len(body), "sha": hashlib.sha256(body).hexdigest()}


@pytest.mark.parametrize("size", [0, 1, 1000, 65_536, 200_000, LIMIT])
def test_every_body_is_answered_in_turn_whatever_pieces_it_came_in(
    served: tuple[list[str], int], size: int
) -> None:
    """Bodies past uvicorn's 64 KiB mark arrive in pieces: the protocol must not pause reading
    for an app that is not asking (the body would never complete)."""
    answered, port = served
    rng = random.Random(size)
    body = rng.randbytes(size)
    wire = _request("/turn", body)
    answered.clear()
    (reply,), _ = exchange(port, wire, [rng.randrange(len(wire)) for _ in range(8)], 1)
    head, payload = reply
    assert head.startswith(b"HTTP/1.1 200 OK") and b"x-answered: in_turn" in head
    assert json.loads(payload) == _digest(body)
    assert answered == ["in_turn"]


def test_an_answer_in_turn_is_the_asgi_paths_reply_byte_for_byte(
    served: tuple[list[str], int],
) -> None:
    """``decline-same``: the route declines and its handler sends the very same Reply."""
    answered, port = served
    answered.clear()
    body = b"decline-same" + b"x" * 20
    ((asgi_head, asgi_body),), _ = exchange(port, _request("/turn", body), [], 1)
    (turn,), _ = exchange(port, _request("/turn", body[len(b"decline-same") :]), [], 1)
    assert answered == ["handler", "in_turn"]
    assert json.loads(asgi_body)["length"] == len(body)
    # the payloads differ in their digest only (same length); uvicorn's date may have ticked
    assert _undated(asgi_head) == _undated(turn[0])
    assert b"\r\ndate: " in asgi_head and b"\r\nserver: uvicorn" in turn[0]


def _undated(head: bytes) -> list[bytes]:
    return [line for line in head.split(b"\r\n") if not line.startswith(b"date: ")]


def test_pipelined_requests_are_answered_in_order_by_whichever_path(
    served: tuple[list[str], int],
) -> None:
    answered, port = served
    answered.clear()
    bodies = [b"a" * 10, b"decline" + b"b" * 70_000, b"c" * 90_000, b"", b"decline"]
    wire = b"".join(_request("/turn", b) for b in bodies) + _request("/plain", b"d")
    replies, closed = exchange(port, wire, [len(wire) // 3], len(bodies) + 1, linger=STILL_OPEN_S)
    assert [json.loads(p) for _, p in replies] == [_digest(b) for b in [*bodies, b"d"]]
    # a request parsed while the one before it is still an ASGI cycle waits for it, and is
    # then an ASGI cycle too: which of the last ones come in turn is the network's timing
    assert answered[:2] == ["in_turn", "handler"] and answered[-1] == "handler"
    assert [p.split(b"x-answered: ")[1].split(b"\r\n")[0] for p, _ in replies[:2]] == [
        b"in_turn",
        b"handler",
    ]
    assert not closed


def test_one_read_of_many_requests_is_not_all_answered_in_turn(
    served: tuple[list[str], int],
) -> None:
    """Only the first request of a read is answered in turn: the rest go the ASGI way, taking
    turns with other connections' requests (60 small lookups in one read would otherwise hold
    the loop for all 60)."""
    answered, port = served
    answered.clear()
    wire = b"".join(_request("/turn", b"k%d" % i) for i in range(60))
    replies, _ = exchange(port, wire, [], 60)
    assert [json.loads(p) for _, p in replies] == [_digest(b"k%d" % i) for i in range(60)]
    assert answered[0] == "in_turn" and answered.count("in_turn") < 10


@pytest.mark.parametrize(
    ("chunked", "head"),
    [(True, ""), (False, "Expect: 100-continue\r\n")],
    ids=["chunked", "expect-100-continue"],
)
def test_what_the_protocol_does_not_take_goes_the_asgi_way(
    served: tuple[list[str], int], chunked: bool, head: str
) -> None:
    answered, port = served
    answered.clear()
    body = b"e" * 5000
    ((reply_head, payload),), _ = exchange(
        port, _request("/turn", body, chunked=chunked, head=head), [], 1
    )
    assert json.loads(payload) == _digest(body)
    assert answered == ["handler"] and b"x-answered: handler" in reply_head


def test_over_the_routes_limit_is_refused_by_the_dispatcher(
    served: tuple[list[str], int],
) -> None:
    answered, port = served
    answered.clear()
    wire = b"POST /turn HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1)
    ((head, payload),), _ = exchange(port, wire, [], 1)
    assert head.startswith(b"HTTP/1.1 413") and answered == []
    assert "exceeds" in json.loads(payload)["detail"]


def test_errors_in_turn_are_the_dispatchers(served: tuple[list[str], int]) -> None:
    _, port = served
    ((head, payload),), closed = exchange(
        port, _request("/turn", b"bad"), [], 1, linger=STILL_OPEN_S
    )
    assert head.startswith(b"HTTP/1.1 400") and json.loads(payload) == {"detail": "a bad body"}
    assert not closed
    ((head, payload),), closed = exchange(port, _request("/turn", b"bug"), [], 1, linger=30)
    assert head.startswith(b"HTTP/1.1 500") and b"connection: close" in head
    assert payload == b"Internal Server Error" and closed


def test_http_1_0_is_answered_and_closed(served: tuple[list[str], int]) -> None:
    _, port = served
    wire = _request("/turn", b"f" * 10).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    ((head, payload),), closed = exchange(port, wire, [], 1, linger=30)
    assert b"connection: close" in head and json.loads(payload) == _digest(b"f" * 10)
    assert closed


def test_a_request_pipelined_behind_an_answer_in_turn_outlives_the_keep_alive_timeout(
    served: tuple[list[str], int],
) -> None:
    """The answer in turn arms uvicorn's idle timer (as the end of any reply does); the
    request parsed right after it in the same read (``slow``: answered 1.5 times that
    timeout) must not find its connection closed."""
    _, port = served
    wire = _request("/turn", b"g") + _request("/turn", b"slow")
    replies, _ = exchange(port, wire, [], 2)
    assert [json.loads(p) for _, p in replies] == [_digest(b"g"), _digest(b"slow")]


def test_a_body_that_stops_coming_is_a_408_as_on_the_asgi_path(
    served: tuple[list[str], int],
) -> None:
    """The guard's body timer watches a request waiting to be answered in turn as any other
    (``--http-body-timeout-s``: a client dripping or stalling a body is closed)."""
    answered, port = served
    answered.clear()
    wire = _request("/turn", b"j" * 100_000)[:50_000]
    ((head, payload),), closed = exchange(port, wire, [], 1, linger=30)
    assert head.startswith(b"HTTP/1.1 408") and b"not received in time" in payload
    assert closed and answered == []


def test_an_idle_connection_still_closes_after_the_keep_alive_timeout(
    served: tuple[list[str], int],
) -> None:
    _, port = served
    _, closed = exchange(port, _request("/turn", b"h"), [], 1, linger=30)
    assert closed


@pytest.mark.parametrize(("path", "way"), [("/turn", "in_turn"), ("/plain", "handler")])
def test_a_busy_connection_outlives_the_header_timeout(path: str, way: str) -> None:
    """``--http-header-timeout-s`` counts from the previous reply: requests sent every
    0.3 s on one connection for three times a header timeout of 1 s are all answered, by
    either path. (The header timer armed after the first reply was never reset by answers in
    turn: a client looking up steadily on one connection was closed every timeout, and a
    request it sent then was lost.)"""
    answered: list[str] = []
    with (
        _serving(answered, "warning", False, HttpLimits(header_timeout_s=1.0)) as port,
        socket.create_connection(("127.0.0.1", port), timeout=10) as conn,
    ):
        for k in range(10):
            conn.sendall(_request(path, b"k%d" % k))
            head = conn.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), f"request {k}: {head[:60]!r}"
            time.sleep(0.3)
    assert answered == [way] * 10


@pytest.mark.parametrize(
    ("header_s", "partial", "closed_after", "counted"),
    [
        (10.0, False, KEEP_ALIVE_S, []),  # idle after a reply: uvicorn's keep-alive, quiet
        (1.0, False, 1.0, ["header_timeout"]),  # a shorter header timeout ends it first
        (4.0, True, 4.0, ["header_timeout"]),  # bytes came: the header timeout, from the reply
    ],
)
def test_after_a_reply_the_first_of_keep_alive_and_header_timeout_closes(
    header_s: float, partial: bool, closed_after: float, counted: list[str]
) -> None:
    """After a reply, a connection is closed at the keep-alive timeout (``timeout_keep_alive``,
    :data:`KEEP_ALIVE_S`: not a refusal) while no byte of a next request came, and at the
    header timeout from that reply (counted ``header_timeout``), whichever comes first; bytes
    of a next request end the keep-alive wait. One timer of the guard's does both (uvicorn's
    own was armed and cancelled for every request)."""
    refused: list[str] = []
    with (
        _serving([], "warning", False, HttpLimits(header_timeout_s=header_s), refused) as port,
        socket.create_connection(("127.0.0.1", port), timeout=30) as conn,
    ):
        conn.sendall(_request("/turn", b"q"))
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        replied = time.monotonic()
        if partial:
            conn.sendall(b"POST /turn HTTP/1.1\r\nHo")
        if closed_after > KEEP_ALIVE_S:  # still open past the keep-alive timeout
            time.sleep(KEEP_ALIVE_S + 0.5)
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1)
            conn.setblocking(True)
        assert conn.recv(1) == b""  # closed (the socket's timeout: 30 s)
        assert time.monotonic() - replied >= closed_after - 0.1
    assert refused == counted


def test_no_timer_is_armed_for_each_request() -> None:
    """Requests answered back to back on one connection arm no timer each: the guard's idle
    timer, armed once, stays (uvicorn armed and cancelled its keep-alive timer for every
    reply: ≈5 µs of a blend lookup's server CPU, docs/performance.md)."""
    app = Dispatcher([], TABLE, None, frozenset(), lambda r: LIMIT, 1024)
    protocol_class = guarded_protocol(HttpLimits(), lambda _reason: None)
    config = uvicorn.Config(app, lifespan="off", http=protocol_class,
                            **uvicorn_log_options("warning", access_log=False))  # fmt: skip
    config.load()
    loop = asyncio.new_event_loop()
    armed: list[float] = []
    call_later = loop.call_later

    def counted(delay: float, *args: Any) -> asyncio.TimerHandle:
        armed.append(delay)
        return call_later(delay, *args)

    loop.call_later = counted  # type: ignore[method-assign]
    transport = MemoryTransport()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)

    async def post(n: int) -> None:
        if n == 1:
            protocol.connection_made(transport)
        for k in range(n):
            protocol.data_received(_request("/turn", b"r%d" % k))
            await asyncio.sleep(0)

    try:
        loop.run_until_complete(post(1))
        before = len(armed)
        loop.run_until_complete(post(20))
    finally:
        loop.close()
    assert b"".join(transport.written).count(b"HTTP/1.1 200") == 21
    assert len(armed) == before  # (the old code: one more a request)


def test_the_body_is_not_kept_past_its_answer() -> None:
    """The cycle of the last request lives until the next one: an answered body held by it
    (175 KB a blend lookup, a connection each) would fault fresh heap pages in at every
    request (measured: 0.5 faults a lookup under load)."""
    answered: list[str] = []
    app = Dispatcher(answered, TABLE, None, frozenset(), lambda r: LIMIT, 1024)
    protocol_class = guarded_protocol(HttpLimits(), lambda _reason: None)
    config = uvicorn.Config(app, lifespan="off", http=protocol_class,
                            **uvicorn_log_options("warning", access_log=False))  # fmt: skip
    config.load()
    loop = asyncio.new_event_loop()
    transport = MemoryTransport()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)

    async def post() -> None:
        protocol.connection_made(transport)
        protocol.data_received(_request("/turn", b"i" * 100_000))
        await asyncio.sleep(0)

    try:
        loop.run_until_complete(post())
    finally:
        loop.close()
    assert answered == ["in_turn"] and b"".join(transport.written).startswith(b"HTTP/1.1 200")
    assert len(protocol.cycle.body) == 0


def test_an_access_log_being_written_takes_the_asgi_path(caplog: pytest.LogCaptureFixture) -> None:
    """``--access-log`` at ``--log-level info``: only uvicorn's ``send`` writes access lines,
    so no request is answered in turn and every one has its line."""
    access = logging.getLogger("uvicorn.access")
    saved = (access.level, access.propagate, list(access.handlers))
    answered: list[str] = []
    try:
        with (
            caplog.at_level(logging.INFO, "uvicorn.access"),
            _serving(answered, "info", True) as port,
        ):
            replies, _ = exchange(port, _request("/turn", b"l"), [], 1)
    finally:
        access.level, access.propagate, access.handlers = saved
    assert json.loads(replies[0][1]) == _digest(b"l") and answered == ["handler"]
    assert any('"POST /turn HTTP/1.1" 200' in r.getMessage() for r in caplog.records)


def test_a_large_body_answered_in_turn_is_read_straight_into_its_bytes(
    served: tuple[list[str], int], direct_reads: list[bool]
) -> None:
    """The rest of a body past its first read goes by the socket into the ``bytes`` the
    route answers from; the request pipelined right behind it is the next one."""
    answered, port = served
    answered.clear()
    body = random.Random(3).randbytes(LIMIT)
    wire = _request("/turn", body) + _request("/turn", b"next")
    replies, _ = exchange(port, wire, [200, 90_000, len(wire) - 50], 2, pause=0.1)
    assert [json.loads(payload) for _, payload in replies] == [_digest(body), _digest(b"next")]
    assert answered == ["in_turn", "in_turn"]
    assert direct_reads[0] is True  # the control: the case under test was the direct read


def test_a_body_read_directly_that_stops_coming_is_a_408(
    served: tuple[list[str], int], direct_reads: list[bool]
) -> None:
    answered, port = served
    answered.clear()
    wire = _request("/turn", b"k" * LIMIT)[:150_000]
    ((head, payload),), closed = exchange(port, wire, [300], 1, linger=30, pause=0.1)
    assert head.startswith(b"HTTP/1.1 408") and b"not received in time" in payload
    assert closed and answered == []
    assert direct_reads == [True]
