"""EventSink: stamps, queues and delivers cache-event batches with a bounded outbox.

``emit`` never blocks the serving path: it stamps ``(incarnation, seq)`` and appends to the
outbox; a sender thread delivers in order, retrying with capped, jittered backoff
(:class:`~kvatlas.backoff.Backoff`; one warning per new wait length) through coordinator or
Redis restarts and network blips. Beyond ``max_outbox`` batches the newest are dropped
and counted; their sequence numbers were already taken, so the coordinator sees the gap and
reports it (placements may be missing — visible, not silent). A refusal that retrying cannot
change never holds up what follows: entries whose cache salt the node's token may not store
for are left out of their batches (counted), a batch refused as malformed is quarantined.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvatlas.backoff import Backoff
from kvatlas.client.event_transports import (
    AuthSendError,
    PermanentSendError,
    SaltRefusedError,
    SendTooLargeError,
    Transport,
)
from kvatlas.events import RESYNC, CacheEntry, EventBatch
from kvatlas.logs import Throttle

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
    quarantined_entries: int
    """The entries of :attr:`quarantined_batches`."""
    salt_refused_entries: int
    """Entries left out of their batches because the receiver refused their cache salt
    (:class:`SaltRefusedError`); the batches went without them, so no gap. A resync's
    listing of them is left out the same way, not counted again."""
    retries: int
    """Failed attempts that were retried (including :attr:`auth_failures`)."""
    auth_failures: int
    """Sends refused with 401/403 for the sender itself: retried with backoff, never
    dropped."""
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
        self.quarantined_entries = 0
        self.salt_refused_entries = 0
        self._say = Throttle(60.0)  # a refusal's ERROR: at once, then once a minute
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
        """Deliver one send, in order: entries refused for their salt are left out and their
        batches sent again, a refused batch is quarantined and the rest delivered, a send too
        large is halved, anything else is retried with ``backoff`` (reset by a delivery)."""
        parts: deque[list[EventBatch]] = deque([batch_list])
        while parts:
            part = parts.popleft()
            try:
                self.transport.send(part)
            except SaltRefusedError as exc:
                kept = self._without_salts(part, exc)
                if kept is not None:
                    parts.appendleft(kept)
                elif not self._retry(part, parts, AuthSendError(exc.detail), backoff):
                    return  # (none of the send's salts: a refusal of the sender, retried)
            except PermanentSendError as exc:
                self._set_aside(part, exc, parts)
            except Exception as exc:
                if not self._retry(part, parts, exc, backoff):
                    return
            else:
                with self._cond:
                    self.sent_batches += len(part)
                    self._in_flight -= len(part)
                backoff.reset()

    def _retry(
        self, part: list[EventBatch], parts: deque[list[EventBatch]], exc: Exception,
        backoff: Backoff,
    ) -> bool:  # fmt: skip
        """Wait ``backoff``'s next step, then send ``part`` again; False (the rest counted as
        dropped) when closing gave up waiting."""
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
                return False
            self._cond.wait(backoff.next_wait())
        parts.appendleft(part)
        return True

    def _set_aside(
        self, part: list[EventBatch], exc: PermanentSendError, parts: deque[list[EventBatch]]
    ) -> None:
        """Quarantine the batch the refusal names and queue the rest of ``part``; halve
        ``part`` when it was too large or the batch is not named (bisecting to it)."""
        index = exc.batch_index
        if isinstance(exc, SendTooLargeError) or index is None or index >= len(part):
            if len(part) == 1:
                self._quarantine(part[0], exc)
            else:  # halve it: too large, or which batch is bad is unknown (bisect)
                half = len(part) // 2
                parts.extendleft([part[half:], part[:half]])
                with self._cond:
                    self.splits += 1
            return
        self._quarantine(part[index], exc)
        parts.extendleft([p for p in (part[index + 1 :], part[:index]) if p])

    def _without_salts(
        self, part: list[EventBatch], exc: SaltRefusedError
    ) -> list[EventBatch] | None:
        """``part`` without the entries of the refused salts (a batch left empty still goes:
        its seq arrives, so the coordinator sees no gap, and a resync's prefixes are still
        replaced, by what the node may tell); ``None`` if it holds none of them."""
        kept: list[EventBatch] = []
        left_out = counted = 0
        for batch in part:
            entries = tuple(e for e in batch.entries if e.key.cache_salt not in exc.cache_salts)
            if len(entries) < len(batch.entries):
                left_out += len(batch.entries) - len(entries)
                if batch.event_type != RESYNC:  # a listing: its entries were counted as events
                    counted += len(batch.entries) - len(entries)
                batch = replace(batch, entries=entries)
            kept.append(batch)
        if not left_out:
            return None
        with self._cond:
            self.salt_refused_entries += counted
            total = self.salt_refused_entries
        for salt in sorted(exc.cache_salts):
            if self._say(f"salt {salt}"):
                log.error(
                    "coordinator refused cache_salt %r for this node's token: its entries are "
                    "left out of the node's events (%d so far, logged once a minute a salt; "
                    "give the node's coordinator token the salt, or store no KV under it)",
                    salt, total,
                )  # fmt: skip
        return kept

    def _quarantine(self, batch: EventBatch, exc: PermanentSendError) -> None:
        """Set aside one batch the receiver refused: counted and logged (an ERROR at once,
        then once a minute per kind of refusal: one that persists, a clock far ahead, refuses
        every batch); its seq is never delivered, so the coordinator reports it as a gap."""
        with self._cond:
            self.quarantined_batches += 1
            self.quarantined_entries += len(batch.entries)
            self._in_flight -= 1
            total = self.quarantined_batches
        if self._say(f"quarantine {exc.reason}"):
            log.error(
                "coordinator refused batch seq %d (quarantined, a gap; %d batches so far, "
                "logged once a minute per kind of refusal): %s", batch.seq, total, exc,
            )  # fmt: skip

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
                quarantined_entries=self.quarantined_entries,
                salt_refused_entries=self.salt_refused_entries,
                retries=self.retries,
                auth_failures=self.auth_failures,
                splits=self.splits,
            )
