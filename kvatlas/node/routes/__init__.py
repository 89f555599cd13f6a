"""The node's HTTP API, one table: every route in one entry — method, path, who may call it on
which listener, request and reply types (:mod:`kvatlas.api`), handler, body limit, reply
format — served by :class:`kvatlas.dispatch.Dispatcher` (``http_api.NodeApp``) and documented
from the same entries at ``/openapi.json``.

Two surfaces with different callers: the **engine API** (``/engine/*``, an ``engine`` token;
replies and errors in the call's own format, msgpack or JSON) and the **peer API**
(``/peer/kv``, this node's peer credential or a ``peer`` token; JSON errors). With
``--engine-port`` each is served only on its own listener (404 on the other, before any token
is checked); ``/cache/*`` (LMCache's MP-server routes) needs ``admin``; ``/metrics`` ``admin``
unless ``--public-metrics``; ``/healthz`` is open on both listeners. A path no route serves is
refused as the routes under its prefix would be (:data:`AREAS`), else a plain 404. See
docs/node.md and docs/security.md ("Node").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from starlette.types import Scope

from kvatlas.api.cache_control import (
    ClearBody,
    ClearReply,
    DeleteObjectsBody,
    DeleteObjectsReply,
    HoldBody,
    HoldReply,
    ObjectPage,
    ObjectsQuery,
    PrefetchBody,
    PrefetchStatusReply,
    PrefetchSubmitted,
    ReleaseReply,
)
from kvatlas.api.engine import (
    BlendLookupReply,
    BlendRetrieveReply,
    EngineCall,
    EngineLayout,
    HitReply,
    InventoryReply,
    NodeHealthReply,
    RetrieveReply,
    StoreReply,
)
from kvatlas.node.config import NodeConfig
from kvatlas.node.peer import peer_route
from kvatlas.node.routes import cache_control, engine, ops
from kvatlas.node.routes.cache_control import CACHE_CONTROL_MAX_BYTES, json_body
from kvatlas.node.routes.context import Context
from kvatlas.routing import JSON, MSGPACK, OPEN, Access, Area, Codec, Route

ENGINE_LISTENER: Final = "engine"
PEER_LISTENER: Final = "peer"
_MSGPACK = MSGPACK.media_type.encode()
_JSON = JSON.media_type.encode()


def call_format(scope: Scope) -> Codec:
    """msgpack when the call's body or the reply it accepts is msgpack, else JSON."""
    for name, value in scope["headers"]:
        if (name == b"content-type" or name == b"accept") and _MSGPACK in value:
            return MSGPACK
    return JSON


def msgpack_unless_json(scope: Scope) -> Codec:
    """msgpack unless the caller accepts JSON (the engine API's figures)."""
    accept = next((v for k, v in scope["headers"] if k == b"accept"), b"")
    return JSON if _JSON in accept else MSGPACK


ENGINE = Access(("engine",), listener=ENGINE_LISTENER)
STATS = Access(("engine",), every_tenant="node stats cover every tenant", listener=ENGINE_LISTENER)
INVENTORY = Access(
    ("engine",), every_tenant="the inventory covers every tenant", listener=ENGINE_LISTENER
)
PEER = Access(("peer",), listener=PEER_LISTENER)
ADMIN = Access(("admin",))
METRICS = Access(("admin",), public_flag="metrics")
DOCS = Access(public_flag="docs")
"""``/openapi.json``, ``/docs``, ``/redoc``: any valid token unless ``--public-docs``."""


def _call_bytes(config: NodeConfig) -> int:
    return config.max_call_bytes


def _store_bytes(config: NodeConfig) -> int:
    return config.max_store_bytes


_JSON_BODIES: dict[object, Callable[[NodeConfig], int]] = {
    _call_bytes: lambda config: config.max_json_call_bytes,
    _store_bytes: lambda config: config.max_json_store_bytes,
}


def json_body_limit(route: Route, config: NodeConfig) -> int | None:
    """The body limit of an engine call of ``route`` sent as JSON (its bytes as base64, 4/3
    of msgpack's); ``None``: the route's limit does not depend on the format."""
    json_limit = _JSON_BODIES.get(route.body) if route.codec is call_format else None
    return None if json_limit is None else json_limit(config)


def _cache_bytes(_config: NodeConfig) -> int:
    return CACHE_CONTROL_MAX_BYTES


def _engine_call(path: str, handler: engine.RouteHandler, summary: str, reply: type,
                 body: Callable[[NodeConfig], int] = _call_bytes) -> Route:  # fmt: skip
    """An engine call's entry: an :class:`EngineCall` body (msgpack or JSON) under ``body``,
    the node's limit for it, the reply in the call's format."""
    return Route(
        "POST", path, ENGINE, handler, summary, request=EngineCall, decode=False, reply=reply,
        codec=call_format, body=body,
        docs={"requestBody": {"content": {MSGPACK.media_type: {
            "schema": {"$ref": "#/components/schemas/EngineCall"}}}}},
    )  # fmt: skip


ROUTES: tuple[Route, ...] = (
    _engine_call("/engine/store", engine.store, "Store the KV of a request's chunks", StoreReply,
                 _store_bytes),
    _engine_call("/engine/lookup", engine.lookup, "Prefix lookup", HitReply),
    _engine_call("/engine/retrieve", engine.retrieve, "Prefix retrieval", RetrieveReply),
    _engine_call("/engine/blend-lookup", engine.blend_lookup, "Blend lookup (poll-able)",
                 BlendLookupReply),
    _engine_call("/engine/blend-retrieve", engine.blend_retrieve,
                 "Blend retrieval, KV re-RoPE'd to each segment's position", BlendRetrieveReply),
    Route("GET", "/engine/layout", ENGINE, ops.engine_layout,
          "The node's KV layout and key scheme (what EngineClient reads)", reply=EngineLayout,
          codec=call_format),
    Route("GET", "/engine/stats", STATS, ops.stats, "The node's figures and counters",
          codec=msgpack_unless_json),
    Route("GET", "/engine/inventory", INVENTORY, ops.inventory, "What the node's own tiers hold",
          reply=InventoryReply, codec=msgpack_unless_json),
    peer_route(PEER),
    # LMCache 0.5.6's MP-server routes (docs/cache-control.md)
    Route("DELETE", "/cache/objects", ADMIN, cache_control.delete_objects,
          "Delete keys from L1, L2 or both (LMCache's MP route)", request=bytes,
          reply=DeleteObjectsReply, body=_cache_bytes, docs=json_body(DeleteObjectsBody)),
    Route("POST", "/cache/prefetches", ADMIN, cache_control.submit_prefetch,
          "Warm L1 from L2 for a token sequence (202)", request=bytes, reply=PrefetchSubmitted,
          status=202, body=_cache_bytes, docs=json_body(PrefetchBody)),
    Route("GET", "/cache/prefetches/{request_id}", ADMIN, cache_control.prefetch_status,
          "A prefetch's status", reply=PrefetchStatusReply),
    Route("GET", "/cache/objects", ADMIN, cache_control.list_objects,
          "One page of the L2 backend's keys", query=ObjectsQuery, reply=ObjectPage),
    # a move's target (kvatlas's coordinator; docs/cache-control.md, "Moves")
    Route("PUT", "/cache/holds/{hold_id}", ADMIN, cache_control.hold,
          "Load a move's keys into L1 (own L2, else the source's L1 or L2) and hold them",
          request=bytes, reply=HoldReply, body=_cache_bytes, docs=json_body(HoldBody)),
    Route("DELETE", "/cache/holds/{hold_id}", ADMIN, cache_control.release,
          "Release a move's hold (idempotent)", reply=ReleaseReply),
    Route("POST", "/cache/clear", ADMIN, cache_control.clear, "Empty L1 (body optional)",
          request=bytes, reply=ClearReply, body=_cache_bytes, docs=json_body(ClearBody, False)),
    Route("GET", "/metrics", METRICS, ops.metrics, "Prometheus metrics", media_type="text/plain",
          docs={"responses": {"200": {"content": {"text/plain": {"schema": {"type": "string"}}}}}}),
    Route("GET", "/healthz", OPEN, ops.healthz, "Liveness, instance id and key scheme",
          reply=NodeHealthReply, codec=call_format),
)  # fmt: skip
"""Every route of the node but the documentation's (``http_api`` adds those)."""

AREAS: tuple[Area, ...] = (
    Area("/engine/", ENGINE, call_format),
    Area("/peer/", PEER),
    Area("/cache/", ADMIN),
)
"""Who may learn that a path under a prefix is not served (any other path: anyone)."""

__all__ = ["AREAS", "DOCS", "ROUTES", "Context"]
