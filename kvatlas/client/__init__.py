"""Clients of the coordinator, used by cache nodes and routers (never server internals)."""

from kvatlas.client.blend_client import BlendCoordinatorClient
from kvatlas.client.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.client.event_sink import (
    EventSink,
    HttpTransport,
    InProcessTransport,
    PermanentSendError,
    RedisStreamTransport,
    TransientSendError,
)

__all__ = [
    "BlendCoordinatorClient",
    "CoordinatorClient",
    "CoordinatorError",
    "EventSink",
    "HttpTransport",
    "InProcessTransport",
    "PermanentSendError",
    "RedisStreamTransport",
    "TransientSendError",
]
