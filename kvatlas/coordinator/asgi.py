"""ASGI plumbing of the coordinator: JSON errors, the body-size limit, and the blend-lookup
fast path (the service's hottest request, answered below the framework)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.coordinator.auth import ANONYMOUS_ADMIN, AuthError

json_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.extra = extra


class MsgspecJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_encoder.encode(content)


def error_response(status: int, detail: str, **extra: Any) -> Response:
    return MsgspecJSONResponse({"detail": detail, **extra}, status_code=status)


class BlendFastPath:
    """``POST /directory/blend-lookup`` answered at the ASGI layer, skipping routing and
    dependency injection: the service's hottest request costs ~1 ms of Python in the framework
    otherwise, on a GIL it shares with matching. Same handler, same errors, same reply as the
    FastAPI route (which stays for the OpenAPI schema)."""

    PATH = "/directory/blend-lookup"

    def __init__(self, app: ASGIApp, handler: Any, pool: Any, auth: Any) -> None:
        self.app = app
        self.handler = handler
        self.pool = pool
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
            loop = asyncio.get_running_loop()
            payload, enabled = await loop.run_in_executor(
                self.pool, self.handler, b"".join(chunks), who
            )
            headers.append((b"x-kvatlas-blend", b"enabled" if enabled else b"disabled"))
        except ApiError as exc:
            status, payload = exc.status, json_encoder.encode({"detail": exc.detail, **exc.extra})
        except AuthError as exc:
            status, payload = exc.status, json_encoder.encode({"detail": exc.message})
            if exc.status == 401:
                headers.append((b"www-authenticate", b"Bearer"))
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
