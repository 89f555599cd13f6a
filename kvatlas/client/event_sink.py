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
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvatlas.backoff import Backoff
from kvatlas.client.event_transports import (
    AuthSendError,
    PermanentSendError,
    SendTooLargeError,
    Transport,
)
from kvatlas.events import CacheEntry, EventBatch

log = logging.getLogger(__name__)


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
