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
from kvatlas.api import cache_control as cc
from kvatlas.coordinator.routes import (
    cache_control,
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
CACHE = Access((cache_control.ROLE,))
"""Cache control: ``admin``, or a ``cache`` token (its salts checked by the handler)."""
CACHE_EVERY_TENANT = Access((cache_control.ROLE,), every_tenant="this covers every tenant")
DOCS = Access(public_flag="docs")
"""``/openapi.json``, ``/docs``, ``/redoc``: any valid token unless ``--public-docs``."""

ROUTES: tuple[Route, ...] = (
    Route(
        "POST", "/events", EMIT, events.post_events, "Ingest cache-event batches",
        request=bytes, reply=api.IngestCountsReply, docs=events.EVENTS_DOCS,
        body=lambda b: b.events, in_turn=events.post_events_in_turn,
    ),
    Route(
        "POST", "/directory/lookup", LOOKUP, directory.lookup, "Prefix lookup by keys or by tokens",
        request=api.LookupRequest, decode=False, reply=api.LookupReply, body=lambda b: b.lookup,
        in_turn=directory.lookup_in_turn,
    ),
    Route(
        "POST", "/directory/blend-lookup", LOOKUP, directory.blend_lookup,
        "Fragment (blend) lookup", request=api.BlendLookupBody, decode=False,
        query=api.BlendLookupQuery, reply=api.BlendReply, body=lambda b: b.blend_lookup,
        in_turn=directory.blend_lookup_in_turn,
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
        body=lambda b: b.route_score, docs=route.ROUTE_SCORE_DOCS,
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
        "GET", "/instances/{instance_id}/pins", EMIT, cache_control.node_pins,
        "A node's own pins (its salts), so its LRU and L2 cap keep them",
        query=cc.NodePinsQuery, reply=cc.PinsReply,
    ),
    Route(
        "PUT", "/instances/{instance_id}/report", EMIT, status.report,
        "A node's value counters and tiers", request=bytes, reply=api.ReportReply,
    ),
    # cache control, LMCache 0.5.7's coordinator paths (docs/cache-control.md); token bodies
    # take the lookup limit (1,000,000 token ids fit by default; more is a 400)
    Route(
        "POST", "/cache/pins", CACHE, cache_control.pin, "Pin the keys of tokens (counted)",
        request=cc.TokenFields, reply=cc.PinReply, body=lambda b: b.lookup,
    ),
    Route(
        "DELETE", "/cache/pins", CACHE, cache_control.unpin, "Unpin (floors at 0)",
        request=cc.TokenFields, reply=cc.PinReply, body=lambda b: b.lookup,
    ),
    Route(
        "GET", "/cache/pins", CACHE, cache_control.pins, "Pinned keys, first pinned first",
        query=cc.PinsQuery, reply=cc.PinsReply,
    ),
    Route(
        "POST", "/cache/delete", CACHE, cache_control.delete,
        "Delete the keys of tokens from an instance (a durable command; pinned keys skipped "
        "unless force)", request=cc.CoordinatorDeleteBody, reply=cc.CoordinatorDeleteReply,
        body=lambda b: b.lookup,
    ),
    Route(
        "POST", "/cache/prefetches", CACHE, cache_control.prefetch,
        "Load the keys of tokens from an instance's L2 into its L1 (a durable command)",
        request=cc.CoordinatorPrefetchBody, reply=cc.CoordinatorPrefetchReply, status=202,
        body=lambda b: b.lookup,
    ),
    Route(
        "GET", "/cache/prefetches/{instance_id}/{request_id}", CACHE,
        cache_control.prefetch_status, "Where a prefetch stands",
        reply=cc.CoordinatorPrefetchStatus,
    ),
    Route(
        "POST", "/cache/moves", CACHE, cache_control.move,
        "Record a move of the keys of tokens from one instance's L1 to another's",
        request=cc.MoveBody, reply=cc.MoveReply, body=lambda b: b.lookup,
    ),
    Route(
        "GET", "/cache/moves/{move_id}", CACHE, cache_control.move_status,
        "Where a move stands", reply=cc.MoveStatus,
    ),
    Route(
        "GET", "/quota/config", CACHE, cache_control.quota_config,
        "The default quota (null: salts without one are exempt)", reply=cc.QuotaConfig,
    ),
    Route(
        "PUT", "/quota/config", CACHE_EVERY_TENANT, cache_control.set_quota_config,
        "Set the default quota", request=cc.QuotaConfig, reply=cc.QuotaConfig,
    ),
    Route(
        "GET", "/quota", CACHE_EVERY_TENANT, cache_control.quotas,
        "Every salt's quota and usage", reply=cc.QuotaList,
    ),
    Route(
        "PUT", "/quota/{cache_salt}", CACHE, cache_control.set_quota,
        "Set a salt's quota (_default names the empty salt)", request=cc.QuotaSetBody,
        reply=cc.QuotaSetReply,
    ),
    Route(
        "GET", "/quota/{cache_salt}", CACHE, cache_control.quota, "A salt's quota and usage",
        reply=cc.QuotaStatus,
    ),
    Route(
        "DELETE", "/quota/{cache_salt}", CACHE, cache_control.remove_quota,
        "Remove a salt's quota", reply=cc.QuotaSetReply,
    ),
)  # fmt: skip
"""Every route of the coordinator but the documentation's (``app.py`` adds those)."""

__all__ = ["DOCS", "ROUTES", "Context"]
