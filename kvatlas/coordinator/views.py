"""What the coordinator service reports, as immutable values: readiness, emitters, instances,
health, stats. Each is taken in one piece (under the locks that guard its sources) and never
changes afterwards; :mod:`kvatlas.coordinator.wire` maps each to its JSON reply and back.
See docs/coordinator.md ("API").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvatlas.coordinator.instances import Registration
from kvatlas.directory import DirectoryStats
from kvatlas.keys import KeyScheme


class Readiness(StrEnum):
    """``restoring`` (loading the snapshot) → ``catching_up`` (Redis transport: replaying the
    stream up to its end) → ``serving``. A replica whose stream position was trimmed away goes
    ``resyncing`` instead of ``serving`` after catching up, until every live instance has
    completed a digest exchange (or twice the instance timeout passed). Lookups are answered in
    every state; ``/readyz`` tells a load balancer whether the answers are complete. The values
    are the wire form."""

    RESTORING = "restoring"
    CATCHING_UP = "catching_up"
    RESYNCING = "resyncing"
    SERVING = "serving"


@dataclass(frozen=True, slots=True)
class EmitterView:
    """Where one emitter's batches stand (``None``: it never emitted) and its ingest lag."""

    incarnation: int | None = None
    last_seq: int | None = None
    gaps: int = 0
    missing_batches: int = 0
    lag_s: float | None = None


NO_EMITTER = EmitterView()


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One row of ``GET /instances``: a registered instance (alive), or one that emits
    without having registered (``registration`` is ``None``; allowed, never alive)."""

    instance_id: str
    registration: Registration | None
    registered_at: float | None
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
    blend_lookup: bool
    event_transport: str
    stream_position: str | None
    event_stream: str | None = None
    """The Redis Stream the coordinator reads (the redis transport only)."""


@dataclass(frozen=True, slots=True)
class StatsView:
    """``GET /directory/stats``: the directory's statistics and what only the service knows."""

    directory: DirectoryStats
    """Mapped to JSON by ``wire.directory_stats_to_wire``."""
    key_scheme: str
    instances_alive: int


@dataclass(frozen=True, slots=True)
class MetricsState:
    """What the Prometheus collector reads at scrape time (see ``metrics.py``)."""

    directory: DirectoryStats
    """The gauges mirror ``/directory/stats``."""
    emitters: dict[str, EmitterView]
    instances_alive: int
    mm_bypass: dict[str, int]


@dataclass(frozen=True, slots=True)
class Deregistration:
    """``DELETE /instances/{id}``: whether the coordinator knew the instance (registered or
    emitting) and how many L1 placements were fenced."""

    instance_id: str
    known: bool
    fenced: int
