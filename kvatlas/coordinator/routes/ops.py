"""Operations routes, open without a token: liveness, readiness (503 until the service is
restored and caught up with the stream) and Prometheus metrics. See docs/coordinator.md.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from kvatlas.coordinator.routes.deps import Service
from kvatlas.coordinator.views import Readiness
from kvatlas.coordinator.wire import health_to_wire, readiness_to_wire
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()


@router.get("/healthz", summary="Liveness")
async def healthz(service: Service) -> Response:
    return MsgspecJSONResponse(health_to_wire(service.health()))


@router.get("/readyz", summary="Readiness: restored and caught up with the stream")
async def readyz(service: Service) -> Response:
    state = service.state
    status = 200 if state is Readiness.SERVING else 503
    return MsgspecJSONResponse(readiness_to_wire(state), status_code=status)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(service: Service) -> Response:
    data = await run_in_threadpool(generate_latest, service.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
