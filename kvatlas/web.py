"""HTTP plumbing shared by the coordinator and the node: every ``KvatlasError`` becomes the
same reply (its ``status``, a JSON ``detail`` and its ``extra`` fields) and every body is read
under a byte limit (413 past it, by Content-Length or while streaming, without buffering the
excess). Routes raise errors from :mod:`kvatlas.errors`; nothing else maps them to statuses.
A body nested deeper than the decoders follow is a 422 and counted, never a 500."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvatlas.errors import (
    InvalidInput,
    KvatlasError,
    PayloadTooLarge,
    Unauthorized,
    Unprocessable,
)
from kvatlas.http_body import body_too_large
from kvatlas.http_guard import WHOLE_BODY, WholeBody
from kvatlas.http_limits import NESTED_TOO_DEEP, OnRefused

json_encoder = msgspec.json.Encoder()


class MsgspecJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_encoder.encode(content)


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only (what a service warns about)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def error_payload(exc: KvatlasError) -> dict[str, Any]:
    """The wire body of an error: ``detail`` plus the error's ``extra`` fields."""
    return {"detail": exc.detail, **exc.extra}


def error_headers(exc: KvatlasError) -> list[tuple[bytes, bytes]]:
    """Headers an error's reply must carry: a 401 names the scheme it expects; a 413 closes
    the connection (the rest of the body is never read, not even to discard it)."""
    if isinstance(exc, Unauthorized):
        return [(b"www-authenticate", b"Bearer")]
    if isinstance(exc, PayloadTooLarge):
        return [(b"connection", b"close")]
    return []


def error_response(exc: KvatlasError) -> Response:
    response = MsgspecJSONResponse(error_payload(exc), status_code=exc.status)
    for name, value in error_headers(exc):
        response.headers[name.decode()] = value.decode()
    return response


def nested_too_deep(on_refused: OnRefused) -> Unprocessable:
    """The reply to a body nested deeper than the decoders follow (msgspec, like ``json``,
    gives up with a ``RecursionError`` after about a thousand levels; no legitimate body of
    any route nests more than a few): a 422, counted with ``on_refused``, never a 500 with a
    traceback."""
    on_refused(NESTED_TOO_DEEP)
    return Unprocessable("request body nests too deeply")


def check_declared_length(value: bytes | str | None, max_bytes: int) -> None:
    """Refuse a Content-Length that is not a number or announces more than ``max_bytes``."""
    if value is None:
        return
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    try:
        declared = int(text)
    except ValueError:
        raise InvalidInput("invalid Content-Length") from None
    if declared < 0:
        raise InvalidInput("invalid Content-Length")
    if declared > max_bytes:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds {max_bytes}")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body of ``request``, refused with ``PayloadTooLarge`` past ``max_bytes``."""
    check_declared_length(request.headers.get("content-length"), max_bytes)
    return await _collect(request.stream(), max_bytes)


async def _collect(parts: AsyncIterator[bytes], max_bytes: int) -> bytes:
    out: list[bytes] = []
    seen = 0
    async for part in parts:
        seen += len(part)
        if seen > max_bytes:
            raise body_too_large(max_bytes)
        out.append(part)
    return b"".join(out)


async def client_gone(receive: Receive) -> None:
    """Return when the client disconnects: what ``receive`` says once a request's body is in
    (a watcher that cancels the request's work when its client leaves first)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def receive_body(
    receive: Receive, max_bytes: int, scope: Scope | None = None
) -> bytes | None:
    """The whole body from an ASGI ``receive`` (``None`` if the client disconnected), refused
    with ``PayloadTooLarge`` past ``max_bytes`` (as :class:`BodyLimit` does). A body that came
    in one message is returned as is; pieces are joined once. When the server offers the whole
    body in one call (``scope``'s :data:`~kvatlas.http_guard.WHOLE_BODY` extension: kvatlas's
    guarded protocol), that is what is read: the same bytes and refusals, fewer copies."""
    if scope is not None:
        whole: WholeBody | None = (scope.get("extensions") or {}).get(WHOLE_BODY)
        if whole is not None:
            return await whole(max_bytes)
    pieces: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        piece: bytes = message.get("body", b"")
        seen += len(piece)
        if seen > max_bytes:
            raise body_too_large(max_bytes)
        if not message.get("more_body", False):
            if not pieces:
                return piece
            pieces.append(piece)
            return b"".join(pieces)
        pieces.append(piece)


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413, by Content-Length or while
    streaming (the app sees a disconnect, its reply is replaced by the 413)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        try:
            check_declared_length(declared, self.max_bytes)
        except KvatlasError as exc:
            await error_response(exc)(scope, receive, send)
            return
        seen = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # drop the app's reply to the cut-off body; the 413 below replaces it
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            if not exceeded or started:
                raise
        if exceeded and not started:
            too_large = body_too_large(self.max_bytes)
            await error_response(too_large)(scope, receive, send)
