"""EventSink: stamps, queues and delivers cache-event batches with a bounded outbox.

``emit`` never blocks the serving path: it stamps ``(incarnation, seq)`` and appends to the
outbox; a sender thread delivers in order, retrying with exponential backoff through
coordinator restarts and network blips. Beyond ``max_outbox`` batches the newest are dropped
and counted; their sequence numbers were already taken, so the coordinator sees the gap and
reports it (placements may be missing — visible, not silent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from kvatlas.client.coordinator_client import auth_headers
from kvatlas.errors import InvalidInput, Unavailable
from kvatlas.events import (
    CacheEntry,
    EventBatch,
    encode_json,
    encode_msgpack,
    encode_stream_fields,
)

log = logging.getLogger(__name__)


class TransientSendError(Unavailable):
    """Worth retrying: the receiver is down, slow or overloaded."""


class PermanentSendError(InvalidInput, RuntimeError):
    """Retrying cannot help (rejected as malformed or forbidden): drop and count.

    An ``InvalidInput`` (the receiver refused what was sent), and still the ``RuntimeError``
    it always was, for callers that catch it as one."""


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
    rejected_batches: int
    """Refused by the receiver (:class:`PermanentSendError`): dropped, never retried."""
    retries: int


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

    def send(self, batches: Sequence[EventBatch]) -> None:
        if self.fmt == "msgpack":
            body, content_type = encode_msgpack(list(batches)), "application/msgpack"
        else:
            body, content_type = encode_json(list(batches)), "application/json"
        try:
            response = self._http.post(
                "/events", content=body, headers={"Content-Type": content_type}
            )
        except httpx.HTTPError as exc:
            raise TransientSendError(str(exc)) from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise TransientSendError(f"status {response.status_code}")
        if response.status_code >= 400:
            raise PermanentSendError(f"status {response.status_code}: {response.text[:200]}")

    def close(self) -> None:
        self._http.close()


class RedisStreamTransport:
    """``XADD`` one stream entry per delivery (see ``kvatlas.events.stream_format``)."""

    def __init__(
        self,
        redis_url: str,
        stream: str = "kvatlas:events",
        *,
        fmt: str = "msgpack",
        maxlen: int | None = None,
    ) -> None:
        import redis

        self._errors = redis.RedisError
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self.stream = stream
        self.fmt = fmt
        self.maxlen = maxlen

    def send(self, batches: Sequence[EventBatch]) -> None:
        fields: Any = encode_stream_fields(list(batches), self.fmt)
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
        for batch in batches:
            self._consume(batch)

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
        self._in_flight = 0
        self._closed = False
        self.sent_batches = 0
        self.dropped_batches = 0
        self.rejected_batches = 0
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
    def pending(self) -> int:
        with self._cond:
            return len(self._outbox) + self._in_flight

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far was delivered (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._outbox or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def _run(self) -> None:
        backoff = self.backoff_initial
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
            delivered = False
            while not delivered:
                try:
                    self.transport.send(batch_list)
                    delivered = True
                    self.sent_batches += len(batch_list)
                    backoff = self.backoff_initial
                except PermanentSendError as exc:
                    delivered = True
                    self.rejected_batches += len(batch_list)
                    log.error("coordinator rejected %d batches: %s", len(batch_list), exc)
                except Exception as exc:
                    self.retries += 1
                    log.debug("event delivery failed (%s); retry in %.2f s", exc, backoff)
                    with self._cond:
                        if self._closed:  # closing gave up waiting: count, don't hang
                            self.dropped_batches += len(batch_list)
                            delivered = True
                            continue
                        self._cond.wait(backoff)
                    backoff = min(backoff * 2, self.backoff_max)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

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
                rejected_batches=self.rejected_batches,
                retries=self.retries,
            )
