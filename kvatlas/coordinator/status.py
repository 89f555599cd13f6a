"""What the operator sees (the status page, ``GET /status.json``) and the Prometheus series
that only exist for it: the fleet with each instance's liveness, events and tiers, the
directory and blend index, the last minute of traffic, and the value of the cache — hit
rates and the regret ratio from node reports (:mod:`kvatlas.coordinator.node_reports`).

A view is taken in one piece from the service's own views; nothing here is on a request path
but the status routes and the scrape. See docs/operator.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas import __version__
from kvatlas.coordinator.cache_control import CacheControl
from kvatlas.coordinator.cache_control.status import (
    CacheControlStatus,
    SaltUsageCache,
    cache_control_status,
)
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.history import (
    History,
    Sample,
    Sparklines,
    Traffic,
    ValueRatios,
    read_buckets,
    read_counter,
)
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.node_reports import NodeReports, TierGauges, ValueCounters
from kvatlas.coordinator.snapshots import Snapshots
from kvatlas.coordinator.views import EmitterView, InstanceView, Readiness
from kvatlas.directory import DirectoryStats, KeyDirectory
from kvatlas.errors import Unavailable
from kvatlas.keys import KeyScheme
from kvatlas.redis_clients import redis_client


class CoordinatorParts(Protocol):
    """What the status source reads of the coordinator service (``service.py``, which owns
    the source: a protocol, not an import, keeps the two modules out of a cycle)."""

    config: CoordinatorConfig
    metrics: CoordinatorMetrics
    directory: KeyDirectory
    cache_control: CacheControl
    instances: InstanceRegistry
    scheme: KeyScheme
    snapshots: Snapshots
    clock: Callable[[], float]

    @property
    def state(self) -> Readiness: ...

    def event_ages(self) -> dict[str, float]: ...

    def instances_view(self) -> list[InstanceView]: ...


@dataclass(frozen=True, slots=True)
class FleetRow:
    """One instance: ``alive`` (registered, heartbeating) or fenced (emits or emitted but
    is not registered: its L1 placements were dropped)."""

    instance_id: str
    alive: bool
    backend: str
    heartbeat_age_s: float | None
    event_age_s: float | None
    emitter: EmitterView
    l1_placements: int
    tiers: TierGauges | None  # from the node's last report


@dataclass(frozen=True, slots=True)
class SnapshotStatus:
    age_s: float
    seconds: float
    max_pause_s: float
    keys: int


@dataclass(frozen=True, slots=True)
class RecentEvent:
    """A fault or repair the operator should see: when (Unix time), what kind, what."""

    at: float
    kind: str
    detail: str


RECENT_EVENTS = 20
"""How many recent events the page and ``/status.json`` keep (newest first)."""
_FAULTS: tuple[tuple[str, str, dict[str, str], str], ...] = (
    # (kind, metric family, labels to match, what an increase of n means)
    ("fence", "kvatlas_instances_expired", {}, "{n} instance(s) fenced: heartbeats missed"),
    ("resync", "kvatlas_digest_exchanges", {"result": "differ"},
     "{n} digest exchange(s) found differences: resyncing"),
    ("stream", "kvatlas_stream_errors", {"kind": "lost"},
     "Redis lost events: resyncing from the nodes' digests"),
    ("stream", "kvatlas_stream_errors", {"kind": "trimmed"},
     "entries this replica needed were trimmed from the stream: resyncing from the nodes' digests"),
    ("stream", "kvatlas_stream_errors", {"kind": "redis"}, "{n} Redis stream read error(s)"),
    ("stream", "kvatlas_stream_errors", {"kind": "decode"}, "{n} stream entries undecodable"),
    ("snapshot", "kvatlas_snapshot_failures", {}, "{n} snapshot(s) failed"),
    ("snapshot", "kvatlas_cache_journal_failures", {}, "{n} cache-control journal failure(s)"),
)  # fmt: skip


def _count(metrics: CoordinatorMetrics, family: str, labels: dict[str, str]) -> float:
    """A counter's total over the samples whose labels include ``labels``."""
    attribute = {
        "kvatlas_instances_expired": metrics.instances_expired,
        "kvatlas_digest_exchanges": metrics.digest_exchanges,
        "kvatlas_stream_errors": metrics.stream_errors,
        "kvatlas_snapshot_failures": metrics.snapshot_failures,
        "kvatlas_cache_journal_failures": metrics.journal_failures,
    }[family]
    return sum(
        s.value
        for m in attribute.collect()
        for s in m.samples
        if s.name.endswith("_total") and labels.items() <= s.labels.items()
    )


@dataclass(frozen=True, slots=True)
class StatusView:
    version: str
    readiness: Readiness
    hash_scheme: str
    fleet: tuple[FleetRow, ...]
    directory: DirectoryStats
    traffic: Traffic
    value: ValueCounters
    ratios: ValueRatios
    sparklines: Sparklines
    snapshot: SnapshotStatus | None
    snapshot_path: str | None
    event_transport: str
    stream_length: int | None  # the redis transport's stream
    recent: tuple[RecentEvent, ...] = ()
    """Faults and repairs since start, newest first (at most :data:`RECENT_EVENTS`)."""
    cache_control: CacheControlStatus | None = None


class StatusSource:
    """Samples the service's counters into a :class:`History` (``tick``, from the service's
    sweeper thread), builds :class:`StatusView` values and exports the operator's series."""

    def __init__(self, service: CoordinatorParts) -> None:
        self.service = service
        self.reports = NodeReports()
        self.history = History(self._sample, service.clock)
        self._redis: Any = None  # a client of its own for XLEN (the redis transport only)
        self.salt_usage = SaltUsageCache(service.directory.bytes_by_salt, service.clock)
        service.metrics.registry.register(_OperatorCollector(self))
        self.recent: deque[RecentEvent] = deque(maxlen=RECENT_EVENTS)
        self._fault_counts = [0.0] * len(_FAULTS)
        self.note("start", "coordinator started")

    def note(self, kind: str, detail: str) -> None:
        """Add a recent event (now)."""
        self.recent.appendleft(RecentEvent(time.time(), kind, detail))

    def _faults(self) -> None:
        """A recent event for every fault counter that grew since the last tick."""
        metrics = self.service.metrics
        for i, (kind, family, labels, text) in enumerate(_FAULTS):
            now = _count(metrics, family, labels)
            if now > self._fault_counts[i]:
                self.note(kind, text.format(n=int(now - self._fault_counts[i])))
            self._fault_counts[i] = now

    def tick(self) -> None:
        self._faults()
        self.history.maybe_sample()
        self.reports.retain({r.instance_id for r in self.service.instances.records()})

    def _sample(self, now: float) -> Sample:
        m = self.service.metrics
        return Sample(
            now,
            read_counter(m.entries),
            read_buckets(m.lookup_latency),
            read_buckets(m.blend_latency),
            self.reports.totals(),
        )

    def stream_length(self) -> int | None:
        """Entries in the event stream (``XLEN``; the redis transport only), ``None`` when
        there is no stream or Redis does not answer within a second."""
        config = self.service.config
        if config.event_transport != "redis" or not config.redis_url:
            return None
        import redis

        if self._redis is None:
            self._redis = redis_client(
                config.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
            )
        try:
            return int(self._redis.xlen(config.event_stream))
        except redis.RedisError:
            return None

    def snapshot_status(self) -> SnapshotStatus | None:
        info, at = self.service.snapshots.last, self.service.snapshots.last_at
        if info is None or at is None:
            return None
        age = self.service.clock() - at
        return SnapshotStatus(age, info.seconds, info.max_pause_s, info.keys)

    def fleet(self, directory: DirectoryStats) -> tuple[FleetRow, ...]:
        service = self.service
        ages = service.event_ages()
        tiers = self.reports.tiers()
        l1 = directory.l1_placements_by_instance
        rows = []
        for v in service.instances_view():
            reg = v.registration
            backend = str(reg.metadata.get("backend", "")) if reg is not None else ""
            row = FleetRow(
                v.instance_id, v.alive, backend, v.last_heartbeat_age_s,
                ages.get(v.instance_id), v.emitter, l1.get(v.instance_id, 0),
                tiers.get(v.instance_id),
            )  # fmt: skip
            rows.append(row)
        return tuple(rows)

    def cache_control(self) -> CacheControlStatus | None:
        """``None`` while cache control cannot be read (Redis, where it is kept, is away)."""
        service = self.service
        usage = self.salt_usage.get()
        try:
            return cache_control_status(
                service.cache_control, service.directory, usage, time.time()
            )
        except Unavailable:
            return None

    def view(self) -> StatusView:
        service = self.service
        directory = service.directory.stats()
        now = service.clock()
        value = self.reports.totals()
        path = service.config.snapshot_path
        return StatusView(
            version=__version__,
            readiness=service.state,
            hash_scheme=service.scheme.name,
            fleet=self.fleet(directory),
            directory=directory,
            traffic=self.history.traffic(self._sample(now)),
            value=value,
            ratios=ValueRatios.of(value),
            sparklines=self.history.sparklines(now),
            snapshot=self.snapshot_status(),
            snapshot_path=None if path is None else str(path),
            event_transport=service.config.event_transport,
            stream_length=self.stream_length(),
            recent=tuple(self.recent),
            cache_control=self.cache_control(),
        )


def status_to_wire(view: StatusView) -> dict[str, Any]:
    """``GET /status.json``: the view as plain JSON (field names as in the dataclasses)."""
    wire = dataclasses.asdict(view)
    wire["readiness"] = view.readiness.value
    wire["value"]["recomputed_tokens"] = view.value.recomputed_tokens
    return wire


class _OperatorCollector(Collector):
    """Series read at scrape time: the fleet's value counters, each instance's tiers and
    event age, fenced instances, the last snapshot's age."""

    def __init__(self, source: StatusSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        source = self._source
        value = source.reports.totals()
        for field in dataclasses.fields(ValueCounters):
            yield CounterMetricFamily(
                f"kvatlas_fleet_{field.name}",
                f"{field.name.replace('_', ' ')} reported by nodes (cumulative)",
                value=getattr(value, field.name),
            )
        registered = {v.instance_id: v.alive for v in source.service.instances_view()}
        yield CounterMetricFamily(
            "kvatlas_blend_false_probes",
            "blend index candidates (anchor agreed) that differed from their window",
            value=source.service.directory.blend_false_probes,
        )
        fenced = sum(1 for alive in registered.values() if not alive)
        yield GaugeMetricFamily("kvatlas_instances_fenced", "emitters not registered", fenced)
        age = GaugeMetricFamily(
            "kvatlas_instance_event_age_seconds", "since the last batch", labels=["instance_id"]
        )
        for inst, seconds in sorted(source.service.event_ages().items()):
            age.add_metric([inst], seconds)
        yield age
        for tier_field in dataclasses.fields(TierGauges):
            family = GaugeMetricFamily(
                f"kvatlas_instance_{tier_field.name}",
                f"{tier_field.name.replace('_', ' ')} as the node last reported",
                labels=["instance_id"],
            )
            for inst, tiers in sorted(source.reports.tiers().items()):
                if registered.get(inst):
                    family.add_metric([inst], getattr(tiers, tier_field.name))
            yield family
        length = source.stream_length()
        if length is not None:
            yield GaugeMetricFamily(
                "kvatlas_event_stream_length", "entries in the Redis event stream", length
            )
        snapshot = source.snapshot_status()
        if snapshot is not None:
            yield GaugeMetricFamily(
                "kvatlas_snapshot_age_seconds", "since the last snapshot", snapshot.age_s
            )
