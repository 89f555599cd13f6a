"""The coordinator's moving parts, independent of HTTP: directory, instances, auth, snapshots,
the Redis Streams consumer and the background threads that tie them together.

Readiness (:class:`~kvatlas.coordinator.views.Readiness`) goes ``restoring`` → (Redis transport:
``waiting_for_redis`` → ``catching_up``) → ``serving``, through ``resyncing`` when events may be
missing (a restart from a snapshot on the HTTP transport, a trimmed or lost stream), which ends
once the live instances exchanged digests; lookups are answered in every state. Everything the
service reports is an immutable view (:mod:`kvatlas.coordinator.views`). See docs/coordinator.md.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvatlas.auth import ANONYMOUS_ADMIN, Principal, TokenAuth
from kvatlas.coordinator.cache_control.delivery_contract import MpServers
from kvatlas.coordinator.cache_control.eviction import EvictionPolicy
from kvatlas.coordinator.cache_control.fleet import cache_control_of
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.emitters import EmitterBook, emitter_views, instance_views
from kvatlas.coordinator.fleet_liveness import FleetLiveness, share_registrations
from kvatlas.coordinator.ingestion import Ingestion
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.kv_events.links import KvEventsLinks
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.readiness import ReadinessTracker
from kvatlas.coordinator.retention import StreamRetention
from kvatlas.coordinator.snapshots import Snapshots
from kvatlas.coordinator.status import StatusSource
from kvatlas.coordinator.stream_auth import entry_principal
from kvatlas.coordinator.views import (
    Deregistration,
    EmitterView,
    HealthView,
    InstanceView,
    MetricsState,
    Readiness,
    StatsView,
)
from kvatlas.coordinator.warm_up import warm_up_lookup_kernels
from kvatlas.directory import (
    IngestCounts,
    KeyDirectory,
    KeyFilter,
    KeyPage,
    SnapshotInfo,
    TokenLookup,
    page_keys,
    prefix_summary,
    warm_up_kernels,
)
from kvatlas.errors import Conflict, Unavailable, Unprocessable
from kvatlas.events import ColumnBatch, EventBatch
from kvatlas.events.inventory import Digest, differing
from kvatlas.keys import MM_BYPASS_GUARD, ObjectKey
from kvatlas.logs import Throttle

if TYPE_CHECKING:  # redis is imported only on the Redis transport
    from kvatlas.coordinator.stream_consumer import StreamConsumer

log = logging.getLogger(__name__)

INLINE_BODY_BYTES = 16 * 1024
"""A ``POST /events`` or prefix-lookup body up to this size (a node's batch of a chunk or a few,
≈100 keys) is answered on the event loop while no change holds the directory: the hop to a
pool and back cost more server CPU than such a request's work (docs/performance.md, "Directory:
design figures"). Larger ones, and any while the directory is busy, go to their pool."""


def shared_store(config: CoordinatorConfig) -> SharedStore | None:
    """With the Redis transport, the store every replica keeps pins, quotas and commands in
    (named on leases by replica id, process id and a random suffix); else ``None``."""
    if config.event_transport != "redis":
        return None
    owner = f"{config.resolved_replica_id}-{os.getpid()}-{secrets.token_hex(4)}"
    return SharedStore.connect(config.redis_url or "", config.event_stream, owner)


class CoordinatorService:
    def __init__(
        self,
        config: CoordinatorConfig,
        clock: Callable[[], float] = time.monotonic,
        mp_servers: MpServers | None = None,  # the client cache-control commands go through
        *,
        delivers: bool = True,  # runs the cache-control delivery loop (a router's replica,
        # with no node registered with it and so no MP server to reach, takes no leases)
    ) -> None:
        self.config = config
        self.delivers = delivers
        self.scheme = config.scheme
        scheme = self.scheme
        self.directory = KeyDirectory(
            config.chunk_size,
            enable_blend_lookup=config.enable_blend_lookup,
            blend_probe_stride=config.blend_probe_stride,
            hash_chunks=lambda tokens, _chunk_size: scheme.chunk_hashes(tokens),
        )
        self.auth = TokenAuth.from_file(config.auth_token_file) if config.auth_token_file else None
        self.instances = InstanceRegistry(
            config.instance_timeout, self._fence_expired, clock, config.max_instances
        )
        self.metrics = CoordinatorMetrics(self.metrics_state)
        self._clock = self.clock = clock
        self.emitters = EmitterBook()
        self._next_departure_sweep = 0.0
        self._say = Throttle(60.0, clock=clock)  # a WARNING a minute per cause
        # registrations with other replicas, recently seen (fleet_liveness.py): id -> engine_id
        self.elsewhere: dict[str, str | None] = {}
        self.liveness = (
            FleetLiveness.connect(config.redis_url or "", config.event_stream)
            if config.event_transport == "redis"
            else None
        )
        self.readiness = ReadinessTracker(self.instances, config.instance_timeout, clock)
        self._trim_checked = False  # the restored position checked against trims (joining)
        self._restored = False  # a snapshot was restored
        self.stream_position: str | None = None
        self._restored_position: str | None = None
        self.stream_consumer: StreamConsumer | None = None  # the Redis transport's
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.status = StatusSource(self)  # the status page, node reports, operator series
        self.ingestion = Ingestion(
            config, self.directory, self.instances, self.emitters, self.metrics, self.auth, clock
        )
        self.cache_control, self.delivery = cache_control_of(
            config.chunk_size, lambda tokens: scheme.chunk_hashes(tokens), self.instances,
            self.directory, self.metrics.registry, mp_servers,
            EvictionPolicy(config.eviction_policy), shared_store(config),
            config.cache_command_lease_s, lambda: self.elsewhere,
        )  # fmt: skip
        engines = functools.partial(self.ingest, engine=True)  # they cannot register
        self.kv_events = self.ingestion.kv_events = KvEventsLinks.from_config(
            config, self.directory, engines, self._stop, is_node=self.instances.known,
            bound_salts=None if self.auth is None else self.auth.bound_salts(),
        )  # fmt: skip
        self.snapshots = Snapshots(
            config, self.directory, self.instances, self.cache_control, self.kv_events,
            self.metrics, clock, lambda: self.stream_position, lambda: self.state,
        )  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        warm_up_kernels()
        warm_up_lookup_kernels()
        restored = self.snapshots.restore()
        if restored is not None:
            self._restored = True
            self.stream_position = self._restored_position = restored.stream_position
        self.instances.open()  # (an instance not heard by a timeout from now is gone)
        self._spawn("instance-sweeper", self._sweep_loop)
        if self.liveness is not None:
            self._spawn("registrations", self._registrations_loop)
        if self.delivers:
            self._spawn("cache-control", functools.partial(self.delivery.run, self._stop))
        store = self.cache_control.store
        if store is not None:  # seeds a Redis holding no cache control (at start, or later)
            self._spawn("cache-control-store", functools.partial(store.watch, self._stop))
        for name, run in self.kv_events.start():
            self._spawn(name, run)
        if self.config.snapshot_path is not None or store is not None:  # (or a copy in memory)
            self._spawn("snapshotter", functools.partial(self.snapshots.run, self._stop))
        if self.config.event_transport == "redis":
            from kvatlas.coordinator.stream_consumer import StreamConsumer

            # The replica's key in the retention registry: its consumer group (one per replica).
            retention = self.snapshots.retention = StreamRetention.connect(
                self.config.redis_url or "", self.config.event_stream, self.config.group_name
            )
            self.readiness.set(Readiness.CATCHING_UP)
            consumer = StreamConsumer(
                self.config,
                attribute=lambda fields: entry_principal(
                    self.auth, fields, self.config.event_stream
                ),
                ingest=self.ingestion.ingest_as,
                position=self.stream_position,
                on_position=self._set_stream_position,
                set_readiness=self._stream_readiness,
                stop=self._stop,
                errors=self.metrics.stream_errors,
                rejected=self.metrics.stream_rejected,
            )
            self.stream_consumer = consumer
            self._spawn("stream-consumer", consumer.run)
            if self.config.snapshot_path is not None:  # what this replica restored
                register = functools.partial(
                    retention.register_when_reachable, self._restored_position, self._stop
                )
                self._spawn("retention-register", register)
        else:
            # Events posted after the snapshot may be lost (the sinks retry only what they still
            # hold), or all of it (a snapshot not read): instances re-report by digests first.
            if self._restored or self.snapshots.lost:
                self.readiness.set(Readiness.RESYNCING)
            self.readiness.set(Readiness.SERVING)  # nothing to replay

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()
        if self.liveness is not None:
            self.liveness.close()
        if self.config.snapshot_path is not None:
            self.snapshots.take(last=True)

    @property
    def state(self) -> Readiness:
        return self.readiness.state

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"kvatlas-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _behind_trim(self) -> bool:
        """Whether entries after the restored position were trimmed away (counted, and the
        nodes of the other replicas asked for listings; docs/coordinator.md, "Stream retention")."""
        retention = self.snapshots.retention
        if behind := retention is not None and retention.behind(self._restored_position):
            self.metrics.stream_errors.labels("trimmed").inc()
            self._ask_listings()
        return behind

    def _stream_readiness(self, state: Readiness) -> None:
        """The consumer's readiness. ``resyncing`` from it means Redis lost events, and the
        retention registry with them: this replica's need goes back in at once. Its first
        ``catching_up`` (joined, nothing read) is when to ask whether the restored position
        was trimmed past: later, its own snapshots may let another replica trim past it."""
        if state is Readiness.CATCHING_UP and not self._trim_checked:
            self._trim_checked = True
            state = Readiness.RESYNCING if self._behind_trim() else state
            if self.cache_control.store is not None:  # joined: no other run of this replica
                self.cache_control.store.succeed(self.config.resolved_replica_id)
        elif state is Readiness.RESYNCING:
            self.snapshots.record_covered(self._restored_position)
            self._ask_listings()
        self.readiness.set(state)

    def _ask_listings(self) -> None:
        if self.liveness is not None:  # the Redis transport
            self.instances.expect_listings()
            self.liveness.ask_listings()

    def _set_stream_position(self, position: str) -> None:
        self.stream_position = position

    def answers_on_loop(self, body: bytes) -> bool:
        """Whether a request of ``body`` is answered on the event loop: small and the
        directory free (:data:`INLINE_BODY_BYTES`)."""
        return len(body) <= INLINE_BODY_BYTES and not self.directory.busy()

    # ------------------------------------------------------------------ ingestion

    def ingest(
        self,
        batches: Sequence[EventBatch | ColumnBatch],
        *,
        registered: bool = True,
        engine: bool = False,
    ) -> IngestCounts:
        """Every transport's batches (:meth:`Ingestion.ingest`)."""
        return self.ingestion.ingest(batches, registered=registered, engine=engine)

    # ------------------------------------------------------------------ lookups

    def lookup_keys(self, keys: Sequence[ObjectKey], max_ids: int | None = None) -> TokenLookup:
        """Placements of each key (contents of at most ``max_ids`` ids), holders' prefixes."""
        results = self.directory.lookup(keys, max_ids)
        return TokenLookup(len(keys), results, prefix_summary(results))  # LMCache's count

    def page_keys(
        self, where: KeyFilter, *, offset: int, limit: int, cursor: str | None
    ) -> KeyPage:
        """One page of the key listing; a cursor this directory never issued is refused."""
        try:
            return page_keys(self.directory, where, offset=offset, limit=limit, cursor=cursor)
        except ValueError as exc:
            raise Unprocessable(f"cursor: {exc}") from None

    # ------------------------------------------------------------------ instances

    def deregister(self, instance_id: str) -> Deregistration:
        """Forget the instance and its cursor, fence its L1 placements (L2 stays)."""
        known = self.instances.known(instance_id) or (
            self.directory.gap_state(instance_id) is not None
        )
        self.instances.deregister(instance_id)
        self.delivery.instance_left(instance_id)
        self.emitters.deregistered(instance_id, known, self._clock())
        return Deregistration(instance_id, known, self.directory.deregister(instance_id))

    def _fence_expired(self, instance_id: str) -> None:
        dropped = self.directory.fence_instance(instance_id)
        self.delivery.instance_fenced(instance_id)
        self.metrics.instances_expired.inc()
        log.warning(
            "instance %s missed heartbeats: fenced (%d L1 placements dropped)", instance_id, dropped
        )

    def _sweep_loop(self) -> None:
        period = min(1.0, self.config.instance_timeout / 4)
        while not self._stop.wait(period):
            self.instances.expire()
            self.forget_departed()
            self.status.tick()
            self.readiness.check_resynced()

    def _registrations_loop(self) -> None:
        """:func:`share_registrations` every second, on a thread of its own (a Redis that
        hangs must not hold up the sweeper's fencing); its view scores here (:attr:`elsewhere`)."""
        assert self.liveness is not None
        while not self._stop.wait(1.0):
            self.elsewhere = share_registrations(
                self.liveness, self.instances, self.config.group_name
            )

    def forget_departed(self) -> list[str]:
        """Forget every instance not registered (with any replica, on the Redis transport) that
        sent no batch for ``--emitter-retention-s`` seconds: its cursor (L1 fenced), lag and metric
        series. Runs at most every ``retention / 8`` seconds; returns the ids forgotten."""
        now = self._clock()
        retention = self.config.emitter_retention_s
        if now < self._next_departure_sweep:
            return []
        self._next_departure_sweep = now + retention / 8
        registered = {r.instance_id for r in self.instances.records()}
        if self.liveness is not None:  # registered with another replica: not departed
            try:
                registered |= set(self.liveness.seen(retention))
            except Unavailable as exc:  # cannot tell: nothing forgotten, asked again soon
                self._next_departure_sweep = now + min(retention / 8, 5.0)
                if self._say("departed"):  # not every 5 s through a Redis outage
                    log.warning("departed emitters not forgotten now: %s", exc)
                return []
        departed = self.emitters.departed(self.directory.emitters(), registered, now, retention)
        for instance_id in departed:
            self.directory.deregister(instance_id)
            self.delivery.instance_left(instance_id)
            self.metrics.forget_instance(instance_id)
        self.kv_events.forget(departed)
        if departed:
            log.info("forgot %d departed emitters (cursors, metric series)", len(departed))
        return departed

    # ------------------------------------------------------------------ resync

    def wants_digest(self, instance_id: str) -> bool:
        """Whether the instance should exchange digests now: it owes one (restored, or this
        replica is resyncing), or its batches showed a gap since its last exchange."""
        if self.instances.wants_digest(instance_id):
            return True
        cursor = self.directory.gap_state(instance_id)
        return cursor is not None and cursor.gaps > self.emitters.gaps_seen(instance_id)

    def compare_digests(
        self, instance_id: str, theirs: dict[str, dict[bytes, Digest]]
    ) -> dict[str, list[bytes]]:
        """The child prefixes whose buckets differ between the instance's digests and this
        directory's view of it, per tier; no difference anywhere completes the instance's
        digest exchange (so does applying its resync batches)."""
        cursor = self.directory.gap_state(instance_id)
        if cursor is not None:  # gaps up to now are what this exchange repairs
            self.emitters.exchanged(instance_id, cursor.gaps)
        out: dict[str, list[bytes]] = {}
        for tier, by_prefix in theirs.items():
            out[tier] = [
                p
                for prefix, digest in sorted(by_prefix.items())
                for p in differing(prefix, self.directory.digest(instance_id, tier, prefix), digest)
            ]
        if not any(out.values()):
            self.instances.digest_done(instance_id)
        self.metrics.digest_exchanges.labels("match" if not any(out.values()) else "differ").inc()
        return out

    # ------------------------------------------------------------------ snapshots

    def take_snapshot(self) -> SnapshotInfo | None:
        """Write a snapshot now (:meth:`Snapshots.take`)."""
        return self.snapshots.take()

    # ------------------------------------------------------------------ views

    def event_ages(self) -> dict[str, float]:
        """Seconds since each emitter's last batch (on the service clock)."""
        return self.emitters.ages(self._clock())

    def emitters_view(self) -> dict[str, EmitterView]:
        return emitter_views(self.directory.emitters(), self.emitters.deliveries(), self._clock())

    def instances_view(self, who: Principal = ANONYMOUS_ADMIN) -> list[InstanceView]:
        """Registered instances and instances that emit without registration (allowed), by
        instance id, as ``who`` may see them (:func:`~kvatlas.coordinator.emitters.instance_views`)."""
        now, records = self.instances.snapshot()
        return instance_views(records, now, self.emitters_view, who)

    def check_chunk_size(self, chunk_size: int | None) -> None:
        """Refuse (409) an instance whose chunk size is not the fleet's: its keys would never
        match (LMCache 0.5.7: ``chunk_size`` on registration, ``PUT /config/chunk-size``)."""
        if chunk_size is not None and chunk_size != self.config.chunk_size:
            raise Conflict(
                f"chunk_size {chunk_size} conflicts with the coordinator's --chunk-size "
                f"{self.config.chunk_size}"
            )

    def stats(self) -> StatsView:
        return StatsView(
            directory=self.directory.stats(),
            hash_scheme=self.scheme.name,
            instances_alive=len(self.instances.records()),
        )

    def metrics_state(self) -> MetricsState:
        consumer = self.stream_consumer
        return MetricsState(
            directory=self.directory.stats(),
            emitters=self.emitters_view(),
            instances_alive=len(self.instances.records()),
            mm_bypass=dict(MM_BYPASS_GUARD.reasons),
            kv_events=self.kv_events.stats(),
            readiness=self.state,
            stream_position=self.stream_position,
            stream_lag_entries=None if consumer is None else consumer.lag_entries,
        )

    def health(self) -> HealthView:
        redis = self.config.event_transport == "redis"
        return HealthView(
            state=self.state,
            scheme=self.scheme,
            enable_blend_lookup=self.directory.blend_lookup_enabled,
            event_transport=self.config.event_transport,
            stream_position=self.stream_position,
            event_stream=self.config.event_stream if redis else None,
            replica_id=self.config.resolved_replica_id,
            consumer_group=self.config.group_name if redis else None,
            kv_events=self.kv_events.stats(),
        )
