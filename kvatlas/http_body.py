"""How the HTTP guard (:mod:`kvatlas.http_guard`) keeps a request's body: the parser's pieces
as they came (:class:`Pieces`, :class:`Collecting`), and a large body's rest read by the socket
straight into the ``bytes`` the app gets (:func:`read_rest_directly`).

Why the direct read: a body that reaches the app through the event loop and the parser is
copied twice before anyone reads it (the loop makes a ``bytes`` of each read, the parser a
``bytes`` of each piece of body in it) and a third time when the pieces are joined. For a
1.8 MB ``POST /events`` these copies were a third of the event loop's CPU, ≈6% of a JSON
entry's (docs/performance.md, "Service: design figures"). Once a request's
headers say how long its body is and that length is admitted (the route's limit), the rest
is read by the transport into one ``bytes`` of that length (an ``asyncio.BufferedProtocol``
standing in for the HTTP protocol until the body is complete): the kernel's copy from the
socket is the only one. The parser, which has not seen those bytes, is replaced by a fresh
one, as at the start of a connection; the body then reaches the protocol as one piece, and
the request goes on as if the parser had handed it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvatlas.errors import PayloadTooLarge

DIRECT_MIN: Final = 64 * 1024
"""Bodies with fewer bytes than this still to come go through the parser: for them a switch
of protocols costs more than the copies it saves (uvicorn pauses a body's reading past 64 KiB
until the app asks for it: what came before is copied into the ``bytes`` once)."""


def body_too_large(max_bytes: int) -> PayloadTooLarge:
    """The error of a body found longer than ``max_bytes`` while it was read."""
    return PayloadTooLarge(f"body exceeds {max_bytes} bytes")


class Pieces:
    """A request's body as the parser handed it over, before the app asks for it: the cycle's
    ``body`` in place of uvicorn's ``bytearray``. uvicorn appends each piece with ``+=`` and
    sizes the body with ``len`` (to pause the socket past 64 KiB), and its ``receive`` takes
    ``bytes(body)``: here a piece is kept as the object it came as, and joined only if
    ``receive`` asks, so a body read through the whole-body extension that came in one piece
    reaches the app as that very ``bytes`` object (no copy into a buffer, none out of it)."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0

    def __iadd__(self, piece: bytes) -> Pieces:
        self.pieces.append(piece)
        self.size += len(piece)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        pieces = self.pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class Collecting:
    """The body of the request answered by ``cycle``, as the parser hands it over."""

    __slots__ = ("cycle", "exceeded", "max_bytes", "pieces", "size")

    def __init__(self, cycle: Any, max_bytes: int) -> None:
        self.cycle = cycle
        self.max_bytes = max_bytes
        self.pieces: list[bytes | bytearray] = []
        self.size = 0
        self.exceeded = False

    def add(self, piece: bytes | bytearray) -> bool:
        """Keep ``piece``; whether the body is now over the limit (then nothing is kept)."""
        self.size += len(piece)
        if self.size > self.max_bytes:
            self.exceeded = True
            self.pieces = []
            return True
        self.pieces.append(piece)
        return False

    def joined(self) -> bytes:
        pieces = self.pieces
        if len(pieces) == 1 and type(pieces[0]) is bytes:
            return pieces[0]
        return b"".join(pieces)


def declared_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    """The body length a request's headers declare: one ``content-length`` of digits and no
    ``transfer-encoding`` (else ``None``: the parser reads the body)."""
    declared = None
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and declared is not None):
            return None
        if name == b"content-length":
            declared = value
    if declared is None or not declared.isdigit():
        return None
    return int(declared)


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` of ``n`` > 1 bytes, not yet written (``PyBytes_FromStringAndSize`` with
    no source: nothing is touched, as C code fills a ``bytes`` it makes), and a writable view
    of its payload. The view is for filling it before anyone else holds it, and no longer:
    it does not keep the ``bytes`` alive."""
    assert n > 1  # (0 and 1 bytes are shared objects)
    body = _new_bytes(None, n)
    payload = ctypes.cast(ctypes.c_char_p(body), ctypes.c_void_p).value  # (a bytes' own data)
    assert payload is not None
    view = memoryview((ctypes.c_char * n).from_address(payload)).cast("B")
    return body, view


class DirectBody(asyncio.BufferedProtocol):
    """Stands in for an HTTP protocol (``owner``) while the rest of a body is read into its
    ``bytes``: each read asks for exactly what is missing (never a byte of the next request),
    ``on_piece`` is called after each, ``done`` with the body once it is complete (the caller
    hands the transport back to ``owner`` then). Everything else the transport tells a
    protocol goes to ``owner``."""

    __slots__ = ("body", "done", "filled", "on_piece", "owner", "view")

    def __init__(
        self,
        owner: asyncio.Protocol,
        body: bytes,
        view: memoryview,
        filled: int,
        on_piece: Callable[[], None],
        done: Callable[[bytes], None],
    ) -> None:
        self.owner = owner
        self.body: bytes | None = body
        self.view: memoryview | None = view
        self.filled = filled
        self.on_piece = on_piece
        self.done = done

    def get_buffer(self, sizehint: int) -> memoryview:
        assert self.view is not None
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        assert self.view is not None and self.body is not None
        self.filled += nbytes
        if self.filled < len(self.view):
            self.on_piece()
            return
        body, self.body, self.view = self.body, None, None
        self.done(body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.body = self.view = None
        self.owner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.owner.eof_received()

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()


_CANNOT: Final = asyncio.BaseTransport.set_protocol
"""A transport's ``set_protocol`` that raises ``NotImplementedError`` (asyncio's base class's,
what :class:`kvatlas.memory_transport.MemoryTransport` keeps)."""


def read_rest_directly(
    transport: Any,
    owner: asyncio.Protocol,
    declared: int,
    pieces: Sequence[bytes | bytearray],
    on_piece: Callable[[], None],
    done: Callable[[bytes], None],
) -> bool:
    """Read the rest of a body of ``declared`` bytes, of which ``pieces`` came, straight into
    one ``bytes`` (:class:`DirectBody` set as ``transport``'s protocol; ``done`` gets the whole
    body). ``False``, and nothing changed, when too little is left to gain from it, when
    there is no room for it, or the transport cannot change protocols (a transport in memory)."""
    received = sum(map(len, pieces))
    switch = transport.set_protocol
    if declared - received < DIRECT_MIN or getattr(switch, "__func__", None) is _CANNOT:
        return False
    try:
        body, view = fresh_bytes(declared)
    except MemoryError:
        return False
    at = 0
    for piece in pieces:
        view[at : at + len(piece)] = piece
        at += len(piece)
    switch(DirectBody(owner, body, view, at, on_piece, done))
    return True


def new_parser(protocol: Any) -> Any:
    """A fresh httptools parser for uvicorn's ``protocol``, as uvicorn makes one."""
    import httptools  # (only with httptools: the direct read is for its protocol alone)

    parser = httptools.HttpRequestParser(protocol)
    with contextlib.suppress(AttributeError):  # (httptools < 0.6.3 has none, as uvicorn says)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser
