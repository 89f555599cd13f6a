"""The vLLM KV-event links a coordinator runs, built from its configuration: a subscriber
(``--kv-events-subscribe``), a publisher (``--kv-events-publish``), both or neither."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.kv_events.exposure import StreamExposure
from kvatlas.coordinator.kv_events.known import SECTION, decode_engines, encode_engines
from kvatlas.coordinator.kv_events.publisher import KvEventsPublisher
from kvatlas.coordinator.kv_events.settings import SubscriberSettings
from kvatlas.coordinator.kv_events.stats import KvEventsStats
from kvatlas.coordinator.kv_events.subscriber import Ingest, KvEventsSubscriber
from kvatlas.directory import KeyDirectory
from kvatlas.errors import InvalidInput, Unavailable

log = logging.getLogger(__name__)


class KvEventsLinks:
    def __init__(
        self, subscriber: KvEventsSubscriber | None, publisher: KvEventsPublisher | None
    ) -> None:
        self.subscriber = subscriber
        self.publisher = publisher

    @classmethod
    def from_config(
        cls,
        config: CoordinatorConfig,
        directory: KeyDirectory,
        ingest: Ingest,
        stop: threading.Event,
        is_node: Callable[[str], bool] = lambda _: False,
        bound_salts: frozenset[str] | None = None,
    ) -> KvEventsLinks:
        """Engine batches go through ``ingest`` and the directory's fence, like any batch;
        the publisher observes the directory from now on (nothing applied is missed).
        ``bound_salts``: the salts tokens are bound to (``None``: auth is off); the stream
        shows none of them unless the operator lists them, and with auth on it stays on this
        host unless authenticated (:mod:`.exposure`; a ``ValueError`` says why)."""
        subscriber = publisher = None
        links = config.kv_events_links
        if links:
            settings = SubscriberSettings(
                links,
                config.kv_events_topic_prefix,
                config.kv_events_model,
                config.kv_events_max_blocks,
                max_engines_per_endpoint=config.kv_events_max_engines_per_endpoint,
                max_message_bytes=config.kv_events_max_message_bytes,
            )
            subscriber = KvEventsSubscriber(
                settings, config.scheme, ingest=ingest, clear=directory.fence_instance, stop=stop,
                is_node=is_node,
            )  # fmt: skip
        if config.kv_events_publish:
            exposure = StreamExposure.choose(
                config.kv_events_salts,
                bound_salts or frozenset(),
                config.kv_events_curve_certificate,
                config.kv_events_curve_clients,
            )
            exposure.check_endpoints(
                [e for e in (config.kv_events_publish, config.kv_events_replay_bind) if e],
                auth_on=bound_salts is not None,
                allow_open=config.kv_events_publish_unauthenticated,
            )
            publisher = KvEventsPublisher(
                config.kv_events_publish,
                config.kv_events_replay_bind,
                config.kv_events_replay_size,
                directory,
                stop,
                config.kv_events_publish_encoding,
                exposure,
            )
            directory.observer = publisher
        return cls(subscriber, publisher)

    def start(self) -> list[tuple[str, Callable[[], None]]]:
        """Open the sockets and name the threads to run; an endpoint that cannot be bound or
        connected raises :class:`~kvatlas.errors.Unavailable` naming the flag."""
        import zmq

        threads: list[tuple[str, Callable[[], None]]] = []
        if self.publisher is not None:
            try:
                self.publisher.open()
            except zmq.ZMQError as exc:
                raise Unavailable(f"--kv-events-publish / --kv-events-replay-bind: {exc}") from None
            threads.append(("kv-events-out", self.publisher.run))
        if self.subscriber is not None:
            try:
                self.subscriber.open()
            except zmq.ZMQError as exc:
                raise Unavailable(f"--kv-events-subscribe / --kv-events-bind: {exc}") from None
            threads.append(("kv-events-in", self.subscriber.run))
        return threads

    def engines(self) -> frozenset[str]:
        """The engine instances learned from KV events (none without a subscriber)."""
        return frozenset() if self.subscriber is None else self.subscriber.engine_ids

    def snapshot_sections(self) -> dict[str, bytes]:
        """The engines known, as a snapshot section (none without a subscriber)."""
        if self.subscriber is None:
            return {}
        return {SECTION: encode_engines(self.subscriber.engine_ids)}

    def restore(
        self, sections: dict[str, bytes] | None, tracked: Callable[[str], bool], where: str | Path
    ) -> None:
        """Engines again: those of a snapshot's section whose cursor it restored (``tracked``);
        a section that does not decode is logged and left out (they come back when they
        publish)."""
        if self.subscriber is None or not sections or SECTION not in sections:
            return
        try:
            known = decode_engines(sections[SECTION])
        except InvalidInput as exc:
            log.error("snapshot %s: engines not restored (%s)", where, exc)
            return
        self.subscriber.restore_engines(frozenset(e for e in known if tracked(e)))

    def forget(self, instance_ids: Iterable[str]) -> None:
        """Emitters the directory forgot: an engine among them is no engine (nor a route
        candidate) until it publishes again."""
        if self.subscriber is not None:
            self.subscriber.forget_engines(frozenset(instance_ids))

    def is_engine(self, instance_id: str) -> bool:
        """Whether ``instance_id`` is an engine's: learned from KV events, or named for an
        endpoint (``ENGINE=ENDPOINT``, with any data-parallel rank). Engine ids are their own
        namespace: no node may register under one."""
        return self.subscriber is not None and self.subscriber.is_engine(instance_id)

    def stats(self) -> KvEventsStats | None:
        """The counters of each link that runs; ``None`` when neither does."""
        if self.subscriber is None and self.publisher is None:
            return None
        return KvEventsStats(
            None if self.subscriber is None else self.subscriber.stats(),
            None if self.publisher is None else self.publisher.stats(),
        )
