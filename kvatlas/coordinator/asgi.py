"""ASGI plumbing of the coordinator: the blend-lookup fast path (the service's hottest request,
answered below the framework) and the one place request-validation errors are formatted.

Every error reply is rendered by :mod:`kvatlas.web` from a :mod:`kvatlas.errors` class, on the
fast path and in the framework alike, so a status, ``detail`` or header never depends on which
path answered. See docs/coordinator.md ("API").
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.auth import ANONYMOUS_ADMIN, TokenAuth
from kvatlas.coordinator.blend_lookup import BLEND_HEADERS, BlendLookup
from kvatlas.errors import KvatlasError, Unprocessable
from kvatlas.web import error_headers, error_payload, error_response, json_encoder


class BlendFastPath:
    """``POST /directory/blend-lookup`` answered at the ASGI layer, skipping routing and
    dependency injection (framework overhead on a GIL shared with matching). Same handler,
    same errors, same reply as the FastAPI route (which stays for the OpenAPI schema)."""

    PATH = "/directory/blend-lookup"

    def __init__(self, app: ASGIApp, lookup: BlendLookup, auth: TokenAuth | None) -> None:
        self.app = app
        self.lookup = lookup
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        status, headers = 200, [(b"content-type", b"application/json")]
        try:
            who = ANONYMOUS_ADMIN
            if self.auth is not None:
                authorization = next(
                    (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"),
                    None,
                )
                who = self.auth.authenticate(authorization)
            payload, enabled = await self.lookup(b"".join(chunks), who)
            headers.append(BLEND_HEADERS[enabled])
        except KvatlasError as exc:
            status, payload = exc.status, json_encoder.encode(error_payload(exc))
            headers.extend(error_headers(exc))
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def validation_error(exc: RequestValidationError) -> Unprocessable:
    """FastAPI's own request validation, as a 422 whose ``detail`` names the first bad field
    (``where: what``) and whose ``errors`` lists them all."""
    errors = [
        {
            "loc": list(e.get("loc", ())),
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    return Unprocessable(f"{where}: {first['msg']}" if where else str(first["msg"]), errors=errors)


def install_validation_handler(app: FastAPI) -> None:
    """Reply to FastAPI's ``RequestValidationError`` like to any other 422."""

    async def _handler(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    app.add_exception_handler(RequestValidationError, _handler)
