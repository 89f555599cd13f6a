"""What a route may ask FastAPI for: the service (the typed context every route works on), the
handlers the fast routes share with their documented routes (blend lookup, route scoring,
events ingest), and the caller (:class:`~kvatlas.auth.Principal`, found from the headers by
``asgi.Authenticate`` before the body was read; 401 when auth is on and the bearer token is
missing or unknown).

``app.py`` puts the service and the handlers on ``app.state`` (``service``, ``blend_lookup``,
``route_scoring``, ``events_ingest``).
All are ``async``: a sync dependency would cost every request a thread-pool round trip.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from kvatlas.auth import Principal
from kvatlas.coordinator.asgi import principal_of
from kvatlas.coordinator.blend_lookup import BlendLookup
from kvatlas.coordinator.events_ingest import EventsIngest
from kvatlas.coordinator.route_score import RouteScoring
from kvatlas.coordinator.service import CoordinatorService


async def _service(request: Request) -> CoordinatorService:
    service: CoordinatorService = request.app.state.service
    return service


async def _blend(request: Request) -> BlendLookup:
    blend: BlendLookup = request.app.state.blend_lookup
    return blend


async def _scoring(request: Request) -> RouteScoring:
    scoring: RouteScoring = request.app.state.route_scoring
    return scoring


async def _ingest(request: Request) -> EventsIngest:
    ingest: EventsIngest = request.app.state.events_ingest
    return ingest


async def _principal(request: Request) -> Principal:
    return principal_of(request.scope, request.app.state.service.auth)


Service = Annotated[CoordinatorService, Depends(_service)]
Blend = Annotated[BlendLookup, Depends(_blend)]
Scoring = Annotated[RouteScoring, Depends(_scoring)]
Ingest = Annotated[EventsIngest, Depends(_ingest)]
Caller = Annotated[Principal, Depends(_principal)]
