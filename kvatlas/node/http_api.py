"""The node's HTTP app: its route table (:mod:`kvatlas.node.routes`, and the documentation's
routes) served by one :class:`~kvatlas.dispatch.Dispatcher` on every listener.

Engine calls carry msgpack bodies (tokens as little-endian uint32 bytes, KV as raw bytes in the
layout's dtype) and get msgpack replies; a call sent as JSON (bytes as base64) gets JSON. Every
bad input is a 4xx with a ``detail`` in the call's format (:func:`kvatlas.web.error_payload`).
The peer route keeps its JSON errors (:mod:`kvatlas.node.peer`).

Before any body byte is read, :class:`NodeApp` checks the listener (with ``--engine-port``,
``/engine/*`` only on that listener and ``/peer/*`` only on the other) and the caller (with
auth: an ``engine`` token on ``/engine/*``, the call's ``cache_salt`` inside its binding; on
``/peer/*`` this node's own peer credential, derived from the fleet's peer secret for this
instance, :mod:`kvatlas.node.peer_credentials`, or a ``peer`` token of the auth file). Bodies
are read under each route's limit (``NodeConfig.max_call_bytes``, store: ``max_store_bytes``;
an engine call in JSON: ``max_json_call_bytes``, ``max_json_store_bytes``).
Blend lookups are poll-able: the node keeps each request's tracker for a while
(:mod:`kvatlas.node.engine_trackers`, bound to the calling principal). See ``docs/node.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, Final

from starlette.types import Scope

from kvatlas import __version__, openapi
from kvatlas.api.engine import EngineLayout
from kvatlas.auth import Principal, TokenAuth, parse_bearer
from kvatlas.client.engine_client import MSGPACK
from kvatlas.dispatch import Dispatcher, bearer_header
from kvatlas.node.cache_control import NodeCacheControl
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_trackers import Trackers
from kvatlas.node.peer import PeerServing
from kvatlas.node.peer_credentials import PeerSecret
from kvatlas.node.routes import (
    AREAS,
    DOCS,
    ENGINE_LISTENER,
    PEER_LISTENER,
    ROUTES,
    Context,
    call_format,
    json_body_limit,
)
from kvatlas.node.routes.cache_control import CACHE_CONTROL_MAX_BYTES
from kvatlas.routing import JSON, OPEN, Access, Route, RouteTable

__all__ = ["CACHE_CONTROL_MAX_BYTES", "MSGPACK", "TABLE", "NodeApp", "create_node_app"]

TITLE: Final = "kvatlas cache node"
DESCRIPTION: Final = "A cache node's engine API, peer API and LMCache MP-server cache control."
PEER_NODE: Final = Principal("peer-node", frozenset({"peer"}))
"""Who presents this node's own peer credential: another node of the fleet."""


@cache
def api_document() -> dict[str, Any]:
    """``/openapi.json``: the table, documented (the same for every node)."""
    return openapi.document(TITLE, __version__, DESCRIPTION, ROUTES)


TABLE: Final = RouteTable(
    (*ROUTES, *openapi.docs_routes(TITLE, DOCS, lambda _ctx: api_document())),
    AREAS,
    unrouted=OPEN,
)
"""Every route the node serves."""


def body_limit(route: Route, config: NodeConfig) -> int:
    """The body limit of ``route``: its own largest legitimate body, else the engine call's."""
    return config.max_call_bytes if route.body is None else int(route.body(config))


class NodeApp(Dispatcher):
    """The node's app: :data:`TABLE` over a :class:`~kvatlas.node.routes.Context`. Besides
    the token file, a peer route accepts this node's own peer credential (``peer_secret`` for
    ``instance_id()``). ``state``: the context (``state.engine_trackers``)."""

    title = TITLE
    version = __version__

    def __init__(
        self,
        context: Context,
        config: NodeConfig,
        auth: TokenAuth | None,
        peer_secret: PeerSecret | None,
        instance_id: Callable[[], str],
    ) -> None:
        public = {"metrics"} if config.metrics_public else set()
        if config.docs_public:
            public.add("docs")
        engine_port = config.engine_port
        super().__init__(
            context, TABLE, auth, frozenset(public), lambda route: body_limit(route, config),
            config.max_call_bytes, context.node.timings.http_refused.count,
            listener_of=None if engine_port is None else _listener_of(engine_port),
        )  # fmt: skip
        self.state = context
        self.peer_secret = peer_secret
        self.instance_id = instance_id
        self.json_limits = {
            route: limit
            for route in TABLE.routes
            if (limit := json_body_limit(route, config)) is not None
        }

    def limit_of(self, route: Route, scope: Scope) -> int:
        """An engine call's limit in its format: JSON carries bytes as base64."""
        json_limit = self.json_limits.get(route)
        if json_limit is not None and call_format(scope) is JSON:
            return json_limit
        return super().limit_of(route, scope)

    def authenticate(self, access: Access, scope: Scope) -> Principal:
        secret = self.peer_secret
        if (
            "peer" in access.roles
            and secret is not None
            and secret.accepts(parse_bearer(bearer_header(scope)), self.instance_id())
        ):
            return PEER_NODE
        return super().authenticate(access, scope)

    def openapi(self) -> dict[str, Any]:
        return api_document()


def _listener_of(engine_port: int) -> Callable[[Scope], str]:
    def listener(scope: Scope) -> str:
        port = (scope.get("server") or (None, None))[1]
        return ENGINE_LISTENER if port == engine_port else PEER_LISTENER

    return listener


def engine_layout(config: NodeConfig) -> EngineLayout:
    """``GET /engine/layout``'s reply."""
    layout = config.layout
    return EngineLayout(
        model_name=config.model_name, hash_scheme=config.hash_scheme,
        chunk_size=layout.chunk_size, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
        rotary_dim=layout.rope_dim, rope_style=layout.rope_style,
        rope_theta=layout.rope_theta, world_size=config.world_size, rank=config.rank,
        kv_rank=config.kv_rank,
    )  # fmt: skip


def create_node_app(
    node: CacheNode, *, auth: TokenAuth | None = None, peer_secret: PeerSecret | None = None
) -> NodeApp:
    """The node's app over ``node``, with ``auth``, ``peer_secret`` and the node config's
    ``engine_port``, public flags and limits."""
    config = node.config
    trackers = Trackers(
        memory_bytes=config.tracker_memory_bytes,
        chunk_size=config.chunk_size,
        on_forget=node.blend.cancel,
    )
    context = Context(
        node, trackers, NodeCacheControl(node), PeerServing(node.l1, node.l2),
        engine_layout(config),
    )  # fmt: skip
    return NodeApp(context, config, auth, peer_secret, lambda: node.instance_id)
