"""What the coordinator service reports, as immutable values: readiness, emitters, instances,
health, stats. Each is taken in one piece (under the locks that guard its sources) and never
changes afterwards; :mod:`kvatlas.coordinator.wire` maps each to its wire type (:mod:`kvatlas.api`).
See docs/coordinator.md ("API").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kvatlas.coordinator.instances import Registration
from kvatlas.directory import DirectoryStats, ModuleUsage
from kvatlas.keys import KeyScheme

if TYPE_CHECKING:  # the KV-event links load only where they run
    from kvatlas.coordinator.kv_events.stats import KvEventsStats


class Readiness(StrEnum):
    """``restoring`` (loading the snapshot) → (Redis transport: ``waiting_for_redis`` while
    Redis was never reached, then ``catching_up``: replaying the stream up to its end) →
    ``serving``. ``resyncing`` instead of ``serving`` when events may be missing — a restart on
    the HTTP transport from a snapshot, a stream position trimmed away, a stream or group that
    Redis lost — until every live instance has completed a digest exchange (or twice the
    instance timeout passed). ``group_held``: another live replica with this replica id
    consumes the group, this one does not consume. Lookups are answered in every state;
    ``/readyz`` tells a load balancer whether the answers are complete. The values are the
    wire form."""

    RESTORING = "restoring"
    WAITING_FOR_REDIS = "waiting_for_redis"
    CATCHING_UP = "catching_up"
    RESYNCING = "resyncing"
    SERVING = "serving"
    GROUP_HELD = "group_held"


@dataclass(frozen=True, slots=True)
class EmitterView:
    """Where one emitter's batches stand (``None``: it never emitted) and how its events
    arrive: events it said it dropped, seconds since its last applied batch, and the delay
    from its batch's ``ts`` to applying it (LMCache 0.5.7's per-emitter fields)."""

    incarnation: int | None = None
    last_seq: int | None = None
    gaps: int = 0
    missing_batches: int = 0
    events_dropped: int = 0
    seconds_since_last_event: float | None = None
    event_delivery_delay_seconds: float | None = None


NO_EMITTER = EmitterView()


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One row of ``GET /instances``: a registered instance (alive), or one that emits
    without having registered (``registration`` is ``None``; allowed, never alive)."""

    instance_id: str
    registration: Registration | None
    registration_time: float | None
    last_heartbeat_age_s: float | None
    emitter: EmitterView

    @property
    def alive(self) -> bool:
        return self.registration is not None


@dataclass(frozen=True, slots=True)
class HealthView:
    """``GET /healthz``: the key scheme a peer must share, and how events arrive."""

    state: Readiness
    scheme: KeyScheme
    enable_blend_lookup: bool
    event_transport: str
    stream_position: str | None
    event_stream: str | None = None
    """The Redis Stream the coordinator reads (the redis transport only)."""
    replica_id: str | None = None
    """This replica's id (``--replica-id`` or derived; docs/coordinator.md "Replicas")."""
    consumer_group: str | None = None
    """Its Redis consumer group (the redis transport only)."""
    kv_events: KvEventsStats | None = None
    """vLLM KV-event counters; only when a link is configured."""


@dataclass(frozen=True, slots=True)
class StatsView:
    """``GET /directory/stats``: the directory's statistics and what only the service knows."""

    directory: DirectoryStats
    """Mapped to JSON by ``wire.directory_stats_to_wire``."""
    hash_scheme: str
    instances_alive: int


@dataclass(frozen=True, slots=True)
class MetricsState:
    """What the Prometheus collector reads at scrape time (see ``metrics.py``)."""

    directory: DirectoryStats
    """The gauges mirror ``/directory/stats``."""
    emitters: dict[str, EmitterView]
    instances_alive: int
    mm_bypass: dict[str, int]
    kv_events: KvEventsStats | None = None
    """As in :class:`HealthView`."""
    readiness: Readiness | None = None
    stream_position: str | None = None
    """The last stream entry applied (the Redis transport; ``None``: none yet)."""
    stream_lag_entries: int | None = None
    """Entries of the stream not read yet (the Redis transport; ``None``: not known)."""


@dataclass(frozen=True, slots=True)
class Deregistration:
    """``DELETE /instances/{id}``: whether the coordinator knew the instance (registered or
    emitting) and how many L1 placements were fenced."""

    instance_id: str
    known: bool
    fenced: int


@dataclass(frozen=True, slots=True)
class InstanceUsage:
    """One instance's own modules (used bytes beside declared capacity)."""

    instance_id: str
    registered: bool
    declared_capacity: bool
    modules: tuple[ModuleUsage, ...]


@dataclass(frozen=True, slots=True)
class FleetUsage:
    """``GET /instances/usage``: every instance known by registration, declaration or copies,
    by id, and the shared pools."""

    instances: tuple[InstanceUsage, ...]
    shared_modules: tuple[ModuleUsage, ...]
