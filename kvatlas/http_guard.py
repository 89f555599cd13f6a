"""What a client may hold of a service's HTTP server, for the coordinator and the node alike:
at most ``max_connections`` open connections (a connection beyond is closed as soon as it is
accepted), at most ``header_timeout_s`` to send a request's headers (counted from the
connection, or from the previous reply on a kept-alive one: a client dripping header bytes is
closed all the same), and at most ``body_timeout_s`` between two pieces of a request's body
(then a 408 and the connection is closed). nginx's ``client_header_timeout`` and
``client_body_timeout`` mean the same.

Invariant: however many clients connect and however slowly they send, the process keeps file
descriptors for its own work (the snapshot, Redis, L2 files, peers): the default cap is the
process's file limit (``RLIMIT_NOFILE``) less a reserve. See docs/security.md.

The limits are uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with three
timers, whichever parser uvicorn picked (httptools or h11): both keep the request being
answered as ``cycle``.

With httptools, the class also offers a request's whole body in one call (the ASGI scope
extension :data:`WHOLE_BODY`, what :func:`kvatlas.web.receive_body` uses): the pieces the
parser hands over are kept as they came and joined once, instead of uvicorn copying each into
its buffer, copying that again for every ``receive`` and pausing the socket past 64 KiB until
the app asks for more (a large ``POST /events`` body was copied four times over about nine
reads, each a wake-up of the app). The body limit is the caller's and is checked as the pieces
come; past it the socket is paused and nothing more is kept (413, as with ``receive``). What
comes before the app asks (a whole 175 KB blend lookup arrives in one read, before the app's
task runs) is kept as the parser's pieces too (:class:`Pieces`), so a body that came in one
piece reaches the app, by either read, as the parser's own ``bytes``: no copy at all; and
the rest of a large body whose length the headers declare within the limit is read by the
socket straight into the ``bytes`` the app gets (:mod:`kvatlas.http_body`).

With an app that answers requests in turn (:class:`AnswersInTurn`, the dispatcher), a request
it takes at the end of its headers is answered in the parser's turn once its body is complete
(its pieces kept as they come, never paused: its declared length is within the route's limit),
its reply written as uvicorn's ``send`` writes it; everything else starts the app as uvicorn
does, and so does a request the app declines, its body already there.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final, Protocol, runtime_checkable

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from kvatlas.http_body import (
    Collecting,
    Pieces,
    body_too_large,
    declared_length,
    new_parser,
    read_rest_directly,
)
from kvatlas.http_coalescing import CoalescingTransport
from kvatlas.http_limits import HttpLimits, OnRefused

ErrorBody = Callable[[int, str], bytes]
"""The JSON body of a refusal the guard writes itself, from status and message: a 408 and the
400 of a request the parser cannot read (default: ``{"detail": ...}``)."""
_BODY_LATE = "request body not received in time"


def _refusal(status: int, body: bytes) -> bytes:
    head = b"%scontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
    return head % (STATUS_LINE[status], len(body)) + body


WHOLE_BODY: Final = "kvatlas.whole_body"
"""The ASGI scope extension (``scope["extensions"]``) under which the guarded protocol offers
the request's whole body: an async callable ``(max_bytes) -> bytes | None`` (``None``: the
client is gone), raising :class:`~kvatlas.errors.PayloadTooLarge` past ``max_bytes``. It reads
the server's own stream: a middleware that wraps ``receive`` must drop it from the scope."""

WholeBody = Callable[[int], Awaitable[bytes | None]]
"""The callable offered under :data:`WHOLE_BODY`."""

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


_WHOLE_BODY_PARSER = hasattr(AutoHTTPProtocol, "on_body")
"""Whether uvicorn's protocol is httptools' (its parser hands each piece of a body to
``on_body``); with h11 the extension is not offered and bodies come through ``receive``, and no
request is answered in the parser's turn (:class:`AnswersInTurn`)."""

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""A reply as the wire needs it: status, headers (names in lower case), body."""


@runtime_checkable
class AnswersInTurn(Protocol):
    """An app (``uvicorn.Config(app)``) that may answer a request in the turn the parser
    reads its last byte, without an ASGI cycle (:class:`kvatlas.dispatch.Dispatcher`). At the
    end of the headers :meth:`in_turn` says whether it may (a ticket: the request is its
    route's, the caller admitted, the declared length within the route's limit; ``None``: the
    ASGI app answers it, refusals included); with the body complete, :meth:`answer_in_turn`
    answers (``None``: it declines, and the ASGI app answers with the body already there)."""

    def in_turn(self, scope: dict[str, Any]) -> object | None: ...

    def answer_in_turn(self, ticket: Any, body: bytes) -> Answer | None: ...


def guarded_protocol(
    limits: HttpLimits, on_refused: OnRefused, error_body: ErrorBody | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with ``limits`` applied; ``on_refused`` counts."""
    cap = limits.connection_cap
    refusal_body = error_body or (lambda _status, text: json.dumps({"detail": text}).encode())

    class GuardedHTTP(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _timer: asyncio.TimerHandle | None = None
        _timer_body = False  # whether the armed timer is the body timer
        _timer_at = 0.0  # the loop time the armed timer expires
        _idle_since = 0.0  # loop time of the connection or its last reply (the header timer's)
        _quiet_since: float | None = None  # the last reply's, while no byte came since it
        _collecting: Collecting | None = None  # the body read for the extension, if any
        _in_turn: AnswersInTurn | None = None  # the app, if it answers requests in turn
        _pending: tuple[Any, object] | None = None  # (cycle, ticket) answered in turn
        _parsing_headers = False
        _answered_in_read = False  # a request of the data being parsed was answered in turn

        def on_message_begin(self) -> None:
            # A request parsed in the turn that answered the one before it (pipelined): with
            # h11, uvicorn's keep-alive timer, armed by that answer, is for idle connections
            # only (with httptools uvicorn arms none: see on_response_complete).
            self._unset_keepalive_if_required()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._parsing_headers = True
            try:
                super().on_headers_complete()
            finally:
                self._parsing_headers = False
            cycle = self.cycle
            if _WHOLE_BODY_PARSER and cycle is not None and cycle.scope is self.scope:
                whole: WholeBody = partial(self._whole_body, cycle)
                self.scope.setdefault("extensions", {})[WHOLE_BODY] = whole
                cycle.body = Pieces()  # what comes before the app asks, kept as it comes

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            """uvicorn's start of the app for a request whose headers are complete; one the
            app may answer in turn waits for its body instead (not one queued behind another,
            one uvicorn turned away, one expecting ``100 Continue``, one while the client is
            not reading its replies, nor one behind an answer in turn in the same read: a read
            of many small requests would hold the loop for all; the ASGI path takes turns)."""
            in_turn = self._in_turn
            if (
                in_turn is not None
                and self._parsing_headers
                and not self._answered_in_read
                and app is self.app
                and not cycle.waiting_for_100_continue
                and not self.flow.write_paused
            ):
                ticket = in_turn.in_turn(cycle.scope)
                if ticket is not None:
                    self._pending = (cycle, ticket)
                    return
            super()._start_asgi_task(cycle, app)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            pending, cycle = self._pending, self.cycle
            if pending is None or pending[0] is not cycle:
                return
            self._pending = None
            assert self._in_turn is not None
            # the body is not kept past its answer (the cycle lives until the next request)
            pieces, cycle.body = cycle.body, bytearray()
            answer = self._in_turn.answer_in_turn(pending[1], bytes(pieces))
            if answer is None:  # declined: the app reads the body kept as it came
                cycle.body = pieces
                super()._start_asgi_task(cycle, self.app)
            else:
                self._answered_in_read = True
                self._write_answer(cycle, *answer)

        def _write_answer(
            self, cycle: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes
        ) -> None:
            """What uvicorn's ``send`` writes for this reply (its default headers first, a
            ``connection: close`` where the connection is not kept), then the end of the
            request as after the app's last ``send``."""
            cycle.response_started = True
            head = [STATUS_LINE[status]]
            closes = False
            for name, value in (*cycle.default_headers, *headers):
                if name == b"connection" and b"close" in value.lower():
                    closes = True
                head += (name, b": ", value, b"\r\n")
            if not cycle.keep_alive and not closes:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            transport = self.transport  # sent at the end of the turn, as an app's reply: the
            transport.write(b"".join(head))  # replies to the requests read in one turn leave
            transport.write(body)  # together (sent at once, p99 under load rose by half)
            cycle.response_complete = True
            if closes or not cycle.keep_alive:
                cycle.keep_alive = False
                transport.close()
            cycle.on_response()

        def on_body(self, body: bytes) -> None:
            collecting, cycle = self._collecting, self.cycle
            pending = self._pending
            if pending is not None and pending[0] is cycle:
                cycle.body += body  # the declared length, within the route's limit: no pause
                return
            if collecting is None or collecting.cycle is not cycle:
                super().on_body(body)
                return
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return  # as uvicorn's own
            if collecting.add(body):
                self.flow.pause_reading()  # nothing more is read: the reply closes
                cycle.message_event.set()

        async def _whole_body(self, cycle: Any, max_bytes: int) -> bytes | None:
            """The extension: what ``receive`` would have handed over, in one piece. The app
            is woken once, when the body is complete (``on_message_complete`` sets the event),
            the client is gone, or the body is over ``max_bytes``."""
            if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
                cycle.transport.write(_CONTINUE)  # as uvicorn's receive
                cycle.waiting_for_100_continue = False
            collecting = Collecting(cycle, max_bytes)
            early, cycle.body = cycle.body, bytearray()  # what came before the app asked
            for piece in early.pieces if type(early) is Pieces else (early,):
                if piece and collecting.add(piece):
                    raise body_too_large(max_bytes)
            self._collecting = collecting
            if self._read_directly(cycle, collecting.pieces, max_bytes):
                collecting.pieces, collecting.size = [], 0  # (copied: the body comes whole)
            try:
                self.flow.resume_reading()  # paused past 64 KiB before the app asked
                while (
                    cycle.more_body
                    and not collecting.exceeded
                    and not cycle.disconnected
                    and not cycle.response_complete
                ):
                    await cycle.message_event.wait()
                    cycle.message_event.clear()
            finally:
                if self._collecting is collecting:
                    self._collecting = None
            cycle.message_event.clear()  # consumed, as by uvicorn's last receive
            if collecting.exceeded:
                raise body_too_large(max_bytes)
            if cycle.disconnected or cycle.response_complete:
                return None
            return collecting.joined()

        def _read_directly(self, cycle: Any, pieces: list[Any], max_bytes: int | None) -> bool:
            """Read the rest of ``cycle``'s body straight into one ``bytes``
            (:func:`~kvatlas.http_body.read_rest_directly`), ``pieces`` of it there already,
            if its headers declare its length and that is within ``max_bytes`` (``None``: the
            app's ticket checked it). Then the body comes whole, to :meth:`_direct_done`."""
            if (
                cycle is not self.cycle
                or not cycle.more_body
                or cycle.response_complete
                or self.transport.is_closing()
            ):
                return False
            declared = declared_length(cycle.scope["headers"])
            if declared is None or (max_bytes is not None and declared > max_bytes):
                return False
            return read_rest_directly(
                self.transport, self, declared, pieces, self._watch, self._direct_done
            )

        def _direct_done(self, body: bytes) -> None:
            """The body read directly is complete: the transport reads for this protocol
            again, through a fresh parser (this one has not seen the body), and the body
            is handed over as the parser would have, in one piece."""
            self.transport.set_protocol(self)
            self.parser = new_parser(self)
            self.on_body(body)
            self.on_message_complete()
            self._watch()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's 400 to a request its parser cannot read, with the service's JSON
            error body (uvicorn's is ``text/plain``)."""
            self.transport.write(_refusal(400, refusal_body(400, msg)))
            self.transport.close()

        def connection_made(self, transport: Any) -> None:
            transport = CoalescingTransport(transport, asyncio.get_running_loop())
            super().connection_made(transport)
            app = self.config.app
            logs_access = self.access_log and self.access_logger.isEnabledFor(logging.INFO)
            if _WHOLE_BODY_PARSER and not logs_access and isinstance(app, AnswersInTurn):
                self._in_turn = app  # (only uvicorn's send writes access lines)
            if len(self.connections) > cap:
                on_refused("over_cap")
                transport.abort()
                return
            self._idle_since = self.loop.time()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watching()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._answered_in_read = False
            self._quiet_since = None  # (uvicorn's keep-alive ends at the first byte)
            super().data_received(data)
            pending = self._pending  # a body answered in turn, not complete in this read
            if pending is not None and self._read_directly(
                pending[0], pending[0].body.pieces, None
            ):
                pending[0].body = Pieces()  # (copied: the body comes whole)
            self._watch()

        def on_response_complete(self) -> None:
            if not _WHOLE_BODY_PARSER:
                super().on_response_complete()
            else:  # uvicorn's, but for its keep-alive timer: this guard's (no timer a request)
                self.server_state.total_requests += 1
                if not self.transport.is_closing():
                    self.flow.resume_reading()
                    if self.pipeline:
                        cycle, app = self.pipeline.pop()
                        self._start_asgi_task(cycle, app)
            self._idle_since = self._quiet_since = self.loop.time()
            self._watch()  # the next request's headers

        def _stop_watching(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _watch(self) -> None:
            """(Re-)arm the one timer this connection's state calls for: the idle timer while
            no request is being answered, the body timer while a request's body is incomplete
            (reset by every piece). The idle timer ends two waits, from the connection or the
            last reply (``_idle_since``): the header timeout (a drip of header bytes does not
            reset it), and after a reply with no byte since, uvicorn's keep-alive timeout
            (``timeout_keep_alive``: a quiet close, no refusal), whichever ends first. Armed
            once, it finds at its expiry whether a reply came since and then waits for the
            rest: no timer is armed and cancelled for each request (uvicorn armed its
            keep-alive timer at every reply: ≈5 µs of a blend lookup's CPU)."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                left = self._idle_time_left()
                if (
                    self._timer is None
                    or self._timer_body
                    or self._timer_at - self.loop.time() > left
                ):
                    self._arm(left, body=False)
            elif cycle.more_body and not cycle.response_started:
                self._arm(limits.body_timeout_s, body=True)
            else:
                self._stop_watching()

        def _arm(self, seconds: float, *, body: bool) -> None:
            self._stop_watching()
            self._timer_body = body
            self._timer_at = self.loop.time() + seconds
            self._timer = self.loop.call_later(seconds, self._expired)

        def _idle_time_left(self) -> float:
            """Until the idle timer's first wait ends (see :meth:`_watch`)."""
            now: float = self.loop.time()
            left = self._idle_since + limits.header_timeout_s - now
            if self._quiet_since is not None:
                left = min(left, self._quiet_since + self.timeout_keep_alive - now)
            return left

        def _expired(self) -> None:
            self._timer = None
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                left = self._idle_time_left()
                if left > 0:  # a reply came since the timer was armed
                    self._arm(left, body=False)
                    return
                if self._quiet_since is None or self.timeout_keep_alive > limits.header_timeout_s:
                    on_refused("header_timeout")
                transport.close()  # (else uvicorn's keep-alive: quiet, not a refusal)
            elif cycle.more_body and not cycle.response_started:
                if self.flow.read_paused:  # the app has not read what came: not the client
                    self._arm(limits.body_timeout_s, body=True)
                    return
                on_refused("body_timeout")
                transport.write(_refusal(408, refusal_body(408, _BODY_LATE)))
                transport.close()

    return GuardedHTTP
