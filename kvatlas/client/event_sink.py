"""EventSink: stamps, queues and delivers cache-event batches with a bounded outbox.

``emit`` never blocks the serving path: it stamps ``(incarnation, seq)`` and appends to the
outbox; a sender thread delivers in order, retrying with capped, jittered backoff
(:class:`~kvatlas.backoff.Backoff`; one warning per new wait length) through coordinator or
Redis restarts and network blips. Beyond ``max_outbox`` batches the newest are dropped
and counted; their sequence numbers were already taken, so the coordinator sees the gap and
reports it (placements may be missing — visible, not silent).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from kvatlas.api import ErrorReply, decode
from kvatlas.auth import stream_key
from kvatlas.backoff import Backoff
from kvatlas.client.coordinator_client import auth_headers
from kvatlas.errors import InvalidInput, Unavailable, Unprocessable
from kvatlas.events import (
    CacheEntry,
    EventBatch,
    encode_json,
    encode_msgpack,
    encode_stream_fields,
)
from kvatlas.events.stream_format import sign_stream_fields
from kvatlas.redis_clients import redis_client

log = logging.getLogger(__name__)


class TransientSendError(Unavailable):
    """Worth retrying: the receiver is down, slow or overloaded."""


class AuthSendError(TransientSendError):
    """The receiver refused our credentials (401/403): retried with backoff, since a token
    rotation or an ACL fix on the coordinator makes the same batches acceptable again."""


class PermanentSendError(InvalidInput, RuntimeError):
    """Retrying cannot help (the receiver refused what was sent as malformed).

    ``batch_index`` is the position in the send of the batch the receiver named (a 422 whose
    ``field`` starts ``batches[i]``), if it named one. An ``InvalidInput``, and still the
    ``RuntimeError`` it always was, for callers that catch it as one."""

    def __init__(self, detail: str = "", *, batch_index: int | None = None) -> None:
        super().__init__(detail)
        self.batch_index = batch_index


class SendTooLargeError(PermanentSendError):
    """The receiver refused the send as too large (413): send fewer batches at a time."""


_BATCH_FIELD = re.compile(r"^batches\[(\d+)\]")


def _batch_index(response: httpx.Response) -> int | None:
    """The ``i`` of a 422 reply whose ``field`` is ``batches[i]...`` (see docs/coordinator.md)."""
    try:
        field = decode(response.content, ErrorReply, "reply").field
    except Unprocessable:
        return None
    match = _BATCH_FIELD.match(field) if field else None
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class SinkStats:
    """One consistent reading of an :class:`EventSink`'s counters."""

    seq: int
    """The last sequence number stamped (delivered, queued or dropped)."""
    pending: int
    """Batches queued or in flight."""
    sent_batches: int
    dropped_batches: int
    """Dropped on a full outbox or at close: the coordinator sees them as a gap."""
    quarantined_batches: int
    """Refused by the receiver (:class:`PermanentSendError`), one batch at a time, while the
    rest of the send was delivered: never retried; the coordinator sees each as a gap."""
    retries: int
    """Failed attempts that were retried (including :attr:`auth_failures`)."""
    auth_failures: int
    """Sends refused with 401/403: retried with backoff, never dropped."""
    splits: int
    """Sends halved because the receiver said too large (413) or refused one batch unnamed."""

    @property
    def rejected_batches(self) -> int:
        """The older name of :attr:`quarantined_batches`."""
        return self.quarantined_batches


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
            raise AuthSendError(text)
        if response.status_code == 413:
            raise SendTooLargeError(text)
        if response.status_code >= 400:
            raise PermanentSendError(text, batch_index=_batch_index(response))

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


class EventSink:
    def __init__(
        self,
        instance_id: str,
        transport: Transport,
        *,
        incarnation: int | None = None,
        max_outbox: int = 10_000,
        max_batches_per_send: int = 64,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.instance_id = instance_id
        # Must grow on every restart: nanoseconds cannot repeat within a second.
        self.incarnation = time.time_ns() if incarnation is None else incarnation
        self.transport = transport
        self.max_outbox = max_outbox
        self.max_batches_per_send = max_batches_per_send
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._clock = clock
        self._outbox: deque[EventBatch] = deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._finished = 0  # every batch up to this seq was delivered, quarantined or dropped
        self._in_flight = 0
        self._closed = False
        self.sent_batches = 0
        self.dropped_batches = 0
        self.quarantined_batches = 0
        self.auth_failures = 0
        self.splits = 0
        self.retries = 0
        self._thread = threading.Thread(
            target=self._run, name=f"kvatlas-sink-{instance_id}", daemon=True
        )
        self._thread.start()

    def emit(
        self,
        event_type: str,
        tier: str,
        backend: str,
        entries: Sequence[CacheEntry] = (),
        *,
        shared: bool = False,
        **extra: Any,
    ) -> bool:
        """Stamp and queue one batch; False if the outbox was full and it was dropped."""
        with self._cond:
            self._seq += 1
            batch = EventBatch(
                instance_id=self.instance_id,
                incarnation=self.incarnation,
                seq=self._seq,
                event_type=event_type,
                tier=tier,
                backend=backend,
                shared=shared,
                ts=self._clock(),
                entries=tuple(entries),
                **extra,
            )
            if len(self._outbox) + self._in_flight >= self.max_outbox:  # in-flight counts too
                self.dropped_batches += 1
                log.warning(
                    "event outbox full (%d): batch seq %d dropped", self.max_outbox, batch.seq
                )
                return False
            self._outbox.append(batch)
            self._cond.notify()
            return True

    @property
    def rejected_batches(self) -> int:
        """The older name of :attr:`quarantined_batches`."""
        return self.quarantined_batches

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._outbox) + self._in_flight

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far was delivered (or dropped); False on timeout.
        What is queued after the call is not waited for (a busy node's outbox is seldom
        empty)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._seq
            while (self._outbox or self._in_flight) and self._finished < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def _run(self) -> None:
        backoff = Backoff(min(self.backoff_initial, self.backoff_max), self.backoff_max)
        while True:
            with self._cond:
                while not self._outbox and not self._closed:
                    self._cond.wait()
                if not self._outbox and self._closed:
                    return
                batch_list = [
                    self._outbox.popleft()
                    for _ in range(min(self.max_batches_per_send, len(self._outbox)))
                ]
                self._in_flight = len(batch_list)
            self._deliver(batch_list, backoff)
            with self._cond:
                self._in_flight = 0
                self._finished = batch_list[-1].seq  # the outbox is in seq order
                self._cond.notify_all()

    def _deliver(self, batch_list: list[EventBatch], backoff: Backoff) -> None:
        """Deliver one send, in order: a refused batch is quarantined and the rest delivered,
        a send too large is halved, anything else is retried with ``backoff`` (reset by a
        delivery)."""
        parts: deque[list[EventBatch]] = deque([batch_list])
        while parts:
            part = parts.popleft()
            try:
                self.transport.send(part)
            except PermanentSendError as exc:
                index = exc.batch_index
                if isinstance(exc, SendTooLargeError) or index is None or index >= len(part):
                    if len(part) == 1:
                        self._quarantine(part[0], exc)
                    else:  # halve it: too large, or which batch is bad is unknown (bisect)
                        half = len(part) // 2
                        parts.extendleft([part[half:], part[:half]])
                        with self._cond:
                            self.splits += 1
                    continue
                self._quarantine(part[index], exc)
                parts.extendleft([p for p in (part[index + 1 :], part[:index]) if p])
                continue
            except Exception as exc:
                with self._cond:
                    self.retries += 1
                    if isinstance(exc, AuthSendError):
                        self.auth_failures += 1
                        log.warning("coordinator refused our credentials (%s); retrying", exc)
                    elif backoff.report():
                        log.warning(
                            "event delivery failed (%s); %d batches queued, retrying every "
                            "%.3g s at most", exc, len(self._outbox) + self._in_flight,
                            backoff.step,
                        )  # fmt: skip
                    if self._closed:  # closing gave up waiting: count, don't hang
                        self.dropped_batches += sum(len(p) for p in (part, *parts))
                        return
                    self._cond.wait(backoff.next_wait())
                parts.appendleft(part)
                continue
            with self._cond:
                self.sent_batches += len(part)
                self._in_flight -= len(part)
            backoff.reset()

    def _quarantine(self, batch: EventBatch, exc: Exception) -> None:
        """Set aside one batch the receiver refused: counted and logged; its seq is never
        delivered, so the coordinator reports it as a gap."""
        with self._cond:
            self.quarantined_batches += 1
            self._in_flight -= 1
        log.error("coordinator refused batch seq %d (quarantined, a gap): %s", batch.seq, exc)

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued (up to ``timeout``), then stop; undelivered batches are counted as dropped."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self.dropped_batches += len(self._outbox)
            self._outbox.clear()
            self._cond.notify_all()
        self._thread.join(timeout=timeout + self.backoff_max)
        self.transport.close()

    def stats(self) -> SinkStats:
        with self._cond:
            return SinkStats(
                seq=self._seq,
                pending=len(self._outbox) + self._in_flight,
                sent_batches=self.sent_batches,
                dropped_batches=self.dropped_batches,
                quarantined_batches=self.quarantined_batches,
                retries=self.retries,
                auth_failures=self.auth_failures,
                splits=self.splits,
            )
