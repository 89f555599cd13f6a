"""Redis Streams transport: read event batches through a consumer group, apply, acknowledge.

Durability argument: an entry is acknowledged only after it was applied; the snapshot records
the last applied stream id; on start the group is rewound to that id (``XGROUP SETID``), so
everything after the snapshot is delivered again. Entries applied after the snapshot but before
a crash come back too, and the gate drops them as duplicates. Nothing is lost, nothing is
applied twice. Each coordinator replica uses its own group and so builds the full view. See
docs/coordinator.md ("Durability and transports").

The consumer knows nothing of the service that runs it: it is handed an ingest function, a
callback for the last applied stream id, a readiness setter and a stop event.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Counter

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.query import check_entry_count
from kvatlas.coordinator.views import Readiness
from kvatlas.errors import Conflict, Forbidden, InvalidInput, KvatlasError
from kvatlas.events import EventBatch, EventDecodeError, EventValidationError, decode_stream_fields

log = logging.getLogger(__name__)

READ_COUNT = 256
BLOCK_MS = 500


def rejection_reason(exc: KvatlasError) -> str:
    """The ``reason`` label of a refused stream entry."""
    if isinstance(exc, Forbidden):
        return "unregistered"
    if isinstance(exc, Conflict):
        return "emitter_cap"
    return "too_large" if exc.status == 413 else "invalid"


class StreamConsumer:
    """Consumes ``config.event_stream`` from ``position`` (the snapshot's stream id; ``None``
    = from the beginning) until ``stop`` is set.

    ``ingest`` applies decoded batches; ``on_position`` is told each entry id once the entry
    is applied (the snapshot records it); ``set_readiness(SERVING)`` is called once, when the
    consumer first reaches the end of the stream; ``errors`` counts failures by kind
    (``redis``, ``decode``, ``internal``). Every entry passes the checks a ``POST /events``
    body passes (``--max-batch-entries``; the service's emitter admission inside ``ingest``):
    a producer with stream access cannot do more than an emitter over HTTP. A refused entry
    is counted in ``rejected`` by reason, acknowledged and never applied."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        ingest: Callable[[Sequence[EventBatch]], object],
        position: str | None,
        on_position: Callable[[str], None],
        set_readiness: Callable[[Readiness], None],
        stop: threading.Event,
        errors: Counter,
        rejected: Counter,
    ) -> None:
        import redis

        self._redis_mod = redis
        self._ingest = ingest
        self._on_position = on_position
        self._set_readiness = set_readiness
        self._stop = stop
        self._errors = errors
        self._rejected = rejected
        self.max_entries = config.max_batch_entries
        self.position = position
        self.stream = config.event_stream
        self.group = config.group_name
        self.consumer = f"{socket.gethostname()}-{config.port}"
        self.client = redis.Redis.from_url(
            config.redis_url or "", socket_timeout=BLOCK_MS / 1000 + 5, socket_connect_timeout=5
        )
        self.applied_entries = 0
        self.bad_entries = 0
        self.rejected_entries = 0
        self._caught_up = False

    def _prepare_group(self) -> None:
        """Create the group, or rewind it, to the last applied position ("0" = everything)."""
        start = self.position or "0"
        try:
            self.client.xgroup_create(self.stream, self.group, id=start, mkstream=True)
        except self._redis_mod.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            self.client.xgroup_setid(self.stream, self.group, id=start)
        log.info("consuming %s as group %s from %s", self.stream, self.group, start)

    def run(self) -> None:
        backoff = 0.2
        prepared = False
        stop = self._stop
        while not stop.is_set():
            try:
                if not prepared:
                    self._prepare_group()
                    prepared = True
                caught_up = self._read_once()
                if caught_up and not self._caught_up:
                    self._caught_up = True
                    self._set_readiness(Readiness.SERVING)
                    log.info("caught up with %s at %s", self.stream, self.position)
                backoff = 0.2
            except self._redis_mod.RedisError as exc:
                self._errors.labels("redis").inc()
                log.warning("redis stream unavailable (%s); retrying in %.1f s", exc, backoff)
                # A restarted Redis may have lost the group (NOGROUP): prepare it again.
                prepared = prepared and "NOGROUP" not in str(exc)
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # a bug: keep the transport alive, the entry stays pending
                self._errors.labels("internal").inc()
                log.exception("stream consumer error; retrying")
                stop.wait(backoff)

    def _read_once(self) -> bool:
        """Read, apply and acknowledge one batch of entries; True when the stream had no more."""
        reply: Any = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=READ_COUNT, block=BLOCK_MS
        )
        if not reply:
            return True
        _, entries = reply[0]
        for entry_id, fields in entries:
            self._apply(entry_id, fields)
        return len(entries) < READ_COUNT

    def _apply(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            batches = decode_stream_fields(fields)
        except (EventDecodeError, EventValidationError) as exc:
            # A malformed entry can never become valid: skip it rather than block the stream.
            self.bad_entries += 1
            self._errors.labels("decode").inc()
            log.error("stream entry %s rejected: %s", entry_id.decode(), exc)
        else:
            try:
                check_entry_count(batches, self.max_entries)
                self._ingest(batches)
            except (InvalidInput, Forbidden, Conflict) as exc:
                self.rejected_entries += 1
                self._rejected.labels(rejection_reason(exc)).inc()
                log.warning("stream entry %s refused: %s", entry_id.decode(), exc.detail)
            else:
                self.applied_entries += 1
        self.position = entry_id.decode()
        self._on_position(self.position)
        self.client.xack(self.stream, self.group, entry_id)
