"""``POST /route/score``: rank instances for a query by the prefix each can load and the
fragments each can fetch, weighted by tier (``coordinator/route_score.py`` answers it; see
docs/route-scoring.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvatlas.coordinator.asgi import fast_reply_response
from kvatlas.coordinator.routes.deps import Caller, Scoring
from kvatlas.coordinator.schemas import ROUTE_SCORE_BODY_SCHEMA

router = APIRouter()


@router.post(
    "/route/score",
    summary="Score instances for a query: prefix and fragment coverage by tier",
    openapi_extra=ROUTE_SCORE_BODY_SCHEMA,
)
async def route_score(request: Request, scoring: Scoring, who: Caller) -> Response:
    who.require("lookup")
    return fast_reply_response(await scoring.fast_route(await request.body(), who, request.scope))
