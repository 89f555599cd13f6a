"""ASGI plumbing of the coordinator: authentication before anything else (:class:`Gate`, applied
by :class:`Authenticate` in the framework and by :class:`FastPaths` in front of it), the fast
paths (the service's hottest requests, answered in front of the framework's whole middleware
stack) and the one place request-validation errors are formatted.

Invariant: with auth on, no byte of a request body is read before the bearer token in its
headers was checked against the route's roles (:data:`ROUTES`): an unauthenticated
client can make the coordinator read headers, nothing more. No route reads more body than its
own largest legitimate body (:class:`Route`). See docs/security.md.

Every error reply is rendered by :mod:`kvatlas.web` from a :mod:`kvatlas.errors` class, on the
fast path and in the framework alike, so a status, ``detail`` or header never depends on which
path answered. See docs/coordinator.md ("API").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.auth import ANONYMOUS_ADMIN, DOCS_PATHS, Principal, TokenAuth
from kvatlas.coordinator.config import CoordinatorConfig, RouteBodies
from kvatlas.coordinator.query import field_errors
from kvatlas.errors import Forbidden, KvatlasError, Unprocessable
from kvatlas.http_guard import OnRefused
from kvatlas.web import (
    BodyLimit,
    check_declared_length,
    error_headers,
    error_payload,
    error_response,
    json_encoder,
    nested_too_deep,
    receive_body,
)

PRINCIPAL = "kvatlas.principal"
"""The scope key under which :class:`Authenticate` leaves the caller for the routes."""


@dataclass(frozen=True, slots=True)
class Access:
    """Who may call a route: ``open`` (no token), else a token holding one of ``roles`` (none
    listed: any valid token); ``every_tenant``: a token that sees every tenant's figures."""

    roles: tuple[str, ...] = ()
    open: bool = False
    every_tenant: bool = False

    def check(self, who: Principal) -> None:
        if self.roles:
            who.require(*self.roles)
        if self.every_tenant and not who.sees_everything:
            raise Forbidden(
                "this reply covers every tenant: needs a token not bound to cache_salts"
            )


BodyOf = Callable[[RouteBodies], int]
"""Which of the config's :class:`~kvatlas.coordinator.config.RouteBodies` a route takes."""


def _small(bodies: RouteBodies) -> int:
    return bodies.small


@dataclass(frozen=True, slots=True)
class Route:
    """One route of the coordinator, in one entry: method, path (an instance id as
    ``{instance_id}``), who may call it, and its body limit: the largest legitimate body of
    *this* route (``body`` picks it from the config's :class:`RouteBodies`; 413 past it, by
    Content-Length or while streaming, before the route sees a byte)."""

    method: str
    path: str
    access: Access
    body: BodyOf = _small

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path


OPEN = Access(open=True)
ANY_TOKEN = Access()
_EMIT, _LOOKUP = Access(("emit",)), Access(("lookup",))
_EVERY_TENANT = Access(("lookup",), every_tenant=True)
ROUTES: tuple[Route, ...] = (
    Route("POST", "/events", _EMIT, lambda b: b.events),
    Route("POST", "/directory/lookup", _LOOKUP, lambda b: b.lookup),
    Route("POST", "/directory/blend-lookup", _LOOKUP, lambda b: b.blend_lookup),
    Route("POST", "/route/score", _LOOKUP, lambda b: b.route_score),
    Route("GET", "/directory/stats", _LOOKUP),
    Route("GET", "/directory/keys", Access(("admin",))),
    Route("POST", "/instances", _EMIT, lambda b: b.registration),
    Route("GET", "/instances", Access(("lookup", "emit"))),
    Route("PUT", "/instances/{instance_id}/heartbeat", _EMIT),
    Route("DELETE", "/instances/{instance_id}", _EMIT),
    Route("POST", "/instances/{instance_id}/digest", _EMIT, lambda b: b.digest),
    # LMCache 0.5.7's capacity view and chunk-size check (docs/coordinator.md, conformance)
    Route("GET", "/instances/usage", _EVERY_TENANT),
    Route("GET", "/instances/{instance_id}/usage", _EVERY_TENANT),
    Route("PUT", "/config/chunk-size", _EMIT),
    Route("GET", "/healthz", OPEN),
    Route("GET", "/readyz", OPEN),
    # the status page (docs/operator.md): an open shell; its data needs a token that sees every
    # tenant (as /metrics does without --public-metrics, which does not open these)
    Route("GET", "/", OPEN),
    Route("GET", "/status", OPEN),
    Route("GET", "/status/fragment", _EVERY_TENANT),
    Route("GET", "/status.json", _EVERY_TENANT),
    Route("PUT", "/instances/{instance_id}/report", _EMIT),
)
"""Every route: its access, checked from the headers alone, and its body limit. The routes
check the bindings that need the body (instances, salts) themselves. A route missing here needs
any valid token and takes a small body (``tests/coordinator/test_security_exposure.py`` fails
until it is listed)."""
ROUTE_TABLE: dict[tuple[str, str], Route] = {route.key: route for route in ROUTES}
METRICS_PATH = "/metrics"
_METRICS = Access(("lookup",), every_tenant=True)


def route_body_limit(method: str, path: str, config: CoordinatorConfig) -> int:
    """The body limit of the request ``method path`` under ``config`` (what :class:`Gate`
    applies)."""
    return Gate(None, True, True, config.route_bodies).route(method, path)[1]


def route_template(method: str, path: str) -> tuple[str, str]:
    """``(method, path)`` with an instance id replaced by ``{instance_id}`` (HEAD as GET)."""
    method = "GET" if method == "HEAD" else method
    parts = path.split("/")
    if len(parts) in (3, 4) and parts[1] == "instances" and parts[2]:
        parts[2] = "{instance_id}"
    return method, "/".join(parts)


def bearer_header(scope: Scope) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)


def principal_of(scope: Scope, auth: TokenAuth | None) -> Principal:
    """The caller :class:`Authenticate` found, or (an app mounted without it) the bearer
    token's principal; 401 when auth is on and the token is missing or unknown."""
    who: Principal | None = scope.get(PRINCIPAL)
    if who is not None:
        return who
    return ANONYMOUS_ADMIN if auth is None else auth.authenticate(bearer_header(scope))


async def refuse(exc: KvatlasError, scope: Scope, receive: Receive, send: Send) -> None:
    """Reply with ``exc`` without reading the body, and close the connection: the rest of an
    unauthenticated body is never read, not even to discard it."""
    response = error_response(exc)
    response.headers["connection"] = "close"
    await response(scope, receive, send)


class Gate:
    """Who may make a request and how much body it may send, from its headers alone: the
    route's entry in :data:`ROUTES` (its :class:`Access`, its body limit under ``bodies``) and
    the bearer token (checked against the route's roles) when auth is on."""

    def __init__(
        self, auth: TokenAuth | None, public_metrics: bool, public_docs: bool, bodies: RouteBodies
    ) -> None:
        self.auth = auth
        self.public_metrics = public_metrics
        self.public_docs = public_docs
        self.bodies = bodies
        self._limits = {key: route.body(bodies) for key, route in ROUTE_TABLE.items()}

    def route(self, method: str, path: str) -> tuple[Access, int]:
        """The access and body limit of ``method path`` (a route outside the table: any valid
        token, a small body)."""
        if path == METRICS_PATH:
            return (OPEN if self.public_metrics else _METRICS), self.bodies.small
        if path in DOCS_PATHS:
            return (OPEN if self.public_docs else ANY_TOKEN), self.bodies.small
        method = "GET" if method == "HEAD" else method
        route = ROUTE_TABLE.get((method, path)) or ROUTE_TABLE.get(route_template(method, path))
        if route is None:
            return ANY_TOKEN, self.bodies.small
        return route.access, self._limits[route.key]

    def admit(self, scope: Scope) -> tuple[Principal | None, int]:
        """The caller (``None``: an open route with auth on) and the route's body limit, or
        the refusal (401/403) as a :class:`~kvatlas.errors.KvatlasError`."""
        access, max_body = self.route(scope["method"], scope["path"])
        if self.auth is None:
            return ANONYMOUS_ADMIN, max_body
        if access.open:
            return None, max_body
        who = self.auth.authenticate(bearer_header(scope))
        access.check(who)
        return who, max_body


class Authenticate:
    """ASGI middleware, outermost in the framework: the :class:`Gate` is applied from the
    headers; a refusal (401/403) is sent without reading the body; the body is read under the
    route's limit (:class:`~kvatlas.web.BodyLimit`). The caller is left in the scope
    (:data:`PRINCIPAL`) for the routes."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            who, max_body = self.gate.admit(scope)
        except KvatlasError as exc:
            await refuse(exc, scope, receive, send)
            return
        if who is not None:
            scope[PRINCIPAL] = who
        await BodyLimit(self.app, max_body)(scope, receive, send)


@dataclass(frozen=True, slots=True)
class FastReply:
    """What a fast route answers: a JSON body and its extra headers."""

    payload: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    status: int = 200


FastRoute = Callable[[bytes, Principal, Scope], Awaitable[FastReply]]
"""A request answered by :class:`FastPaths`: the whole body (read under its limits, after the
caller was admitted), the caller and the ASGI scope to the reply; a
:class:`~kvatlas.errors.KvatlasError` becomes the error reply."""

_JSON = (b"content-type", b"application/json")


def fast_reply_response(reply: FastReply) -> Response:
    """A fast route's reply as the framework's :class:`Response`: what its documented route
    (kept for ``/openapi.json``, answering when the fast route is not mounted) returns, so the
    two cannot differ."""
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in reply.headers}
    return Response(reply.payload, reply.status, headers, media_type="application/json")


class FastPaths:
    """The outermost ASGI layer: requests to ``routes`` (``(method, path)``) are answered here,
    in front of the framework's whole middleware stack (its error, telemetry and body-limit
    middlewares, :class:`Authenticate`, :class:`~kvatlas.web.BodyLimit`: Python on every
    request; routing and dependency injection more still, docs/performance.md). Everything else
    goes to ``app``. The same :class:`Gate` runs first, the same body limit (the route's) and
    the same error replies
    (:mod:`kvatlas.web`): which layer answered is invisible on the wire."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Mapping[tuple[str, str], FastRoute],
        gate: Gate,
        on_refused: OnRefused = lambda _reason: None,
    ) -> None:
        self.app = app
        self.routes = routes
        self.gate = gate
        self.on_refused = on_refused  # counts bodies nested too deeply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            who, max_body = self.gate.admit(scope)  # before reading the body
        except KvatlasError as exc:
            await refuse(exc, scope, receive, send)
            return
        if who is None:  # an open route is the framework's business
            await self.app(scope, receive, send)
            return
        try:
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            check_declared_length(declared, max_body)
        except KvatlasError as exc:
            await error_response(exc)(scope, receive, send)
            return
        headers = [_JSON]
        try:
            body = await receive_body(receive, max_body)
            if body is None:  # the client is gone
                return
            reply = await route(body, who, scope)
            status, payload = reply.status, reply.payload
            headers.extend(reply.headers)
        except (KvatlasError, RecursionError) as raised:
            error = raised if isinstance(raised, KvatlasError) else nested_too_deep(self.on_refused)
            status, payload = error.status, json_encoder.encode(error_payload(error))
            headers.extend(error_headers(error))
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def validation_error(exc: RequestValidationError) -> Unprocessable:
    """FastAPI's own request validation, as a 422 whose ``detail`` names the first bad field
    (``where: what``) and whose ``errors`` lists them all."""
    return field_errors(exc.errors())


def install_validation_handler(app: FastAPI) -> None:
    """Reply to FastAPI's ``RequestValidationError`` like to any other 422."""

    async def _handler(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    app.add_exception_handler(RequestValidationError, _handler)
