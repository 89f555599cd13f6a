"""``POST /events`` from body bytes to reply bytes (:class:`EventsIngest`, the route's
handler). The body is decoded into columns and applied in one directory call: on the event
loop for a small body while the directory is free (``CoordinatorService.answers_on_loop``),
else on one worker thread (one hop off the event loop for the whole request). See
docs/coordinator.md.

Order of the checks (each refuses the whole body; nothing is applied): the ``emit`` role
(before the body is read: :mod:`kvatlas.dispatch`), the body (422
naming the field, 413 past ``--max-batch-entries``), each batch's instance, the keys' salts
(:func:`~kvatlas.coordinator.query.check_emit`, shared with signed stream entries), then the
service's incarnation bound and emitter admission.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from kvatlas.auth import Principal
from kvatlas.coordinator.ingestion import rejection_reason
from kvatlas.coordinator.query import check_emit, decode_events, salt_entries
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.wire import ingest_counts_to_wire
from kvatlas.errors import Conflict, Forbidden, InvalidInput
from kvatlas.events import ColumnBatch
from kvatlas.routing import Call, Reply
from kvatlas.web import json_encoder

JSON_TYPE = "application/json"


class EventsIngest:
    """Applies ``POST /events`` bodies to ``service`` on ``pool``."""

    def __init__(self, service: CoordinatorService, pool: Executor) -> None:
        self.service = service
        self.pool = pool

    def in_turn(self, call: Call[None, None]) -> Reply | None:
        """The ingest counts, on the event loop, for a small body while the directory is free
        (``answers_on_loop``); else ``None``."""
        if not self.service.answers_on_loop(call.raw):
            return None
        return Reply(self.answer(call.raw, call.header(b"content-type") or JSON_TYPE, call.who))

    async def handle(self, call: Call[None, None]) -> Reply:
        """The route's handler: :meth:`in_turn`'s reply, else the ingest counts from the pool."""
        reply = self.in_turn(call)
        if reply is not None:
            return reply
        content_type = call.header(b"content-type") or JSON_TYPE
        loop = asyncio.get_running_loop()
        counts = await loop.run_in_executor(
            self.pool, self.answer, call.raw, content_type, call.who
        )
        return Reply(counts)

    def answer(self, body: bytes, content_type: str, who: Principal) -> bytes:
        """The reply to a body from ``who`` (whose ``emit`` role the gate checked from the
        headers, before the body was read). A refused body is counted by reason
        (``kvatlas_event_rejected_bodies``; a 403 for salts also its entries under them,
        ``kvatlas_event_refused_entries{transport="http"}``)."""
        service = self.service
        metrics = service.metrics
        batches: list[ColumnBatch] = []
        try:
            batches = decode_events(body, content_type, service.config.max_batch_entries)
            check_emit(who, batches)
            counts = service.ingest(batches)  # (an incarnation no restart can reach: 422)
        except (InvalidInput, Forbidden, Conflict) as exc:
            reason = rejection_reason(exc)
            metrics.rejected.labels(reason).inc()
            if reason == "cache_salt":
                salts = frozenset(exc.extra["cache_salts"])
                metrics.refused_entries.labels("http", reason).inc(salt_entries(batches, salts))
            raise
        return json_encoder.encode(ingest_counts_to_wire(counts))
