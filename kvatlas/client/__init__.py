"""Clients of the coordinator, used by cache nodes and routers (docs/coordinator.md, "Clients"),
and an engine's client of a cache node (:class:`EngineClient`, docs/node.md "Engine API").

They speak HTTP (or Redis Streams) and never import server internals: importing this package
loads neither the directory nor numba, so a router pays only for httpx and msgspec.
"""

from kvatlas.client.blend_client import BlendCoordinatorClient, FleetMatcher
from kvatlas.client.cache_client import CacheControlClient
from kvatlas.client.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    encode_tokens_b64,
)
from kvatlas.client.engine_client import EngineCallError, EngineClient, EngineLayout
from kvatlas.client.event_sink import EventSink, SinkStats
from kvatlas.client.event_transports import (
    AuthSendError,
    HttpTransport,
    InProcessTransport,
    PermanentSendError,
    RedisStreamTransport,
    SaltRefusedError,
    SendTooLargeError,
    TransientSendError,
    Transport,
)
from kvatlas.client.mp_server_client import MPServerClient, MPServerError
from kvatlas.client.route_client import AsyncRouteClient, RouteClient

__all__ = [
    "AsyncRouteClient",
    "AuthSendError",
    "BlendCoordinatorClient",
    "CacheControlClient",
    "CoordinatorClient",
    "CoordinatorError",
    "EngineCallError",
    "EngineClient",
    "EngineLayout",
    "EventSink",
    "FleetMatcher",
    "HttpTransport",
    "InProcessTransport",
    "MPServerClient",
    "MPServerError",
    "PermanentSendError",
    "RedisStreamTransport",
    "RouteClient",
    "SaltRefusedError",
    "SendTooLargeError",
    "SinkStats",
    "TransientSendError",
    "Transport",
    "encode_tokens_b64",
]
