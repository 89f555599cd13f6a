"""The directory's routes: prefix lookup (by keys or by tokens), blend lookup, statistics and
the paginated key listing. See docs/coordinator.md and docs/directory.md.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kvatlas.api import KeyPageReply
from kvatlas.coordinator.asgi import fast_reply_response
from kvatlas.coordinator.query import KeysQuery, decode_lookup_body, lookup_query
from kvatlas.coordinator.routes.deps import Blend, Caller, Service
from kvatlas.coordinator.schemas import BLEND_LOOKUP_BODY_SCHEMA, LOOKUP_BODY_SCHEMA
from kvatlas.coordinator.wire import key_page_to_wire, lookup_to_wire, stats_to_wire
from kvatlas.errors import Forbidden
from kvatlas.web import MsgspecJSONResponse

router = APIRouter()


@router.post(
    "/directory/lookup",
    summary="Prefix lookup by keys or by tokens",
    openapi_extra=LOOKUP_BODY_SCHEMA,
)
async def lookup(request: Request, service: Service, who: Caller) -> Response:
    who.require("lookup")
    started = time.perf_counter()
    # A body may be tens of MB (asgi.ROUTES): it is parsed on a worker thread, never on the
    # event loop, and sized up from its bytes before a token is decoded.
    config = service.config
    raw = await request.body()
    body = await run_in_threadpool(
        decode_lookup_body, raw, config.max_query_tokens, config.max_lookup_keys
    )
    query = await run_in_threadpool(
        lookup_query, body, config.max_query_tokens, config.max_lookup_keys
    )
    who.require_salts(query.salts)
    if isinstance(query, KeysQuery):
        found = await run_in_threadpool(service.lookup_keys, query.keys)
    else:
        found = await run_in_threadpool(
            service.directory.lookup_tokens,
            query.tokens,
            query.model_name,
            query.world_size,
            query.cache_salt,
            query.object_group_id,
        )
    service.metrics.lookup_latency.labels(query.form).observe(time.perf_counter() - started)
    return MsgspecJSONResponse(lookup_to_wire(found))


@router.post(
    "/directory/blend-lookup",
    summary="Fragment (blend) lookup",
    openapi_extra=BLEND_LOOKUP_BODY_SCHEMA,
)
async def blend_lookup(request: Request, blend: Blend, who: Caller) -> Response:
    # Normally answered in front of the framework by asgi.FastPaths with the same handler;
    # this route documents the body in /openapi.json.
    return fast_reply_response(await blend.fast_route(await request.body(), who, request.scope))


@router.get("/directory/stats", summary="Directory statistics")
async def stats(service: Service, who: Caller) -> Response:
    who.require("lookup")
    if not who.sees_everything:  # per-salt figures are not kept (docs/security.md)
        raise Forbidden(
            "directory statistics cover every tenant: needs a token not bound to cache_salts"
        )
    return MsgspecJSONResponse(stats_to_wire(await run_in_threadpool(service.stats)))


@router.get("/directory/keys", summary="Paginated key listing")
async def list_keys(
    service: Service,
    who: Caller,
    tier: str | None = None,
    instance_id: str | None = None,
    backend: str | None = None,
    offset: int = Query(0, ge=0, le=10_000_000),
    limit: int = Query(100, ge=1, le=10_000),
    cursor: str | None = None,
) -> Response:
    who.require("admin")

    def page() -> KeyPageReply:
        return key_page_to_wire(
            service.page_keys(
                tier=tier,
                instance_id=instance_id,
                backend=backend,
                offset=offset,
                limit=limit,
                cursor=cursor,
            )
        )

    return MsgspecJSONResponse(await run_in_threadpool(page))
