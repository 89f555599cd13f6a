"""``POST /events`` from body bytes to reply bytes (:class:`EventsIngest`), answered below the
framework by :class:`EventsFastPath` (routing and dependency injection cost more CPU than
applying a small batch). The documented FastAPI route (``routes/events.py``, kept for the
OpenAPI schema) calls the same handler: same checks in the same order, same errors, same
reply. The body is decoded into columns and applied in one directory call, on one worker
thread (one hop off the event loop for the whole request). See docs/coordinator.md.

Order of the checks (each refuses the whole body; nothing is applied): the ``emit`` role
(before the body is read: :class:`~kvatlas.coordinator.asgi.Authenticate`), the body (422
naming the field, 413 past ``--max-batch-entries``), each batch's instance, the keys' salts,
then the service's emitter admission.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.auth import Principal, TokenAuth
from kvatlas.coordinator.asgi import principal_of, refuse
from kvatlas.coordinator.query import batch_salts, decode_events
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.wire import ingest_counts_to_wire
from kvatlas.errors import InvalidInput, KvatlasError
from kvatlas.web import error_headers, error_payload, json_encoder

JSON_TYPE = "application/json"


class EventsIngest:
    """Applies ``POST /events`` bodies to ``service`` on ``pool``."""

    def __init__(self, service: CoordinatorService, pool: Executor) -> None:
        self.service = service
        self.pool = pool

    async def __call__(self, body: bytes, content_type: str, who: Principal) -> bytes:
        """The reply body (the ingest counts), answered on the pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.answer, body, content_type, who)

    def answer(self, body: bytes, content_type: str, who: Principal) -> bytes:
        who.require("emit")
        service = self.service
        try:
            batches = decode_events(body, content_type, service.config.max_batch_entries)
        except InvalidInput:
            service.metrics.rejected.inc()
            raise
        for batch in batches:
            who.require_instance(batch.header.instance_id)
        if not who.sees_everything:  # an emit token stores only under its own salts
            who.require_salts(batch_salts(batches), role="emit")
        return json_encoder.encode(ingest_counts_to_wire(service.ingest(batches)))


async def read_whole_body(receive: Receive) -> bytes | None:
    """Every body message of a request joined; ``None`` when the client went away (or a
    :class:`~kvatlas.web.BodyLimit` around cut the body off: it then sends the 413)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(
    send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """A complete JSON reply in two ASGI messages."""
    headers = [(b"content-type", JSON_TYPE.encode()), *headers]
    headers.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class EventsFastPath:
    """ASGI middleware answering ``POST /events`` with :class:`EventsIngest`; everything else
    passes through. The caller is authenticated before the body is read; errors are rendered
    by :mod:`kvatlas.web` as on every other path."""

    PATH = "/events"

    def __init__(self, app: ASGIApp, ingest: EventsIngest, auth: TokenAuth | None) -> None:
        self.app = app
        self.ingest = ingest
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            who = principal_of(scope, self.auth)  # before reading the body
        except KvatlasError as exc:
            await refuse(exc, scope, receive, send)
            return
        body = await read_whole_body(receive)
        if body is None:
            return
        content_type = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), JSON_TYPE
        )
        try:
            payload = await self.ingest(body, content_type, who)
        except KvatlasError as exc:
            await send_json(
                send, exc.status, json_encoder.encode(error_payload(exc)), error_headers(exc)
            )
            return
        await send_json(send, 200, payload, [])
