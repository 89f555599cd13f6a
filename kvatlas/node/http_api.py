"""The node's HTTP surface: peer L1 for other nodes, and an engine API for engines (and the
multi-process demo and tests) that run in another process.

Engine calls carry msgpack bodies (tokens as little-endian uint32 bytes, KV as raw bytes in the
layout's dtype) and get msgpack replies; a call sent as JSON (bytes as base64) gets JSON. Every
bad input is a 4xx with a ``detail`` in the call's format (:func:`kvatlas.web.error_payload`):
a :class:`~kvatlas.errors.KvatlasError` replies its own ``status``; any other ``ValueError`` a
call provokes is :class:`~kvatlas.errors.Unprocessable`. The peer route keeps its JSON errors
(:mod:`kvatlas.node.peer`).

:class:`ApiGate` sees each request before its body is read: with ``--engine-port`` it serves
``/engine/*`` only on that listener and ``/peer/*`` only on the other; with auth it needs an
``engine`` token on ``/engine/*`` (the call's ``cache_salt`` inside its binding) and on
``/peer/*`` this node's own peer credential (derived from the fleet's peer secret for this
instance, :mod:`kvatlas.node.peer_credentials`) or a ``peer`` token of the auth file. Bodies are read under a limit (``NodeConfig.max_call_bytes``, store:
``max_store_bytes``). Blend lookups are poll-able: the node keeps each request's tracker for a
while (:mod:`kvatlas.node.engine_trackers`, bound to the calling principal), so the keys of
every call come from the same tracker (the single injection point). See ``docs/node.md``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated, Any, Final, TypeVar

import msgspec
import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.api import KeyRow, decode, encode
from kvatlas.api.cache_control import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    ClearBody,
    DeleteObjectsBody,
    PrefetchBody,
    TierName,
)
from kvatlas.api.engine import (
    BlendLookupReply,
    BlendPart,
    BlendRetrieveReply,
    EngineCall,
    EngineLayout,
    HitReply,
    InventoryReply,
    InventoryRow,
    NodeHealthReply,
    RetrieveReply,
    StoreReply,
    WireSegment,
)
from kvatlas.auth import ANONYMOUS_ADMIN, DOCS_PATHS, Principal, TokenAuth, parse_bearer
from kvatlas.client.engine_client import MSGPACK
from kvatlas.errors import Forbidden, KvatlasError, NotFound, PayloadTooLarge, Unprocessable
from kvatlas.keys import MMItem, RequestTracker
from kvatlas.node.cache_control import NodeCacheControl
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.engine_trackers import Identity, Trackers
from kvatlas.node.peer import create_peer_app
from kvatlas.node.peer_credentials import PeerSecret
from kvatlas.node.segments import Segment
from kvatlas.web import (
    error_headers,
    error_payload,
    error_response,
    install_nesting_handler,
    nested_too_deep,
    read_body,
)

ENGINE_PREFIX: Final = "/engine/"
PEER_PREFIX: Final = "/peer/"
CACHE_PREFIX: Final = "/cache/"
"""The MP-server cache-control routes (:func:`add_cache_control_routes`): ``admin`` only."""
METRICS_PATH: Final = "/metrics"
_ANY_TOKEN: Final = ""  # ApiGate: a valid token of any role
BLEND_REQUIRED: Final = ("request_id",)
"""A blend lookup is polled, and its retrieval found, under its request id."""
_OFF_LOOP_BYTES: Final = 1 << 20  # bodies above this are decoded in the thread pool
_msgpack_encoder = msgspec.msgpack.Encoder()
PEER_NODE: Final = Principal("peer-node", frozenset({"peer"}))
"""Who presents this node's own peer credential: another node of the fleet."""
(_CALL_SCHEMA, _LAYOUT_SCHEMA), _SCHEMAS = msgspec.json.schema_components(
    [EngineCall, EngineLayout], ref_template="#/components/schemas/{name}"
)
_REQUEST_BODY: Final = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _CALL_SCHEMA},
            MSGPACK: {"schema": _CALL_SCHEMA},
        },
    }
}
_json_encoder = msgspec.json.Encoder()


_msgpack_decoder = msgspec.msgpack.Decoder(EngineCall)
_json_decoder = msgspec.json.Decoder(EngineCall)


def _decode_call(body: bytes, msgpack: bool) -> EngineCall:
    return _msgpack_decoder.decode(body) if msgpack else _json_decoder.decode(body)


def segment_to_wire(seg: Segment) -> WireSegment:
    return WireSegment(
        seg.chunk_hash.hex(), seg.old_st, seg.cur_st, seg.length, seg.source, int(seg.cost),
        seg.trim,
    )  # fmt: skip


def _part(seg: Segment, kv: Any) -> BlendPart:
    """A retrieved segment with its KV."""
    fields = msgspec.structs.asdict(segment_to_wire(seg))
    return BlendPart(**fields, kv=np.ascontiguousarray(kv).tobytes())


def segment_of(wire: WireSegment) -> Segment:
    """A decoded wire segment as the node's :class:`Segment`."""
    return Segment(
        bytes.fromhex(wire.chunk_hash), wire.old_st, wire.cur_st, wire.length,
        wire.source, wire.cost, wire.trim,  # type: ignore[arg-type]  # checked by Segment
    )  # fmt: skip


def _short_store(tracker: RequestTracker, call: EngineCall, chunk_size: int) -> str:
    """Why a store kept fewer chunks than it sent (a reply field, only then)."""
    if not tracker.cacheable:
        return "the request has no cacheable key (a multimodal item without a usable identity)"
    tokens = len(call.tokens) // 4
    full = tokens // chunk_size
    return (
        f"only full chunks are stored: {tokens} tokens hold {full} full chunk(s) of "
        f"{chunk_size}, and chunks {call.first_chunk}..{call.first_chunk + call.n_chunks - 1} "
        "were sent"
    )


def _wants_msgpack(headers: Any) -> bool:
    """Whether a request speaks msgpack (its body or the reply it accepts); else JSON."""
    return MSGPACK in headers.get("content-type", "") or MSGPACK in headers.get("accept", "")


def _reply(payload: Any, msgpack: bool, status: int = 200) -> Response:
    if msgpack:
        return Response(_msgpack_encoder.encode(payload), status_code=status, media_type=MSGPACK)
    return Response(
        _json_encoder.encode(payload), status_code=status, media_type="application/json"
    )


def _error_reply(exc: KvatlasError, msgpack: bool) -> Response:
    if not msgpack:
        return error_response(exc)
    response = _reply(error_payload(exc), True, exc.status)
    for name, value in error_headers(exc):
        response.headers[name.decode()] = value.decode()
    return response


class ApiGate:
    """ASGI middleware, before any body is read: which listener serves a path (with a
    separate ``engine_port``) and who calls it (``auth``; none = everyone is admin; on
    ``/peer/*`` also ``peer_secret``'s credential for ``instance_id()``). The principal goes
    to ``request.state.principal``."""

    def __init__(
        self,
        app: ASGIApp,
        auth: TokenAuth | None,
        engine_port: int | None,
        public_metrics: bool = True,
        peer_secret: PeerSecret | None = None,
        instance_id: Callable[[], str] = lambda: "",
        public_docs: bool = True,
    ) -> None:
        self.app = app
        self.auth = auth
        self.engine_port = engine_port
        self.public_metrics = public_metrics  # else /metrics needs an admin token
        self.peer_secret = peer_secret
        self.instance_id = instance_id
        self.public_docs = public_docs  # else /docs and /openapi.json need any valid token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        role = "engine" if path.startswith(ENGINE_PREFIX) else None
        role = "peer" if path.startswith(PEER_PREFIX) else role
        role = "admin" if path.startswith(CACHE_PREFIX) else role
        role = "admin" if path == METRICS_PATH and not self.public_metrics else role
        role = _ANY_TOKEN if path in DOCS_PATHS and not self.public_docs else role
        if scope["type"] != "http" or role is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            who = self._admit(scope, role, headers.get("authorization"))
        except KvatlasError as exc:
            msgpack = role == "engine" and _wants_msgpack(headers)
            await _error_reply(exc, msgpack)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = who
        await self.app(scope, receive, send)

    def _admit(self, scope: Scope, role: str, authorization: str | None) -> Principal:
        if self.engine_port is not None and role in ("engine", "peer"):
            port = (scope.get("server") or (None, None))[1]
            if (port == self.engine_port) != (role == "engine"):
                raise NotFound(f"{scope['path']} is not served on this listener")
        if self.auth is None:
            return ANONYMOUS_ADMIN
        secret = self.peer_secret
        if (
            role == "peer"
            and secret is not None
            and secret.accepts(parse_bearer(authorization), self.instance_id())
        ):
            return PEER_NODE
        who = self.auth.authenticate(authorization)
        if role != _ANY_TOKEN:
            who.require(role)
        return who


Handler = Callable[[EngineCall, Principal], Awaitable[Any]]


def _publish_openapi(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and an ``/openapi.json`` that carries the engine calls' body
    schemas (the routes read raw bodies; their schemas come from the msgspec structs)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API")


def create_node_app(
    node: CacheNode, *, auth: TokenAuth | None = None, peer_secret: PeerSecret | None = None
) -> FastAPI:
    """The node's app: the peer route (:func:`create_peer_app`) and the engine API, behind an
    :class:`ApiGate` with ``auth``, ``peer_secret`` and the node config's ``engine_port`` and
    limits."""
    config = node.config
    app = create_peer_app(node.l1, l2=node.l2)
    app.title = "kvatlas cache node"
    refused = node.timings.http_refused.count
    install_nesting_handler(app, refused)
    app.add_middleware(
        ApiGate, auth=auth, engine_port=config.engine_port, public_metrics=config.metrics_public,
        public_docs=config.docs_public, peer_secret=peer_secret,
        instance_id=lambda: node.instance_id,
    )  # fmt: skip
    _publish_openapi(app)
    layout = config.layout
    layout_reply = EngineLayout(
        model_name=config.model_name, hash_scheme=config.hash_scheme,
        chunk_size=layout.chunk_size, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
        rotary_dim=layout.rope_dim, rope_style=layout.rope_style,
        rope_theta=layout.rope_theta, world_size=config.world_size, rank=config.rank,
        kv_rank=config.kv_rank,
    )  # fmt: skip
    trackers = Trackers(
        memory_bytes=config.tracker_memory_bytes,
        chunk_size=config.chunk_size,
        on_forget=node.blend.cancel,
    )
    app.state.engine_trackers = trackers
    layout = node.layout

    def engine_call(path: str, max_bytes: int, required: tuple[str, ...] = ()
                    ) -> Callable[[Handler], Handler]:  # fmt: skip
        """Register ``handler`` at ``path``: body read under ``max_bytes`` and decoded in the
        call's format (the type checks it), the caller's salts checked, then the ``required``
        fields present and not empty; every refusal is a 4xx reply in that format."""

        def register(handler: Handler) -> Handler:
            async def route(request: Request) -> Response:
                msgpack = _wants_msgpack(request.headers)
                try:
                    body = await read_body(request, max_bytes)
                    call = await _decode(body, msgpack)
                    who: Principal = request.state.principal
                    who.require_salts([call.cache_salt], role="engine")
                    missing = [name for name in required if not getattr(call, name)]
                    if missing:
                        raise Unprocessable(f"missing required field(s): {', '.join(missing)}")
                    return _reply(await handler(call, who), msgpack)
                except KvatlasError as exc:
                    return _error_reply(exc, msgpack)
                except ValueError as exc:  # a field the node could not make sense of
                    return _error_reply(Unprocessable(str(exc)), msgpack)
                except RecursionError:  # a body nested deeper than the decoder follows
                    return _error_reply(nested_too_deep(refused), msgpack)

            app.add_api_route(
                path,
                route,
                methods=["POST"],
                summary=(handler.__doc__ or "").strip().split("\n")[0],
                description=(handler.__doc__ or "").strip(),
                openapi_extra=_REQUEST_BODY,
            )
            return handler

        return register

    async def _decode(body: bytes, msgpack: bool) -> EngineCall:
        try:
            if len(body) > _OFF_LOOP_BYTES:
                return await run_in_threadpool(_decode_call, body, msgpack)
            return _decode_call(body, msgpack)
        except msgspec.MsgspecError as exc:
            raise Unprocessable(f"malformed engine call: {exc}") from None

    def tracker_for(call: EngineCall, who: Principal) -> tuple[RequestTracker, str]:
        """The call's tracker (``who`` may use its salt: checked by ``engine_call``)."""
        if len(call.tokens) // 4 > config.max_query_tokens:
            raise PayloadTooLarge(
                f"{len(call.tokens) // 4} tokens exceed --max-query-tokens {config.max_query_tokens}"
            )
        tokens = np.frombuffer(call.tokens, dtype="<u4")
        identity = Identity(
            tokens,
            tuple((i.identifier, i.offset, i.length) for i in call.mm_items),
            call.cache_salt,
        )

        def make() -> RequestTracker:
            items = [MMItem.of(i.identifier, i.offset, i.length) for i in call.mm_items]
            return node.tracker(
                token_ids=tokens,
                mm_items=items,
                cache_salt=call.cache_salt,
                request_id=call.request_id,
            )

        return trackers.get_or_create(who, call.request_id, identity, make)

    @engine_call("/engine/store", config.max_store_bytes)
    async def store(call: EngineCall, who: Principal) -> StoreReply:
        """Store the KV of a request's chunks: `tokens`, `kv` (`n_chunks` chunks in the node's
        layout from chunk `first_chunk`), `cache_salt`, `mm_items`. Reply `{stored, cacheable}`."""
        tracker, _ = tracker_for(call, who)
        if len(call.kv) != call.n_chunks * layout.chunk_bytes:
            raise Unprocessable(
                f"kv bytes do not match n_chunks x the node's KV layout: {len(call.kv)} bytes, "
                f"expected {call.n_chunks} x {layout.chunk_bytes} (GET /engine/layout)"
            )
        kv = np.frombuffer(call.kv, dtype=layout.numpy_dtype())
        chunks = list(kv.reshape((call.n_chunks, *layout.shape)))
        stored = await run_in_threadpool(node.store, tracker, chunks, first_chunk=call.first_chunk)
        trackers.drop(who, call.request_id, tracker)
        reply = StoreReply(stored=stored, cacheable=tracker.cacheable)
        if stored < call.n_chunks:
            reply.reason = _short_store(tracker, call, layout.chunk_size)
        return reply

    @engine_call("/engine/lookup", config.max_call_bytes)
    async def lookup(call: EngineCall, who: Principal) -> HitReply:
        """Prefix lookup: how many leading tokens of `tokens` a tier or a peer holds. Reply
        `{hit_tokens, cacheable}`."""
        tracker, _ = tracker_for(call, who)
        hit = await run_in_threadpool(node.lookup, tracker)
        return HitReply(hit, tracker.cacheable)

    @engine_call("/engine/retrieve", config.max_call_bytes)
    async def retrieve(call: EngineCall, who: Principal) -> RetrieveReply:
        """Prefix retrieval: the KV of the leading chunks held anywhere. Reply `{hit_tokens,
        kv, sources}` (`kv`: the chunks in the node's layout, back to back)."""
        tracker, _ = tracker_for(call, who)
        got = await run_in_threadpool(node.retrieve, tracker)
        trackers.drop(who, call.request_id, tracker)
        kv = b"".join(np.ascontiguousarray(k).tobytes() for k in got.kv)
        return RetrieveReply(got.hit_tokens, kv, dict(got.sources))

    @engine_call("/engine/blend-lookup", config.max_call_bytes, BLEND_REQUIRED)
    async def blend_lookup(call: EngineCall, who: Principal) -> BlendLookupReply:
        """Blend lookup: cached chunks anywhere in `tokens` after `prefix_len`. Reply
        `{pending: true}` (poll again with the same `request_id`) or `{pending: false,
        segments, local_matches, fleet_matches, fleet_used}`."""
        tracker, blend_id = tracker_for(call, who)
        result = await run_in_threadpool(
            node.blend_lookup, tracker, prefix_len=call.prefix_len, request_id=blend_id
        )
        if result is None:
            return BlendLookupReply(pending=True)
        return BlendLookupReply(
            pending=False,
            segments=[segment_to_wire(s) for s in result.segments],
            local_matches=result.local_matches,
            fleet_matches=result.fleet_matches,
            fleet_used=result.fleet_used,
        )

    @engine_call("/engine/blend-retrieve", config.max_call_bytes, BLEND_REQUIRED)
    async def blend_retrieve(call: EngineCall, who: Principal) -> BlendRetrieveReply:
        """Blend retrieval of `segments` (from a blend lookup): KV re-RoPE'd to each segment's
        `cur_st`. Reply `{parts: [segment + kv], misses, sources}`."""
        segments = []
        for i, wire in enumerate(call.segments):
            try:
                segments.append(segment_of(wire))
            except ValueError as exc:
                raise Unprocessable(f"segments[{i}]: {exc}") from None
        tracker, blend_id = tracker_for(call, who)
        got = await run_in_threadpool(node.blend_retrieve, tracker, segments)
        trackers.drop(who, call.request_id, tracker)
        node.blend.cancel(blend_id)  # a lookup never polled to its end is not kept to its TTL
        return BlendRetrieveReply(
            [_part(seg, kv) for seg, kv in got.parts],
            [segment_to_wire(s) for s in got.misses],
            dict(got.sources),
        )

    @app.get(
        "/engine/layout",
        summary="The node's KV layout and key scheme (what EngineClient reads)",
        openapi_extra={
            "responses": {"200": {"content": {"application/json": {"schema": _LAYOUT_SCHEMA}}}}
        },
    )
    async def engine_layout(request: Request) -> Response:
        return _reply(layout_reply, _wants_msgpack(request.headers))

    @app.get("/engine/stats")
    async def stats(request: Request) -> Response:
        msgpack = "application/json" not in request.headers.get("accept", "")
        if not request.state.principal.sees_everything:  # every tenant's figures
            refused = Forbidden("node stats are for admin and salt-unbound engine tokens")
            return _error_reply(refused, msgpack)
        wire = {**node.stats().to_wire(), "trackers": asdict(trackers.stats())}
        return _reply(wire, msgpack)

    @app.get("/engine/inventory")
    async def inventory(request: Request) -> Response:
        """What the node's own tiers hold (``CacheNode.held``), for operators and the soak."""
        msgpack = "application/json" not in request.headers.get("accept", "")
        if not request.state.principal.sees_everything:  # every tenant's keys
            refused = Forbidden("the inventory is for admin and salt-unbound engine tokens")
            return _error_reply(refused, msgpack)
        held = await run_in_threadpool(node.held)
        rows = [InventoryRow(KeyRow(**p.key.to_wire()), p.tier, p.backend) for p in held]
        return _reply(InventoryReply(node.instance_id, rows), msgpack)

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        data = await run_in_threadpool(generate_latest, node.timings.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        """JSON, or msgpack when the caller asks for it (``Accept``)."""
        reply = NodeHealthReply("ok", node.instance_id, **node.scheme.describe())
        return _reply(reply, _wants_msgpack(request.headers))

    add_cache_control_routes(app, NodeCacheControl(node))
    return app


# ---------------------------------------------------------------------------- cache control

CACHE_CONTROL_MAX_BYTES: Final = 12 << 20
"""A cache-control body: 1,000,000 token ids or 10,000 keys in JSON fit (413 beyond)."""

S = TypeVar("S", bound=msgspec.Struct)


def _json_body(type_: type[msgspec.Struct], required: bool = True) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body raw: the Struct's own schema."""
    schema = msgspec.json.schema(type_)
    return {
        "requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}
    }


def add_cache_control_routes(app: FastAPI, control: NodeCacheControl) -> None:
    """LMCache 0.5.6's MP-server routes (``lmcache server``), JSON in and out, the same status
    codes: 422 a body that is not of its type, 400/404/503 what :class:`NodeCacheControl`
    refuses (``detail`` says why), 202 a submitted prefetch (``docs/cache-control.md``)."""
    app.state.cache_control = control

    async def body_of(request: Request, type_: type[S], optional: bool = False) -> S:
        raw = await read_body(request, CACHE_CONTROL_MAX_BYTES)
        if optional and not raw.strip():
            return type_()
        return decode(raw, type_)

    async def answer(work: Callable[[], msgspec.Struct], status: int = 200) -> Response:
        try:
            reply = await run_in_threadpool(work)
        except KvatlasError as exc:
            return error_response(exc)
        return Response(encode(reply), status_code=status, media_type="application/json")

    @app.delete(
        "/cache/objects",
        summary="Delete keys from L1, L2 or both (LMCache's MP route)",
        openapi_extra=_json_body(DeleteObjectsBody),
    )
    async def delete_objects(request: Request) -> Response:
        try:
            body = await body_of(request, DeleteObjectsBody)
        except KvatlasError as exc:
            return error_response(exc)
        return await answer(lambda: control.delete_objects(body))

    @app.post(
        "/cache/prefetches",
        summary="Warm L1 from L2 for a token sequence (202)",
        openapi_extra=_json_body(PrefetchBody),
    )
    async def submit_prefetch(request: Request) -> Response:
        try:
            body = await body_of(request, PrefetchBody)
        except KvatlasError as exc:
            return error_response(exc)
        return await answer(lambda: control.submit_prefetch(body), status=202)

    @app.get("/cache/prefetches/{request_id}", summary="A prefetch's status")
    async def prefetch_status(request_id: str) -> Response:
        return await answer(lambda: control.prefetch_status(request_id))

    @app.get("/cache/objects", summary="One page of the L2 backend's keys")
    async def list_objects(
        tier: TierName = "l2",
        adapter: str | None = None,
        model_name: str | None = None,
        page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
        page_token: str | None = None,
    ) -> Response:
        return await answer(
            lambda: control.list_objects(tier, adapter, model_name, page_size, page_token)
        )

    @app.post(
        "/cache/clear",
        summary="Empty L1 (body optional)",
        openapi_extra=_json_body(ClearBody, False),
    )
    async def clear(request: Request) -> Response:
        try:
            body = await body_of(request, ClearBody, optional=True)
        except KvatlasError as exc:
            return error_response(exc)
        return await answer(lambda: control.clear(body))
