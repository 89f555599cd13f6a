"""The pieces of :mod:`kvatlas.http_body` on their own: the declared length a direct read
trusts, the ``bytes`` it fills, and what its stand-in protocol passes on. Over real sockets:
``tests/test_whole_body.py`` and ``tests/test_answer_in_turn.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvatlas.http_body import DirectBody, declared_length, fresh_bytes, read_rest_directly
from kvatlas.memory_transport import MemoryTransport


@pytest.mark.parametrize(
    ("headers", "length"),
    [
        ([(b"content-length", b"123")], 123),
        ([(b"host", b"x"), (b"content-length", b"0")], 0),
        ([], None),
        ([(b"content-length", b"12"), (b"content-length", b"12")], None),  # twice: the parser's
        ([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")], None),
        ([(b"transfer-encoding", b"chunked"), (b"content-length", b"5")], None),
        ([(b"content-length", b"+5")], None),
        ([(b"content-length", b"-1")], None),
        ([(b"content-length", b"1e3")], None),
        ([(b"content-length", b"")], None),
    ],
)
def test_only_one_plain_content_length_is_a_declared_length(
    headers: list[tuple[bytes, bytes]], length: int | None
) -> None:
    assert declared_length(headers) == length


def test_fresh_bytes_are_filled_through_their_view() -> None:
    body, view = fresh_bytes(100_000)
    assert type(body) is bytes and len(body) == len(view) == 100_000 and not view.readonly
    data = bytes(range(256)) * 390 + b"end" * 53 + b"!"
    view[:] = data
    assert body == data and hash(body) == hash(data)


class Owner(asyncio.Protocol):
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append(("lost", exc))

    def eof_received(self) -> bool | None:
        self.calls.append("eof")
        return True

    def pause_writing(self) -> None:
        self.calls.append("pause")

    def resume_writing(self) -> None:
        self.calls.append("resume")


def test_the_stand_in_fills_the_body_then_hands_it_over_and_passes_the_rest_on() -> None:
    owner, pieces, done = Owner(), list[int](), list[bytes]()
    body, view = fresh_bytes(10)
    view[:3] = b"abc"
    reader = DirectBody(owner, body, view, 3, lambda: pieces.append(1), done.append)
    buf = reader.get_buffer(65536)
    assert len(buf) == 7  # never more than is missing: the next request stays in the socket
    buf[:4] = b"defg"
    reader.buffer_updated(4)
    assert pieces == [1] and done == []
    reader.get_buffer(65536)[:] = b"hij"
    reader.buffer_updated(3)
    assert done == [b"abcdefghij"] and done[0] is body and pieces == [1]
    reader.pause_writing()
    reader.resume_writing()
    assert reader.eof_received() is True
    reader.connection_lost(None)
    assert owner.calls == ["pause", "resume", "eof", ("lost", None)]


class Switching(MemoryTransport):
    """A transport in memory that changes protocols (as uvloop's and asyncio's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.protocols: list[asyncio.BaseProtocol] = []

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocols.append(protocol)


def test_a_transport_that_cannot_change_protocols_keeps_the_parser() -> None:
    """A transport in memory (tests, benchmarks) cannot: the parser reads the body. One that
    can gets the stand-in, the pieces already there copied into the body's bytes."""
    owner = Owner()
    args = (owner, 1 << 20, [b"x" * 10], lambda: None, lambda _body: None)
    assert not read_rest_directly(MemoryTransport(), *args)
    switching = Switching()
    assert read_rest_directly(switching, *args)  # the control
    (reader,) = switching.protocols
    assert isinstance(reader, DirectBody) and reader.filled == 10 and reader.owner is owner
    assert reader.body is not None and reader.body[:10] == b"x" * 10
