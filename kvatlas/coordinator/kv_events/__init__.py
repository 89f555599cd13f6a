"""vLLM KV events, both ways: engines' ``KVEventBatch`` streams subscribed and re-keyed into
the directory (:class:`KvEventsSubscriber`), and the directory's node placements re-published
for routers (:class:`KvEventsPublisher`). Loads pyzmq only when a socket opens. See
docs/kv-events.md.

The publisher (:class:`KvEventsPublisher`, :func:`node_topic`) reads the directory, whose
kernels bring numba in: it is imported when first used (PEP 562), so a process that reads only
the settings here (a router parsing the coordinator's flags for ``--scores-from replica``)
does not pay numba's import.
"""

from typing import TYPE_CHECKING, Any

from kvatlas.coordinator.kv_events.batch_checks import BadBatch
from kvatlas.coordinator.kv_events.changes import Cleared
from kvatlas.coordinator.kv_events.rekey import (
    CPU_TIER,
    ENGINE_BACKEND,
    GPU_TIER,
    Rekeyer,
    engine_tier,
)
from kvatlas.coordinator.kv_events.settings import LinkSpec, SubscriberSettings, engine_instance
from kvatlas.coordinator.kv_events.stats import KvEventsStats, PublisherStats, SubscriberStats
from kvatlas.coordinator.kv_events.subscriber import KvEventsSubscriber
from kvatlas.lazy_exports import lazy_export

if TYPE_CHECKING:
    from kvatlas.coordinator.kv_events.publisher import KvEventsPublisher, node_topic

_EXPORTS = {"KvEventsPublisher": "publisher", "node_topic": "publisher"}
"""The names imported on first use (the publisher reads the directory), and their
submodule."""


def __getattr__(name: str) -> Any:
    return lazy_export(__name__, _EXPORTS, globals(), name)


__all__ = [
    "CPU_TIER",
    "ENGINE_BACKEND",
    "GPU_TIER",
    "BadBatch",
    "Cleared",
    "KvEventsPublisher",
    "KvEventsStats",
    "KvEventsSubscriber",
    "LinkSpec",
    "PublisherStats",
    "Rekeyer",
    "SubscriberSettings",
    "SubscriberStats",
    "engine_instance",
    "engine_tier",
    "node_topic",
]
