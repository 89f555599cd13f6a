"""A service's HTTP API as one table: each :class:`Route` says, in one entry, its method and
path, who may call it (:class:`Access`), its request and reply types (``msgspec`` Structs of
:mod:`kvatlas.api`), its handler and its body limit. :class:`RouteTable` finds a request's
route; :mod:`kvatlas.dispatch` serves the table, :mod:`kvatlas.openapi` documents it. Adding a
route is one entry and one handler: its access check, body limit and documentation follow.

Paths are templates whose segments are literal or a parameter (``/quota/{cache_salt}``,
``/cache/prefetches/{instance_id}/{request_id}``): a parameter is one non-empty segment. A
literal path wins over a template; among templates the table's order decides.

A service with more than one listener (the node: ``--engine-port``) names a route's listener in
its :class:`Access`; a route whose replies and errors follow the call's own format (msgpack or
JSON) names a :data:`Negotiate` as its ``codec``; an :class:`Area` says who may learn that a
path under a prefix is not served, and in which format.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import unquote

import msgspec
from starlette.types import Scope

from kvatlas.auth import Principal
from kvatlas.errors import Forbidden

B = TypeVar("B")
Q = TypeVar("Q")


@dataclass(frozen=True, slots=True)
class Access:
    """Who may call a route: ``open`` (no token), else a token holding one of ``roles`` (none
    listed: any valid token); ``every_tenant`` (what the reply covers, said in the refusal): a
    token that sees every tenant's figures. ``public_flag``: the route is open when the
    service's ``--public-<flag>`` is on (metrics, docs). ``listener``: the route is served only
    on that listener when the service has several (another one answers 404 before any token is
    checked; one listener serves every route)."""

    roles: tuple[str, ...] = ()
    open: bool = False
    every_tenant: str = ""
    public_flag: str | None = None
    listener: str | None = None

    def check(self, who: Principal) -> None:
        if self.roles:
            who.require(*self.roles)
        if self.every_tenant and not who.sees_everything:
            raise Forbidden(f"{self.every_tenant}: needs a token not bound to cache_salts")


OPEN = Access(open=True)
ANY_TOKEN = Access()
NOBODY = Principal("anonymous", frozenset(), cache_salts=frozenset())
"""The caller of an open route when auth is on: no token was asked for, so no role and no
tenant's salt is held (it sees no tenant)."""


@dataclass(frozen=True, slots=True, eq=False)
class Codec:
    """A reply format: its media type and encoder (of Structs and JSON-like values)."""

    media_type: str
    encode: Callable[[Any], bytes]


JSON = Codec("application/json", msgspec.json.Encoder().encode)
MSGPACK = Codec("application/msgpack", msgspec.msgpack.Encoder().encode)
Negotiate = Callable[[Scope], Codec]
"""The format of a call's reply and of its errors, from its headers (a route's ``codec``)."""


@dataclass(frozen=True, slots=True)
class Area:
    """Paths under ``prefix`` that no route serves: the :class:`Access` of the routes there
    (who may learn that a path is not served, on which listener) and the format of the
    refusal."""

    prefix: str
    access: Access
    codec: Negotiate | None = None


@dataclass(slots=True)  # not frozen: made per request, and a frozen __init__ costs more
class Call(Generic[B, Q]):
    """One request as its handler sees it: the caller (checked against the route's
    :class:`Access` from the headers, before the body was read), the path parameters, the
    request decoded as the route's ``request`` type (``None`` when the route decodes ``raw``
    itself or has no body) and ``query`` type, the body's bytes, the ASGI scope and the format
    its reply is sent in (the route's ``codec``, else JSON)."""

    who: Principal
    params: Mapping[str, str]
    body: B
    query: Q
    raw: bytes
    scope: Scope
    codec: Codec = JSON

    def header(self, name: bytes) -> str | None:
        """The request header ``name`` (lower case), or ``None``."""
        return next((v.decode("latin-1") for k, v in self.scope["headers"] if k == name), None)


@dataclass(slots=True)  # not frozen: made per request (never changed once made)
class Reply:
    """A reply other than a JSON value with status 200: its bytes, status, extra headers and
    media type (``None``: no Content-Type)."""

    payload: bytes = b""
    status: int = 200
    headers: tuple[tuple[bytes, bytes], ...] = ()
    media_type: str | None = "application/json"


Handler = Callable[[Any, Call[Any, Any]], Awaitable[Any]]
"""``handler(context, call)``: a Struct (or JSON value) is the 200 reply; a :class:`Reply` is
sent as it is; a :class:`~kvatlas.errors.KvatlasError` is the error reply."""
InTurn = Callable[[Any, Call[Any, Any]], Any]
"""``in_turn(context, call)``: a :data:`Handler`'s reply, answered in the turn the request's
last byte is read, or ``None`` (the handler answers)."""


@dataclass(frozen=True, eq=False)
class Route:
    """One route, in one entry. ``request``: the body's type; the dispatcher decodes it (and
    the query string as ``query``) before the handler is called, unless ``decode`` is false
    (the handler reads ``call.raw`` and the query string itself: a body sized up from its
    bytes first, or in a codec of its own) or the type is ``bytes`` (a body that is not a
    Struct: the handler reads ``call.raw``). ``query``: the query
    parameters' type. ``body``: picks the route's body limit from the service's limits (the
    largest legitimate body of *this* route; ``None``: the small one). ``docs``: OpenAPI to
    merge into the operation (a body that is not a Struct); ``hidden``: not documented.
    ``codec``: the format of the reply and of every error, per call (``None``: JSON).
    ``in_turn``: answers a request the moment its body is complete, in the parser's turn
    without an ASGI cycle (:class:`kvatlas.http_guard.AnswersInTurn`), when it can (a
    ``Reply``; ``None``: ``handler`` answers); the same reply as ``handler``'s."""

    method: str
    path: str
    access: Access
    handler: Handler
    summary: str = ""
    request: type | None = None
    decode: bool = True
    query: type | None = None
    reply: type | None = None
    status: int = 200
    media_type: str = "application/json"
    body: Callable[[Any], int] | None = None
    docs: Mapping[str, Any] = field(default_factory=dict)
    hidden: bool = False
    codec: Negotiate | None = None
    in_turn: InTurn | None = None

    @property
    def reads_body(self) -> bool:
        return self.request is not None

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(s[1:-1] for s in self.path.split("/") if _is_param(s))


def _encoded_segments(raw_path: bytes | None) -> list[str] | None:
    """The segments of a raw path that holds an encoded ``/``, each decoded (``None``: it
    holds none, the decoded path splits as sent)."""
    if raw_path is None or b"%2f" not in raw_path.lower():
        return None
    return [unquote(s) for s in raw_path.decode("ascii", "replace").split("/")]


def _is_param(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")


NO_PARAMS: Mapping[str, str] = {}


class RouteTable:
    """Finds the route of ``(method, path)``: literal paths by one dictionary lookup, templates
    by their literal segments, in table order. A path no route serves is under the first of
    ``areas`` whose prefix it has, else ``unrouted`` (who may learn it is not served)."""

    def __init__(
        self, routes: Iterable[Route], areas: Iterable[Area] = (), unrouted: Access = ANY_TOKEN
    ) -> None:
        self.routes = tuple(routes)
        self.areas = tuple(areas)
        self.unrouted = Area("", unrouted)
        self._literal: dict[tuple[str, str], Route] = {}
        self._templates: dict[int, list[tuple[Route, tuple[str | None, ...]]]] = {}
        for route in self.routes:
            segments = route.path.split("/")
            if any("{" in s or "}" in s for s in segments if not _is_param(s)):
                raise ValueError(f"{route.path}: a parameter is a whole segment")
            key = (route.method, route.path)
            if key in self._literal or any(
                r.method == route.method and r.path == route.path
                for rs in self._templates.values()
                for r, _ in rs
            ):
                raise ValueError(f"{route.method} {route.path} is in the table twice")
            if route.params:
                if len(set(route.params)) != len(route.params):
                    raise ValueError(f"{route.path}: a parameter named twice")
                shape = tuple(None if _is_param(s) else s for s in segments)
                self._templates.setdefault(len(segments), []).append((route, shape))
            else:
                self._literal[key] = route

    def match(
        self, method: str, path: str, raw_path: bytes | None = None
    ) -> tuple[Route, Mapping[str, str]] | None:
        """The route of ``(method, path)`` and its parameters. ``raw_path`` (the request's
        path as sent) matters when it holds an encoded ``/``: ``%2F`` stays inside its
        segment (an instance id ``rack/a`` is ``/instances/rack%2Fa``), where the decoded
        ``path`` would split it; such a path is no literal route's."""
        segments = _encoded_segments(raw_path)
        if segments is None:
            route = self._literal.get((method, path))
            if route is not None:
                return route, NO_PARAMS
            segments = path.split("/")
        for found, params in self._paths(segments):
            if found.method == method:
                return found, params
        return None

    def area(self, path: str) -> Area:
        """The :class:`Area` of a path no route serves."""
        return next((a for a in self.areas if path.startswith(a.prefix)), self.unrouted)

    def methods(self, path: str, raw_path: bytes | None = None) -> list[str]:
        """The methods of the first route whose path is ``path`` (what a 405 allows; an
        encoded ``/`` in ``raw_path`` as :meth:`match` reads it)."""
        segments = _encoded_segments(raw_path)
        literal = segments is None
        templated = {id(route) for route, _ in self._paths(segments or path.split("/"))}
        for route in self.routes:
            if (literal and route.path == path) or id(route) in templated:
                return [route.method]
        return []

    def _paths(self, segments: list[str]) -> Sequence[tuple[Route, Mapping[str, str]]]:
        found = []
        for route, shape in self._templates.get(len(segments), ()):
            params: dict[str, str] = {}
            for want, got in zip(shape, segments, strict=True):
                if want is None:
                    if not got:
                        break
                    params[route.params[len(params)]] = got
                elif want != got:
                    break
            else:
                found.append((route, params))
        return found
