"""vLLM KV events, both ways: engines' ``KVEventBatch`` streams subscribed and re-keyed into
the directory (:class:`KvEventsSubscriber`), and the directory's node placements re-published
for routers (:class:`KvEventsPublisher`). Loads pyzmq only when a socket opens. See
docs/kv-events.md.
"""

from kvatlas.coordinator.kv_events.batch_checks import BadBatch
from kvatlas.coordinator.kv_events.changes import Cleared
from kvatlas.coordinator.kv_events.publisher import KvEventsPublisher, node_topic
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
