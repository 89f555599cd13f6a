"""The coordinator's HTTP API (coordinator.md §2) as an ASGI app.

Every error is a 4xx with a JSON ``detail`` that says what was wrong; a 5xx is a bug. Work that
scales with the request (decoding, applying, hashing, matching) runs in worker threads, never
on the event loop, so one large request cannot stall the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from kvatlas.coordinator._base64 import b64decode_strict
from kvatlas.coordinator.asgi import (
    ApiError,
    BlendFastPath,
    MsgspecJSONResponse,
    error_response,
    json_encoder,
)
from kvatlas.coordinator.auth import ANONYMOUS_ADMIN, AuthError, Principal
from kvatlas.coordinator.schemas import (
    BLEND_LOOKUP_BODY_SCHEMA,
    EVENTS_BODY_SCHEMA,
    BlendLookupBody,
    LookupRequest,
    RegisterRequest,
)
from kvatlas.coordinator.service import SERVING, CoordinatorService, directory_stats_wire
from kvatlas.directory import page_keys
from kvatlas.directory.records import KeyPlacements, Placement, PrefixHolder, prefix_summary
from kvatlas.events import EventDecodeError, EventValidationError, decode_json, decode_msgpack
from kvatlas.keys import BlendNamespace, ObjectKey, as_token_array
from kvatlas.web import BodyLimit

log = logging.getLogger("kvatlas.coordinator")

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


def _placement_wire(p: Placement) -> dict[str, Any]:
    return {
        "instance_id": p.instance_id,
        "incarnation": p.incarnation,
        "tier": p.tier,
        "backend": p.backend,
        "size_bytes": p.size_bytes,
        "shared": p.shared,
        "last_access": p.last_access,
    }


def _key_placements_wire(kp: KeyPlacements) -> dict[str, Any]:
    return {"key": kp.key.to_wire(), "placements": [_placement_wire(p) for p in kp.placements]}


def _prefix_wire(h: PrefixHolder) -> dict[str, Any]:
    return {
        "instance_id": h.instance_id,
        "tier": h.tier,
        "backend": h.backend,
        "shared": h.shared,
        "chunks": h.chunks,
    }


def decode_tokens_b64(text: str, max_tokens: int) -> np.ndarray[Any, Any]:
    if len(text) // 4 * 3 > 4 * max_tokens + 3:  # refuse before decoding
        raise ApiError(413, f"query exceeds --max-query-tokens {max_tokens}")
    raw = b64decode_strict(text)
    if raw is None:
        raise ApiError(422, "tokens_b64 is not valid base64")
    if len(raw) % 4:
        raise ApiError(422, f"tokens_b64 decodes to {len(raw)} bytes, not a multiple of 4 (uint32)")
    if len(raw) // 4 > max_tokens:
        raise ApiError(
            413, f"query of {len(raw) // 4} tokens exceeds --max-query-tokens {max_tokens}"
        )
    return raw.view("<u4").astype(np.uint32, copy=False)


def _query_tokens(
    token_ids: list[int] | None, tokens_b64: str | None, max_tokens: int
) -> np.ndarray[Any, Any]:
    if token_ids is not None and tokens_b64 is not None:
        raise ApiError(422, "give token_ids or tokens_b64, not both")
    if tokens_b64 is not None:
        return decode_tokens_b64(tokens_b64, max_tokens)
    ids = token_ids or []
    if len(ids) > max_tokens:
        raise ApiError(413, f"query of {len(ids)} tokens exceeds --max-query-tokens {max_tokens}")
    try:
        return as_token_array(ids)
    except ValueError as exc:
        raise ApiError(422, f"token_ids: {exc}") from None


_blend_body_decoder = msgspec.json.Decoder(BlendLookupBody)


def create_app(service: CoordinatorService) -> FastAPI:
    config = service.config
    app = FastAPI(
        title="kvatlas coordinator",
        version="0.1.0",
        description="Where every cached KV chunk of the fleet lives: prefix and blend lookup.",
    )
    app.state.service = service
    # Matching runs off the event loop on as many threads as there are cores: more threads
    # would only contend for the GIL between the compiled (nogil) scans and add latency.
    match_pool = ThreadPoolExecutor(
        max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="kvatlas-match"
    )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.detail, **exc.extra)

    @app.exception_handler(AuthError)
    async def _auth_error(_: Request, exc: AuthError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        response = error_response(exc.status, exc.message)
        if headers:
            response.headers.update(headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = [
            {
                "loc": list(e.get("loc", ())),
                "msg": str(e.get("msg", "")),
                "type": str(e.get("type", "")),
            }
            for e in exc.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return error_response(
            422, f"{where}: {first['msg']}" if where else str(first["msg"]), errors=errors
        )

    async def principal(request: Request) -> Principal:
        # async: a sync dependency would cost every request a thread-pool round trip.
        if service.auth is None:
            return ANONYMOUS_ADMIN
        return service.auth.authenticate(request.headers.get("authorization"))

    # ------------------------------------------------------------------ events

    @app.post("/events", openapi_extra=EVENTS_BODY_SCHEMA, summary="Ingest cache-event batches")
    async def post_events(request: Request, who: Principal = Depends(principal)) -> Response:
        who.require("emit")
        body = await request.body()
        content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
        decode = decode_msgpack if content_type.lower() in MSGPACK_TYPES else decode_json
        try:
            batches = await run_in_threadpool(decode, body)
        except (EventDecodeError, EventValidationError) as exc:
            service.metrics.rejected.inc()
            raise ApiError(422, str(exc), field=getattr(exc, "field", None)) from None
        entries = sum(len(b.entries) for b in batches)
        if entries > config.max_batch_entries:
            service.metrics.rejected.inc()
            raise ApiError(
                413, f"{entries} entries exceed --max-batch-entries {config.max_batch_entries}"
            )
        for batch in batches:
            who.require_instance(batch.instance_id)
        counts = await run_in_threadpool(service.ingest, batches)
        return MsgspecJSONResponse(
            {"applied": counts.applied, "duplicates": counts.duplicates, "stale": counts.stale}
        )

    # ------------------------------------------------------------------ lookups

    @app.post("/directory/lookup", summary="Prefix lookup by keys or by tokens")
    async def lookup(body: LookupRequest, who: Principal = Depends(principal)) -> Response:
        who.require("lookup")
        started = time.perf_counter()
        token_form = body.token_ids is not None or body.tokens_b64 is not None
        if (body.keys is not None) == token_form:
            raise ApiError(
                422, "give exactly one form: keys, or token_ids/tokens_b64 with model_name"
            )
        if body.keys is not None:
            if len(body.keys) > config.max_query_tokens:
                raise ApiError(413, f"{len(body.keys)} keys exceed the query limit")
            try:
                keys = [ObjectKey.from_wire(k.model_dump()) for k in body.keys]
            except ValueError as exc:
                raise ApiError(422, f"keys: {exc}") from None
            who.require_salts({k.cache_salt for k in keys})
            results = await run_in_threadpool(service.directory.lookup, keys)
            service.metrics.lookup_latency.labels("keys").observe(time.perf_counter() - started)
            return MsgspecJSONResponse(
                {
                    "chunks": len({k.chunk_hash for k in keys}),
                    "results": [_key_placements_wire(kp) for kp in results],
                    "prefix": [_prefix_wire(h) for h in prefix_summary(results)],
                }
            )
        tokens = _query_tokens(body.token_ids, body.tokens_b64, config.max_query_tokens)
        if not body.model_name:
            raise ApiError(422, "model_name is required with token_ids")
        try:
            BlendNamespace(body.model_name, body.cache_salt, body.world_size)
            if body.object_group_id < 0:
                raise ValueError("object_group_id must be >= 0")
        except ValueError as exc:
            raise ApiError(422, str(exc)) from None
        who.require_salts({body.cache_salt})
        found = await run_in_threadpool(
            service.directory.lookup_tokens,
            tokens,
            body.model_name,
            body.world_size,
            body.cache_salt,
            body.object_group_id,
        )
        service.metrics.lookup_latency.labels("tokens").observe(time.perf_counter() - started)
        return MsgspecJSONResponse(
            {
                "chunks": found.chunks,
                "results": [_key_placements_wire(kp) for kp in found.results],
                "prefix": [_prefix_wire(h) for h in found.prefix],
            }
        )

    @app.post(
        "/directory/blend-lookup",
        summary="Fragment (blend) lookup",
        openapi_extra=BLEND_LOOKUP_BODY_SCHEMA,
    )
    async def blend_lookup(request: Request, who: Principal = Depends(principal)) -> Response:
        # Normally answered before routing by BlendFastPath (asgi.py) with the same handler;
        # this route documents the body in /openapi.json.
        body = await request.body()
        loop = asyncio.get_running_loop()
        payload, enabled = await loop.run_in_executor(match_pool, blend_lookup_sync, body, who)
        headers = {"X-KVAtlas-Blend": "enabled" if enabled else "disabled"}
        return Response(payload, media_type="application/json", headers=headers)

    def blend_lookup_sync(raw: bytes, who: Principal) -> tuple[bytes, bool]:
        started = time.perf_counter()
        try:
            body = _blend_body_decoder.decode(raw)
        except msgspec.MsgspecError as exc:
            raise ApiError(422, f"body: {exc}") from None
        who.require_salts({body.cache_salt})
        tokens = _query_tokens(body.token_ids, body.tokens_b64, config.max_query_tokens)
        enabled = service.directory.blend_enabled
        if len(tokens) and not body.model_name:
            raise ApiError(422, "model_name is required with non-empty tokens")
        if not len(tokens):
            return json_encoder.encode({"matches": [], "blend_enabled": enabled}), enabled
        try:
            namespace = BlendNamespace(body.model_name or "", body.cache_salt, body.world_size)
        except ValueError as exc:
            raise ApiError(422, str(exc)) from None
        matches = service.directory.blend_match(tokens, namespace)
        reply = json_encoder.encode(
            {
                "matches": [
                    {"chunk_hash": m.chunk_hash.hex(), "old_st": m.old_st, "cur_st": m.cur_st}
                    for m in matches
                ],
                "blend_enabled": enabled,
            }
        )
        service.metrics.blend_latency.observe(time.perf_counter() - started)
        service.metrics.blend_matches.inc(len(matches))
        return reply, enabled

    @app.get("/directory/stats", summary="Directory statistics")
    async def stats(who: Principal = Depends(principal)) -> Response:
        who.require("lookup")
        data = directory_stats_wire(await run_in_threadpool(service.directory.stats))
        data["key_scheme"] = service.scheme.name
        data["instances_alive"] = len(service.instances.snapshot()[1])
        return MsgspecJSONResponse(data)

    @app.get("/directory/keys", summary="Paginated key listing")
    async def list_keys(
        tier: str | None = None,
        instance_id: str | None = None,
        backend: str | None = None,
        offset: int = Query(0, ge=0, le=10_000_000),
        limit: int = Query(100, ge=1, le=10_000),
        cursor: str | None = None,
        who: Principal = Depends(principal),
    ) -> Response:
        who.require("admin")

        def page() -> dict[str, Any]:
            got = page_keys(
                service.directory,
                tier=tier,
                instance_id=instance_id,
                backend=backend,
                offset=offset,
                limit=limit,
                cursor=cursor,
            )
            return {
                "keys": [_key_placements_wire(kp) for kp in got.items],
                "next_cursor": got.next_cursor,
                "next_offset": got.next_offset,
            }

        try:
            return MsgspecJSONResponse(await run_in_threadpool(page))
        except ValueError as exc:
            raise ApiError(422, f"cursor: {exc}") from None

    # ------------------------------------------------------------------ instances

    @app.post("/instances", summary="Register an instance")
    async def register(body: RegisterRequest, who: Principal = Depends(principal)) -> Response:
        who.require_instance(body.instance_id)
        if body.instance_id is not None and not (0 < len(body.instance_id) <= 256):
            raise ApiError(422, "instance_id must be 1..256 characters")
        instance_id, again = service.instances.register(
            body.instance_id,
            ip=body.ip,
            http_port=body.http_port,
            metadata=body.metadata,
            p2p_advertised_url=body.p2p_advertised_url,
            mq_port=body.mq_port,
        )
        return MsgspecJSONResponse({"instance_id": instance_id, "re_registered": again})

    @app.put("/instances/{instance_id}/heartbeat", summary="Heartbeat")
    async def heartbeat(instance_id: str, who: Principal = Depends(principal)) -> Response:
        who.require_instance(instance_id)
        if not service.instances.heartbeat(instance_id):
            raise ApiError(404, "unknown instance; re-register")
        return MsgspecJSONResponse({"instance_id": instance_id, "ok": True})

    @app.delete("/instances/{instance_id}", summary="Deregister: fence L1, forget the cursor")
    async def deregister(instance_id: str, who: Principal = Depends(principal)) -> Response:
        who.require_instance(instance_id)
        known = (
            service.instances.known(instance_id)
            or service.directory.gap_state(instance_id) is not None
        )
        fenced = await run_in_threadpool(service.deregister, instance_id)
        return MsgspecJSONResponse({"instance_id": instance_id, "known": known, "fenced": fenced})

    @app.get("/instances", summary="Instances with liveness, cursors, gaps and lag")
    async def instances(who: Principal = Depends(principal)) -> Response:
        who.require("lookup", "emit")
        return MsgspecJSONResponse({"instances": service.instances_view()})

    # ------------------------------------------------------------------ health

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> Response:
        return MsgspecJSONResponse(service.health())

    @app.get("/readyz", summary="Readiness: restored and caught up with the stream")
    async def readyz() -> Response:
        ready = service.state == SERVING
        return MsgspecJSONResponse(
            {"ready": ready, "state": service.state}, status_code=200 if ready else 503
        )

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        data = await run_in_threadpool(generate_latest, service.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BlendFastPath, handler=blend_lookup_sync, pool=match_pool, auth=service.auth)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    return app


RequestHandler = Callable[[Request], Awaitable[Response]]
