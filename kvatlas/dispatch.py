"""The one request stack of a service: :class:`Dispatcher` serves a :class:`~kvatlas.routing.
RouteTable` as a plain ASGI app. Per request: find the route, check the caller against its
:class:`~kvatlas.routing.Access` from the headers, check the declared length against the
route's body limit, read the body under that limit, decode the request, call the handler, send
the reply. Every route, the hottest included, goes this one way; a route with an ``in_turn``
may be answered the moment its body is complete, without the ASGI cycle, after the same checks
from the same headers (:meth:`Dispatcher.in_turn`, :meth:`Dispatcher.answer_in_turn`, called by
:mod:`kvatlas.http_guard`'s protocol): the same reply, the same errors.

Invariant: with auth on, no byte of a request body is read before the bearer token in its
headers was checked against the route's roles; a refusal closes the connection, so the rest of
an unauthenticated body is never read, not even to discard it. No route reads more body than
its own limit (413, by Content-Length or while streaming). See docs/security.md.

Every error reply is rendered by :mod:`kvatlas.web` from a :mod:`kvatlas.errors` class, in the
route's format (its ``codec``: the call's own msgpack or JSON; else JSON); a path no route
serves is a 404, a method it does not serve a 405 (``allow`` names the one it does), a path
that only lacks or has an extra ``/`` a 307 to the one served. With several listeners
(``listener_of``), a route named for one is a 404 on the others, before any token is checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote_to_bytes

import msgspec
from starlette.types import Receive, Scope, Send

from kvatlas.auth import ANONYMOUS_ADMIN, Principal, TokenAuth, authorization_of
from kvatlas.errors import InvalidInput, KvatlasError, NotFound
from kvatlas.fields import check_query_pairs, decode_body, field_error, field_errors
from kvatlas.http_guard import Answer
from kvatlas.http_limits import OnRefused
from kvatlas.routing import (
    JSON,
    NO_PARAMS,
    NOBODY,
    Access,
    Call,
    Codec,
    Reply,
    Route,
    RouteTable,
)
from kvatlas.web import (
    check_declared_length,
    error_headers,
    error_payload,
    nested_too_deep,
    receive_body,
)

log = logging.getLogger(__name__)

_NOT_FOUND = Reply(b'{"detail":"Not Found"}', 404)
_SERVER_ERROR = Reply(b"Internal Server Error", 500, media_type="text/plain; charset=utf-8")
_SERVER_ERROR_CLOSE = Reply(
    _SERVER_ERROR.payload, 500, ((b"connection", b"close"),), _SERVER_ERROR.media_type
)  # what uvicorn sends when an app raises before its reply
_NO_LENGTH = (204, 304)


def bearer_header(scope: Scope) -> str | None:
    return authorization_of(scope["headers"])


class Dispatcher:
    """Serves ``table`` with ``context`` handed to every handler. ``auth``: ``None`` (auth off:
    every caller is admin) or the token file; ``public``: the :attr:`Access.public_flag` names
    whose routes are open (``--public-metrics``, ``--public-docs``); ``body_limit``: each
    route's limit; ``small``: the limit of a request no route serves; ``on_refused`` counts
    bodies nested too deeply; ``listener_of``: the listener a request came in on (``None``:
    the service has one, which serves every route)."""

    def __init__(
        self,
        context: Any,
        table: RouteTable,
        auth: TokenAuth | None,
        public: frozenset[str],
        body_limit: Callable[[Route], int],
        small: int,
        on_refused: OnRefused = lambda _reason: None,
        listener_of: Callable[[Scope], str] | None = None,
    ) -> None:
        self.context = context
        self.listener_of = listener_of
        self.table = table
        self.auth = auth
        self.public = public
        self.small = small
        self.on_refused = on_refused
        self.limits = {route: body_limit(route) for route in table.routes}
        self._any_in_turn = any(route.in_turn is not None for route in table.routes)

    def admit(self, access: Access, scope: Scope) -> Principal:
        """The caller, from the headers alone (401/403 as a :class:`KvatlasError`; 404 on a
        listener that does not serve the route)."""
        listener_of, listener = self.listener_of, access.listener
        if listener is not None and listener_of is not None and listener_of(scope) != listener:
            raise NotFound(f"{scope['path']} is not served on this listener")
        if self.auth is None:
            return ANONYMOUS_ADMIN
        if access.open or access.public_flag in self.public:
            return NOBODY
        who = self.authenticate(access, scope)
        access.check(who)
        return who

    def authenticate(self, access: Access, scope: Scope) -> Principal:
        """Who the bearer token of ``scope`` is (auth is on); a service with credentials of
        its own besides the token file overrides this."""
        assert self.auth is not None
        return self.auth.authenticate(bearer_header(scope))

    def route_of(self, scope: Scope) -> tuple[Route | None, Mapping[str, str], int]:
        """The route of a request, its path parameters and its body limit (HEAD is a GET
        route's: answered as GET, its body left out by the server)."""
        method = scope["method"]
        found = self.table.match(
            "GET" if method == "HEAD" else method, scope["path"], scope.get("raw_path")
        )
        if found is None:
            return None, NO_PARAMS, self.small
        route, params = found
        return route, params, self.limit_of(route, scope)

    def limit_of(self, route: Route, scope: Scope) -> int:
        """The body limit of a request of ``route`` (a service whose limits depend on the
        body's format overrides this; the headers are all it may read)."""
        return self.limits[route]

    def in_turn(self, scope: Scope) -> _Ticket | None:
        """At the end of a request's headers (:class:`kvatlas.http_guard.AnswersInTurn`):
        a ticket if its route answers in turn (``Route.in_turn``), the caller is admitted and
        the body's declared length is within the route's limit; else ``None``, and the ASGI
        path answers it, refusals included."""
        if not self._any_in_turn:
            return None
        route, params, limit = self.route_of(scope)
        if route is None or route.in_turn is None or route.method != scope["method"]:
            return None
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"transfer-encoding":
                return None
        if declared is None and route.reads_body:
            return None
        try:
            who = self.admit(route.access, scope)
            check_declared_length(declared, limit)
        except KvatlasError:
            return None
        codec = JSON if route.codec is None else route.codec(scope)
        return _Ticket(route, params, who, codec, scope)

    def answer_in_turn(self, ticket: _Ticket, body: bytes) -> Answer | None:
        """The reply to the request of ``ticket`` with its whole ``body``, from the route's
        ``in_turn`` (``None``: it declined; the ASGI path answers)."""
        route, codec, scope = ticket.route, ticket.codec, ticket.scope
        try:
            call = Call(
                ticket.who, _params(ticket.params, scope), self._body(route, body, scope),
                _query(route, scope), body, scope, codec,
            )  # fmt: skip
            assert route.in_turn is not None
            result = route.in_turn(self.context, call)
            if result is None:
                return None
            reply = _reply(route, result, codec)
        except Exception as exc:
            refused = self._refusal(exc, codec)
            if refused is None:
                log.exception("Exception answering %s %s", scope["method"], scope["path"])
            reply = _SERVER_ERROR_CLOSE if refused is None else refused
        return reply.status, _headers(reply), reply.payload

    def _refusal(self, exc: Exception, codec: Codec) -> Reply | None:
        """The error reply of what a request raised (``None``: a bug, a 500)."""
        if isinstance(exc, KvatlasError):
            return _error(exc, codec)
        if isinstance(exc, RecursionError):  # a body nested deeper than the decoders follow
            return _error(nested_too_deep(self.on_refused), codec)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await _lifespan(receive, send)
            return
        route, params, limit = self.route_of(scope)
        if route is not None:
            access, negotiate = route.access, route.codec
        else:
            area = self.table.area(scope["path"])
            access, negotiate = area.access, area.codec
        codec = JSON if negotiate is None else negotiate(scope)
        try:
            who = self.admit(access, scope)
        except KvatlasError as exc:  # nothing of the body read: close rather than drain it
            await _send(send, _error(exc, codec, (b"connection", b"close")))
            return
        try:
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            check_declared_length(declared, limit)
            if route is None:
                reply = self._unrouted(scope)
            else:
                raw = b""
                if route.reads_body:
                    body = await receive_body(receive, limit, scope)
                    if body is None:  # the client is gone
                        return
                    raw = body
                call = Call(
                    who, _params(params, scope), self._body(route, raw, scope),
                    _query(route, scope), raw, scope, codec,
                )  # fmt: skip
                reply = _reply(route, await route.handler(self.context, call), codec)
        except Exception as exc:
            refused = self._refusal(exc, codec)
            if refused is None:
                await _send(send, _SERVER_ERROR)
                raise
            reply = refused
        await _send(send, reply)

    @staticmethod
    def _body(route: Route, raw: bytes, scope: Scope) -> Any:
        if route.request is None or route.request is bytes or not route.decode:
            return None  # the handler reads call.raw
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
        return decode_body(
            raw, None if content_type is None else content_type.decode("latin-1"), route.request
        )

    def _unrouted(self, scope: Scope) -> Reply:
        """404, 405 (the path is served with another method) or a 307 to the path with its
        trailing ``/`` added or removed when that one is served."""
        path = scope["path"]
        allowed = self.table.methods(path, scope.get("raw_path"))
        if allowed:
            return Reply(
                b'{"detail":"Method Not Allowed"}', 405, ((b"allow", ", ".join(allowed).encode()),)
            )
        if path != "/":
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            if self.table.methods(other):
                return Reply(b"", 307, ((b"location", _url(scope, other).encode("latin-1")),), None)
        return _NOT_FOUND


def _params(params: Mapping[str, str], scope: Scope) -> Mapping[str, str]:
    """The path parameters, refused (400) when the path percent-encodes bytes that are not
    UTF-8 (the server's decoding put U+FFFD in their place: a name nobody sent)."""
    if params and any("\ufffd" in v for v in params.values()):
        try:
            unquote_to_bytes(scope.get("raw_path") or scope["path"].encode()).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput("the path percent-encodes bytes that are not UTF-8") from None
    return params


def _query(route: Route, scope: Scope) -> Any:
    if route.query is None or not route.decode:
        return None  # the handler reads the query string itself
    try:
        pairs = parse_qsl(
            scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True,
            errors="strict",
        )  # fmt: skip
    except UnicodeDecodeError:
        raise InvalidInput("the query string percent-encodes bytes that are not UTF-8") from None
    check_query_pairs(pairs, route.query)
    try:
        return msgspec.convert(dict(pairs), route.query, strict=False)
    except msgspec.ValidationError as exc:
        raise field_errors([field_error(exc, route.query, strict=False)], ("query",)) from None


def _reply(route: Route, result: Any, codec: Codec) -> Reply:
    if isinstance(result, Reply):
        return result
    return Reply(codec.encode(result), route.status, media_type=codec.media_type)


def _error(exc: KvatlasError, codec: Codec, *extra: tuple[bytes, bytes]) -> Reply:
    headers = (*error_headers(exc), *extra)
    return Reply(codec.encode(error_payload(exc)), exc.status, headers, codec.media_type)


def _url(scope: Scope, path: str) -> str:
    """``path`` (and the request's query) on this server: what a redirect names. Relative, not
    built from the ``Host`` header, which the client chooses."""
    url = f"{scope.get('root_path', '')}{path}"
    query = scope.get("query_string", b"")
    return quote(url + ("?" + query.decode("latin-1") if query else ""), safe=":/%#?=@[]!$&'()*+,;")


@dataclass(frozen=True, slots=True)
class _Ticket:
    """A request its route answers in turn: what the dispatcher found at its headers."""

    route: Route
    params: Mapping[str, str]
    who: Principal
    codec: Codec
    scope: Scope


def _headers(reply: Reply) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", reply.media_type.encode())] if reply.media_type else []
    headers.extend(reply.headers)
    if reply.status not in _NO_LENGTH:
        headers.append((b"content-length", str(len(reply.payload)).encode()))
    return headers


async def _send(send: Send, reply: Reply) -> None:
    headers = _headers(reply)
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.payload})


async def _lifespan(receive: Receive, send: Send) -> None:
    """The ASGI lifespan handshake (nothing to start or stop: the service does that)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
