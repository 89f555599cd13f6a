"""``POST /events``: cache-event batches from emitters (JSON or msgpack), applied through the
gate; one invalid batch, or one the caller may not post (another instance, a foreign salt, an
unregistered instance with auth on), refuses the whole body and nothing is applied. See
docs/coordinator.md and docs/security.md.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvatlas.coordinator.query import batch_salts, decode_events
from kvatlas.coordinator.routes.deps import Caller, Service
from kvatlas.coordinator.schemas import EVENTS_BODY_SCHEMA
from kvatlas.coordinator.wire import ingest_counts_to_wire
from kvatlas.errors import InvalidInput
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()


@router.post("/events", openapi_extra=EVENTS_BODY_SCHEMA, summary="Ingest cache-event batches")
async def post_events(request: Request, service: Service, who: Caller) -> Response:
    who.require("emit")
    body = await request.body()
    content_type = request.headers.get("content-type", "application/json")
    try:
        batches = await run_in_threadpool(
            decode_events, body, content_type, service.config.max_batch_entries
        )
    except InvalidInput:
        service.metrics.rejected.inc()
        raise
    for batch in batches:
        who.require_instance(batch.instance_id)
    if not who.sees_everything:  # an emit token stores only under its own salts
        who.require_salts(await run_in_threadpool(batch_salts, batches), role="emit")
    counts = await run_in_threadpool(service.ingest, batches)
    return MsgspecJSONResponse(ingest_counts_to_wire(counts))
