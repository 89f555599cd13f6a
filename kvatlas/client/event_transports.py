"""How an :class:`~kvatlas.client.EventSink` hands batches on (HTTP ``POST /events``, a Redis
stream entry, a consumer in the same process), and the refusals it tells apart: worth
retrying (:class:`TransientSendError`, :class:`AuthSendError`) or not
(:class:`PermanentSendError`: quarantine the batch; :class:`SendTooLargeError`: halve the
send; :class:`SaltRefusedError`: send it without the refused salts' entries). See
docs/coordinator.md, "Durability and transports".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import httpx

from kvatlas.api import ErrorReply, decode
from kvatlas.auth import stream_key
from kvatlas.client.coordinator_client import auth_headers
from kvatlas.errors import InvalidInput, Unavailable, Unprocessable
from kvatlas.events import EventBatch, encode_json, encode_msgpack, encode_stream_fields
from kvatlas.events.stream_format import sign_stream_fields
from kvatlas.redis_clients import redis_client


class TransientSendError(Unavailable):
    """Worth retrying: the receiver is down, slow or overloaded."""


class AuthSendError(TransientSendError):
    """The receiver refused our credentials (401/403 for the node itself: its token, role,
    instance or registration): retried with backoff, since a token rotation, an ACL fix or
    the node's registration makes the same batches acceptable again (and every batch of the
    node would be refused alike meanwhile). A 403 for some entries' salts is a
    :class:`SaltRefusedError`."""


class PermanentSendError(InvalidInput, RuntimeError):
    """Retrying cannot help (the receiver refused what was sent as malformed).

    ``batch_index`` is the position in the send of the batch the receiver named (a 422 whose
    ``field`` starts ``batches[i]``), if it named one. An ``InvalidInput``, and still the
    ``RuntimeError`` it always was, for callers that catch it as one. ``reason`` says what
    kind of refusal it is, the same for every batch refused alike (the reply's status and
    ``field`` without the batch's index: ``422 batches[].incarnation``), so a refusal that
    persists is logged once a minute, not once per batch."""

    def __init__(
        self, detail: str = "", *, batch_index: int | None = None, reason: str = ""
    ) -> None:
        super().__init__(detail)
        self.batch_index = batch_index
        self.reason = reason or type(self).__name__


class SendTooLargeError(PermanentSendError):
    """The receiver refused the send as too large (413): send fewer batches at a time."""


class SaltRefusedError(PermanentSendError):
    """The receiver refused the send for the cache salts of some of its entries (a 403 naming
    them in ``cache_salts``): the sender's token may not store for them, which no retry
    changes; the batches go again without those entries."""

    def __init__(self, detail: str = "", *, cache_salts: Iterable[str]) -> None:
        super().__init__(detail)
        self.cache_salts = frozenset(cache_salts)


_BATCH_FIELD = re.compile(r"^batches\[(\d+)\]")


def _error_reply(response: httpx.Response) -> ErrorReply:
    try:
        return decode(response.content, ErrorReply, "reply")
    except Unprocessable:
        return ErrorReply()


def _batch_index(field: str | None) -> int | None:
    """The ``i`` of a 422 reply whose ``field`` is ``batches[i]...`` (see docs/coordinator.md)."""
    match = _BATCH_FIELD.match(field) if field else None
    return int(match.group(1)) if match else None


def _refusal_reason(status: int, field: str | None) -> str:
    """A refusal's kind: its status and ``field`` without the batch's index."""
    return f"{status} {_BATCH_FIELD.sub('batches[]', field or '')}".rstrip()


class Transport(Protocol):
    def send(self, batches: Sequence[EventBatch]) -> None: ...

    def close(self) -> None: ...


class HttpTransport:
    def __init__(
        self, url: str, *, fmt: str = "msgpack", token: str | None = None, timeout: float = 5.0
    ) -> None:
        if fmt not in ("msgpack", "json"):
            raise ValueError("fmt must be msgpack or json")
        self.fmt = fmt
        self._http = httpx.Client(
            base_url=url.rstrip("/"), timeout=timeout, headers=auth_headers(token)
        )

    def encode(self, batches: Sequence[EventBatch]) -> tuple[bytes, str]:
        """The body and content type of one ``POST /events``."""
        if self.fmt == "msgpack":
            return encode_msgpack(list(batches)), "application/msgpack"
        return encode_json(list(batches)), "application/json"

    def send(self, batches: Sequence[EventBatch]) -> None:
        body, content_type = self.encode(batches)
        try:
            response = self._http.post(
                "/events", content=body, headers={"Content-Type": content_type}
            )
        except httpx.HTTPError as exc:
            raise TransientSendError(str(exc)) from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise TransientSendError(f"status {response.status_code}")
        text = f"status {response.status_code}: {response.text[:200]}"
        if response.status_code in (401, 403):
            salts = _error_reply(response).cache_salts if response.status_code == 403 else None
            if salts:
                raise SaltRefusedError(text, cache_salts=salts)
            raise AuthSendError(text)
        if response.status_code == 413:
            raise SendTooLargeError(text)
        if response.status_code >= 400:
            field = _error_reply(response).field
            raise PermanentSendError(
                text,
                batch_index=_batch_index(field),
                reason=_refusal_reason(response.status_code, field),
            )

    def close(self) -> None:
        self._http.close()


class RedisStreamTransport:
    """``XADD`` one stream entry per delivery (see ``kvatlas.events.stream_format``), signed
    with the key of ``token`` (the node's coordinator token) when one is given: a coordinator
    with auth on applies only entries signed by a token that may act for their instance."""

    def __init__(
        self,
        redis_url: str,
        stream: str = "kvatlas:events",
        *,
        fmt: str = "msgpack",
        maxlen: int | None = None,
        token: str | None = None,
    ) -> None:
        import redis

        self._errors = redis.RedisError
        self._redis = redis_client(redis_url, socket_timeout=5)
        self.stream = stream
        self.fmt = fmt
        self.maxlen = maxlen
        self._key = stream_key(token) if token else None

    def send(self, batches: Sequence[EventBatch]) -> None:
        fields: Any = encode_stream_fields(list(batches), self.fmt)
        if self._key is not None:
            fields = sign_stream_fields(fields, self.stream, self._key.key_id, self._key.secret)
        try:
            self._redis.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        except self._errors as exc:
            raise TransientSendError(str(exc)) from exc

    def close(self) -> None:
        self._redis.close()


class InProcessTransport:
    """The embedded default: hand batches straight to a consumer (e.g. ``KeyDirectory.consume``)."""

    def __init__(self, consume: Callable[[EventBatch], object]) -> None:
        self._consume = consume

    def send(self, batches: Sequence[EventBatch]) -> None:
        for i, batch in enumerate(batches):
            try:
                self._consume(batch)
            except PermanentSendError as exc:
                if exc.batch_index is not None:
                    raise
                # Name the refused batch: those before it were consumed, so none is resent.
                raise PermanentSendError(exc.detail, batch_index=i) from exc

    def close(self) -> None:
        pass


__all__ = [
    "AuthSendError",
    "HttpTransport",
    "InProcessTransport",
    "PermanentSendError",
    "RedisStreamTransport",
    "SaltRefusedError",
    "SendTooLargeError",
    "TransientSendError",
    "Transport",
]
