"""``POST /events``: cache-event batches from emitters (JSON or msgpack), applied through the
gate; one invalid batch, or one the caller may not post (another instance, a foreign salt, an
unregistered instance with auth on), refuses the whole body and nothing is applied. The
coordinator answers it on its ASGI fast path (``events_ingest.py``); this route, kept for
the OpenAPI schema, calls the same handler. See docs/coordinator.md and docs/security.md.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvatlas.coordinator.asgi import fast_reply_response
from kvatlas.coordinator.routes.deps import Caller, Ingest
from kvatlas.coordinator.schemas import EVENTS_BODY_SCHEMA

router = APIRouter()


@router.post("/events", openapi_extra=EVENTS_BODY_SCHEMA, summary="Ingest cache-event batches")
async def post_events(request: Request, ingest: Ingest, who: Caller) -> Response:
    who.require("emit")
    return fast_reply_response(await ingest.fast_route(await request.body(), who, request.scope))
