"""What the router answers itself and how an engine's reply is relayed: OpenAI error objects
(the shape vLLM answers with), the engine's body on its way to the client with the accounting
when it ends (:class:`Relay`), the watch on a client that may leave before its reply's end
(:class:`ClientWatch`), and the cached tokens an engine reports in its reply."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Final

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Send

from kvatlas.client.keepalive import StreamedReply
from kvatlas.router.engines import Engine, EngineSet
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.openai_body import RouteRequest
from kvatlas.web import client_gone

log = logging.getLogger(__name__)

_ERROR_TYPES: Final = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
    422: "BadRequestError", 503: "ServiceUnavailableError",
}  # fmt: skip
_USAGE_TAIL_BYTES: Final = 16_384
_json = msgspec.json.Encoder()


class ReplyCut(Exception):
    """The engine's reply ended before its end (connection closed, read timed out): the
    client's reply is cut too — its connection closed without the body's end, so the client
    sees an incomplete reply, never a complete-looking one."""


class ClientWatch:
    """A request's client, watched from when its body is in until its reply's end: a client
    that leaves (its ``receive`` says ``http.disconnect``) cancels the request's task, so the
    engine's connection is closed (the engine aborts the request, its slot is freed) — while
    the router waits for the engine's reply head (a non-streamed completion has none until it
    is done) as while the reply is relayed. One watcher task a request: what Starlette's
    StreamingResponse does with a task group, only longer."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task, self._receive = task, receive
        self.left = self.done = False
        self._watcher: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Watch from now on (the request's body is in: what comes next is a disconnect)."""
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        await client_gone(self._receive)
        if not self.done:
            self.left = True
            self._task.cancel()

    def stop(self) -> None:
        """The reply is out (or about to be, whole): a client leaving now cancels nothing."""
        self.done = True
        if self._watcher is not None:
            self._watcher.cancel()

    def caused(self) -> bool:
        """After a ``CancelledError``: whether the client's leaving caused it (and no other
        cancellation, such as a shutdown's, is pending), so the request may end quietly."""
        return self.left and self._task.uncancel() == 0


_CUT: Final = contextvars.ContextVar("kvatlas_router_reply_cut", default=False)
_UNCOMPLETED: Final = "ASGI callable returned without completing response"


def mark_cut() -> None:
    """The request being answered (this task) had its reply cut on purpose (:class:`ReplyCut`:
    counted, logged by the relay): :class:`CutReplyFilter` drops uvicorn's ERROR for it."""
    _CUT.set(True)


class CutReplyFilter(logging.Filter):
    """Drops uvicorn's ERROR "ASGI callable returned without completing response" for a reply
    the router cut on purpose (:func:`mark_cut`; uvicorn logs it from the request's task
    after the app returns), one per engine failure: alerts on ERROR lines fired for what the
    router had handled. The same line for any other reply (a bug's) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT.get() and record.getMessage().startswith(_UNCOMPLETED))


def error_body(status: int, message: str, param: str | None = None,
               kind: str | None = None) -> bytes:  # fmt: skip
    """The JSON of an OpenAI error object (also the HTTP guard's refusals', the 408 and 400);
    ``param``: the request field it is about, as vLLM names it; ``kind`` its ``type`` (by the
    status unless given: vLLM's ``"Bad Request"`` for what its request validation refuses)."""
    body = {"error": {"message": message, "type": kind or _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}  # fmt: skip
    return _json.encode(body)


def openai_error(status: int, message: str) -> Response:
    """An OpenAI error object, the shape vLLM answers with."""
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return Response(error_body(status, message), status, headers, media_type="application/json")


async def send_openai_error(
    send: Send, status: int, message: str, param: str | None = None, kind: str | None = None
) -> None:
    """:func:`openai_error`, sent as plain ASGI messages."""
    body = error_body(status, message, param, kind)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def cached_tokens(reply: bytes, stream: bool) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a reply (of its last SSE event that
    has a usage, for a stream); ``None`` when the engine did not say."""
    candidates = [reply]
    if stream:
        events = [e for e in reply.split(b"\n") if e.startswith(b"data: {") and b'"usage"' in e]
        candidates = [e[len(b"data: ") :] for e in reversed(events)]
    for text in candidates:
        try:
            usage = msgspec.json.decode(text).get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            value = details.get("cached_tokens")
        except (msgspec.DecodeError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


class Relay:
    """The engine's body on its way to the client, and the accounting when it ends — however
    it ends: read whole, cut by the engine (:class:`ReplyCut` after the last piece that
    came), or closed unread (the client left, shutdown) — exactly once (:meth:`close`)."""

    def __init__(self, engines: EngineSet, metrics: RouterMetrics, policy: str, engine: Engine,
                 reply: StreamedReply, req: RouteRequest, uncomputed: int, arrived: float) -> None:  # fmt: skip
        self.engines, self.metrics, self.policy = engines, metrics, policy
        self.engine, self.reply, self.req = engine, reply, req
        self.uncomputed, self.arrived = uncomputed, arrived
        self.first, self.closed = True, False
        self.kept = bytearray()

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self.reply.read_some()
        except (OSError, TimeoutError) as exc:
            log.info("engine %s: reply cut: %r", self.engine.engine_id, exc)
            self.close()
            raise ReplyCut from None
        if not chunk:
            self.close(read_whole=True)
            raise StopAsyncIteration
        if self.first:
            self.first = False
            self.engines.first_byte(self.engine, self.uncomputed)
            self.metrics.ttft_seconds.observe(time.perf_counter() - self.arrived)
        self.kept += chunk
        if self.req.stream and len(self.kept) > 2 * _USAGE_TAIL_BYTES:
            del self.kept[:-_USAGE_TAIL_BYTES]
        return chunk

    def close(self, read_whole: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        engine, reply = self.engine, self.reply
        if self.first:
            self.engines.first_byte(engine, self.uncomputed)
        self.engines.finished(engine)
        if read_whole:
            self.metrics.e2e_seconds.observe(time.perf_counter() - self.arrived)
        else:  # cut by the engine, or the client left (shutdown too): no last byte to time
            self.metrics.aborted_streams.inc()
        reply.close()  # a whole reply's connection is back in the pool; any other closed
        if read_whole and reply.status == 200 and reply.header(b"content-encoding") is None:
            found = cached_tokens(bytes(self.kept), self.req.stream)
            if found is not None:
                self.metrics.engine(engine.engine_id, self.policy).reported_reused.inc(found)
