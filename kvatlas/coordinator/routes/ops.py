"""Operations routes: liveness, readiness (503 until the service is restored and caught up
with the stream) and Prometheus metrics. See docs/coordinator.md.

``--public-metrics`` opens ``/metrics`` to callers without a token; they get no series that
names a cache salt (a tenant: nobody may learn about a salt it does not own, docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Metric, generate_latest
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from kvatlas.api import HealthReply, ReadinessReply
from kvatlas.auth import authorization_of
from kvatlas.coordinator.routes.context import Context
from kvatlas.coordinator.views import Readiness
from kvatlas.coordinator.wire import health_to_wire, readiness_to_wire
from kvatlas.errors import KvatlasError
from kvatlas.routing import NOBODY, Call, Reply
from kvatlas.web import json_encoder

SALT_LABEL = "cache_salt"


async def healthz(ctx: Context, call: Call[None, None]) -> HealthReply:
    return health_to_wire(ctx.service.health())


async def readyz(ctx: Context, call: Call[None, None]) -> ReadinessReply | Reply:
    state = ctx.service.state
    if state is Readiness.SERVING:
        return readiness_to_wire(state)
    return Reply(json_encoder.encode(readiness_to_wire(state)), 503)


async def metrics(ctx: Context, call: Call[None, None]) -> Reply:
    registry: Collector = ctx.service.metrics.registry
    if not _sees_every_tenant(ctx, call):
        registry = _WithoutSalts(ctx.service.metrics.registry)
    data = await run_in_threadpool(generate_latest, registry)
    return Reply(data, media_type=CONTENT_TYPE_LATEST)


def _sees_every_tenant(ctx: Context, call: Call[None, None]) -> bool:
    """Whether the caller may read every tenant's series: auth off, a token the route checked
    (``/metrics`` admits only those that see every tenant), or, on a route opened by
    ``--public-metrics`` (no token asked for), a valid token sent anyway that sees them."""
    auth = ctx.service.auth
    if auth is None or call.who is not NOBODY:
        return True
    try:  # (two Authorization headers are no credential: authorization_of refuses them)
        authorization = authorization_of(call.scope["headers"])
        return authorization is not None and auth.authenticate(authorization).sees_everything
    except KvatlasError:
        return False


class _WithoutSalts(Collector):
    """``registry``'s families but those whose samples carry a cache salt."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if not any(SALT_LABEL in sample.labels for sample in family.samples):
                yield family
