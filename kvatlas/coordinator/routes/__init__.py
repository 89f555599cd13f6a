"""The coordinator's HTTP API, one table: every route in one entry — method, path, who may
call it, request and reply types (:mod:`kvatlas.api`), handler, body limit — served by
:class:`kvatlas.dispatch.Dispatcher` (``app.py``) and documented from the same entries at
``/openapi.json`` in the table's order. A handler (one module per resource) hands the request
to the layer below (``query`` to validate, the service to act, ``wire`` to reply) and holds no
logic of its own. Access is checked from the headers before any body byte is read; the
bindings that need the body (instances, salts) the handlers check. See docs/coordinator.md
("API") and docs/security.md.
"""

from __future__ import annotations

from kvatlas import api
from kvatlas.coordinator.routes import (
    config,
    directory,
    events,
    instances,
    ops,
    resync,
    route,
    status,
    usage,
)
from kvatlas.coordinator.routes.context import Context
from kvatlas.routing import OPEN, Access, Route

EMIT, LOOKUP = Access(("emit",)), Access(("lookup",))
EVERY_TENANT = Access(("lookup",), every_tenant="this reply covers every tenant")
METRICS = Access(("lookup",), every_tenant="this reply covers every tenant", public_flag="metrics")
DOCS = Access(public_flag="docs")
"""``/openapi.json``, ``/docs``, ``/redoc``: any valid token unless ``--public-docs``."""

ROUTES: tuple[Route, ...] = (
    Route(
        "POST", "/events", EMIT, events.post_events, "Ingest cache-event batches",
        request=bytes, reply=api.IngestCountsReply, docs=events.EVENTS_DOCS,
        body=lambda b: b.events,
    ),
    Route(
        "POST", "/directory/lookup", LOOKUP, directory.lookup, "Prefix lookup by keys or by tokens",
        request=api.LookupRequest, decode=False, reply=api.LookupReply, body=lambda b: b.lookup,
    ),
    Route(
        "POST", "/directory/blend-lookup", LOOKUP, directory.blend_lookup,
        "Fragment (blend) lookup", request=api.BlendLookupBody, decode=False,
        query=api.BlendLookupQuery, reply=api.BlendReply, body=lambda b: b.blend_lookup,
    ),
    Route(
        "GET", "/directory/stats",
        Access(("lookup",), every_tenant="directory statistics cover every tenant"),
        directory.stats, "Directory statistics",
    ),
    Route(
        "GET", "/directory/keys", Access(("admin",)), directory.list_keys,
        "Paginated key listing", query=api.KeyListingQuery, reply=api.KeyPageReply,
    ),
    Route(
        "POST", "/route/score", LOOKUP, route.route_score,
        "Score instances for a query: prefix and fragment coverage by tier",
        request=api.RouteScoreBody, decode=False, reply=api.RouteScoresReply,
        body=lambda b: b.route_score,
    ),
    # LMCache 0.5.7's capacity view and chunk-size check (docs/coordinator.md, conformance)
    Route(
        "GET", "/instances/usage", EVERY_TENANT, usage.fleet_usage,
        "Capacity and used bytes of every instance and pool", reply=api.FleetUsageReply,
    ),
    Route(
        "GET", "/instances/{instance_id}/usage", EVERY_TENANT, usage.instance_usage,
        "Capacity and used bytes of one instance", reply=api.InstanceUsageReply,
    ),
    Route(
        "POST", "/instances", EMIT, instances.register, "Register an instance",
        request=api.RegisterRequest, reply=api.RegisteredReply, body=lambda b: b.registration,
    ),
    Route(
        "PUT", "/instances/{instance_id}/heartbeat", EMIT, instances.heartbeat, "Heartbeat",
        reply=api.HeartbeatReply,
    ),
    Route(
        "DELETE", "/instances/{instance_id}", EMIT, instances.deregister,
        "Deregister: fence L1, forget the cursor (204, also for an unknown id)", status=204,
    ),
    Route(
        "GET", "/instances", Access(("lookup", "emit")), instances.instances,
        "Instances with liveness, cursors, gaps and lag", reply=api.InstancesReply,
    ),
    Route(
        "POST", "/instances/{instance_id}/digest", EMIT, resync.digest,
        "Compare inventory digests (resync)", request=api.DigestBody, decode=False,
        reply=api.DigestReply, body=lambda b: b.digest,
    ),
    Route(
        "PUT", "/config/chunk-size", EMIT, config.chunk_size,
        "Check an instance's chunk size (409 if not ours)", request=api.ChunkSizeRequest,
        reply=api.ChunkSizeReply,
    ),
    Route("GET", "/healthz", OPEN, ops.healthz, "Liveness", reply=api.HealthReply),
    Route(
        "GET", "/readyz", OPEN, ops.readyz, "Readiness: restored and caught up with the stream",
        reply=api.ReadinessReply,
    ),
    Route(
        "GET", "/metrics", METRICS, ops.metrics, "Prometheus metrics", media_type="text/plain",
        docs={"responses": {"200": {"content": {"text/plain": {"schema": {"type": "string"}}}}}},
    ),
    # the status page (docs/operator.md): an open shell; its data needs a token that sees every
    # tenant (as /metrics does without --public-metrics, which does not open these)
    Route("GET", "/", OPEN, status.status_page, hidden=True),
    Route("GET", "/status", OPEN, status.status_page, hidden=True),
    Route("GET", "/status/fragment", EVERY_TENANT, status.status_fragment, hidden=True),
    Route(
        "GET", "/status.json", EVERY_TENANT, status.status_json,
        "Everything the status page shows, as JSON",
    ),
    Route(
        "PUT", "/instances/{instance_id}/report", EMIT, status.report,
        "A node's value counters and tiers", request=bytes, reply=api.ReportReply,
    ),
)  # fmt: skip
"""Every route of the coordinator but the documentation's (``app.py`` adds those)."""

__all__ = ["DOCS", "ROUTES", "Context"]
