"""ASGI plumbing of the coordinator: authentication before anything else (:class:`Gate`, applied
by :class:`Authenticate` in the framework and by :class:`FastPaths` in front of it), the fast
paths (the service's hottest requests, answered in front of the framework's whole middleware
stack) and the one place request-validation errors are formatted.

Invariant: with auth on, no byte of a request body is read before the bearer token in its
headers was checked against the route's roles (:data:`ROUTE_ROLES`): an unauthenticated
client can make the coordinator read headers, nothing more. See docs/security.md.

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

from kvatlas.auth import ANONYMOUS_ADMIN, Principal, TokenAuth
from kvatlas.coordinator.query import field_errors
from kvatlas.errors import Forbidden, KvatlasError, Unprocessable
from kvatlas.web import (
    BodyLimit,
    check_declared_length,
    error_headers,
    error_payload,
    error_response,
    json_encoder,
    receive_body,
)

PRINCIPAL = "kvatlas.principal"
"""The scope key under which :class:`Authenticate` leaves the caller for the routes."""

REGISTRATION_BODY_BYTES = 64 * 1024
"""``POST /instances`` bodies: the registration fields, bounded far below ``--max-body-bytes``
(``query.MAX_METADATA_BYTES`` of metadata and a few short strings)."""
_NO_BODY = 4096  # heartbeat, deregister: nothing to read beyond what a client may send empty


@dataclass(frozen=True, slots=True)
class Access:
    """Who may call a route: ``open`` (no token), else a token holding one of ``roles`` (none
    listed: any valid token); ``every_tenant``: a token that sees every tenant's figures."""

    roles: tuple[str, ...] = ()
    open: bool = False
    every_tenant: bool = False
    max_body: int | None = None  # a tighter body limit than --max-body-bytes

    def check(self, who: Principal) -> None:
        if self.roles:
            who.require(*self.roles)
        if self.every_tenant and not who.sees_everything:
            raise Forbidden(
                "this reply covers every tenant: needs a token not bound to cache_salts"
            )


OPEN = Access(open=True)
ANY_TOKEN = Access()
ROUTE_ROLES: dict[tuple[str, str], Access] = {
    ("POST", "/events"): Access(("emit",)),
    ("POST", "/directory/lookup"): Access(("lookup",)),
    ("POST", "/directory/blend-lookup"): Access(("lookup",)),
    ("POST", "/route/score"): Access(("lookup",)),
    ("GET", "/directory/stats"): Access(("lookup",)),
    ("GET", "/directory/keys"): Access(("admin",)),
    ("POST", "/instances"): Access(("emit",), max_body=REGISTRATION_BODY_BYTES),
    ("GET", "/instances"): Access(("lookup", "emit")),
    ("PUT", "/instances/{instance_id}/heartbeat"): Access(("emit",), max_body=_NO_BODY),
    ("DELETE", "/instances/{instance_id}"): Access(("emit",), max_body=_NO_BODY),
    # LMCache 0.5.7's capacity view and chunk-size check (docs/coordinator.md, conformance)
    ("GET", "/instances/usage"): Access(("lookup",), every_tenant=True),
    ("GET", "/instances/{instance_id}/usage"): Access(("lookup",), every_tenant=True),
    ("PUT", "/config/chunk-size"): Access(("emit",), max_body=_NO_BODY),
    ("GET", "/healthz"): OPEN,
    ("GET", "/readyz"): OPEN,
    # the status page (docs/operator.md): an open shell; its data needs a token that sees every
    # tenant (as /metrics does without --public-metrics, which does not open these)
    ("GET", "/"): OPEN,
    ("GET", "/status"): OPEN,
    ("GET", "/status/fragment"): Access(("lookup",), every_tenant=True),
    ("GET", "/status.json"): Access(("lookup",), every_tenant=True),
    ("PUT", "/instances/{instance_id}/report"): Access(("emit",), max_body=_NO_BODY),
}
"""Every route's access, checked from the headers alone. The routes check the bindings that
need the body (instances, salts) themselves. A route missing here needs any valid token (and
``tests/coordinator/test_security_exposure.py`` fails until it is listed)."""
METRICS_PATH = "/metrics"
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
_METRICS = Access(("lookup",), every_tenant=True)


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
    """Who may make a request, from its headers alone: the route's :class:`Access` and the
    bearer token (checked against the route's roles) when auth is on."""

    def __init__(self, auth: TokenAuth | None, public_metrics: bool, public_docs: bool) -> None:
        self.auth = auth
        self.public_metrics = public_metrics
        self.public_docs = public_docs

    def access(self, method: str, path: str) -> Access:
        if path == METRICS_PATH:
            return OPEN if self.public_metrics else _METRICS
        if path in DOCS_PATHS:
            return OPEN if self.public_docs else ANY_TOKEN
        method = "GET" if method == "HEAD" else method
        exact = ROUTE_ROLES.get((method, path))
        return exact or ROUTE_ROLES.get(route_template(method, path), ANY_TOKEN)

    def admit(self, scope: Scope) -> tuple[Access, Principal | None]:
        """The route's access and the caller (``None``: an open route with auth on), or the
        refusal (401/403) as a :class:`~kvatlas.errors.KvatlasError`."""
        access = self.access(scope["method"], scope["path"])
        if self.auth is None:
            return access, ANONYMOUS_ADMIN
        if access.open:
            return access, None
        who = self.auth.authenticate(bearer_header(scope))
        access.check(who)
        return access, who


class Authenticate:
    """ASGI middleware, outermost in the framework: the :class:`Gate` is applied from the
    headers; a refusal (401/403) is sent without reading the body. The caller is left in the
    scope (:data:`PRINCIPAL`) for the routes."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            access, who = self.gate.admit(scope)
        except KvatlasError as exc:
            await refuse(exc, scope, receive, send)
            return
        if who is not None:
            scope[PRINCIPAL] = who
        app = self.app if access.max_body is None else BodyLimit(self.app, access.max_body)
        await app(scope, receive, send)


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
    middlewares, :class:`Authenticate`, :class:`~kvatlas.web.BodyLimit`: ≈10 µs of Python per
    request; routing and dependency injection far more, docs/performance.md). Everything else
    goes to ``app``. The same :class:`Gate` runs first, the same body limits (the route's
    :class:`Access` ``max_body``, then ``max_body``) and the same error replies
    (:mod:`kvatlas.web`): which layer answered is invisible on the wire."""

    def __init__(
        self, app: ASGIApp, routes: Mapping[tuple[str, str], FastRoute], gate: Gate, max_body: int
    ) -> None:
        self.app = app
        self.routes = routes
        self.gate = gate
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            access, who = self.gate.admit(scope)  # before reading the body
        except KvatlasError as exc:
            await refuse(exc, scope, receive, send)
            return
        if who is None:  # an open route is the framework's business
            await self.app(scope, receive, send)
            return
        limits = [n for n in (access.max_body, self.max_body) if n is not None]
        try:
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            for limit in limits:
                check_declared_length(declared, limit)
        except KvatlasError as exc:
            await error_response(exc)(scope, receive, send)
            return
        headers = [_JSON]
        try:
            body = await receive_body(receive, min(limits))
            if body is None:  # the client is gone
                return
            reply = await route(body, who, scope)
            status, payload = reply.status, reply.payload
            headers.extend(reply.headers)
        except KvatlasError as exc:
            status, payload = exc.status, json_encoder.encode(error_payload(exc))
            headers.extend(error_headers(exc))
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
