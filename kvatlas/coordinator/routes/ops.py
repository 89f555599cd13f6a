"""Operations routes: liveness, readiness (503 until the service is restored and caught up
with the stream) and Prometheus metrics. See docs/coordinator.md.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from kvatlas.api import HealthReply, ReadinessReply
from kvatlas.coordinator.routes.context import Context
from kvatlas.coordinator.views import Readiness
from kvatlas.coordinator.wire import health_to_wire, readiness_to_wire
from kvatlas.routing import Call, Reply
from kvatlas.web import json_encoder


async def healthz(ctx: Context, call: Call[None, None]) -> HealthReply:
    return health_to_wire(ctx.service.health())


async def readyz(ctx: Context, call: Call[None, None]) -> ReadinessReply | Reply:
    state = ctx.service.state
    if state is Readiness.SERVING:
        return readiness_to_wire(state)
    return Reply(json_encoder.encode(readiness_to_wire(state)), 503)


async def metrics(ctx: Context, call: Call[None, None]) -> Reply:
    data = await run_in_threadpool(generate_latest, ctx.service.metrics.registry)
    return Reply(data, media_type=CONTENT_TYPE_LATEST)
