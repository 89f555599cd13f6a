"""What the operator sees (the status page, ``GET /status.json``) and the Prometheus series
that only exist for it: the fleet with each instance's liveness, events and tiers, the
directory and blend index, the last minute of traffic, and the value of the cache — hit
rates and the regret ratio from node reports (:mod:`kvatlas.coordinator.node_reports`).

A view is taken in one piece from the service's own views; nothing here is on a request path
but the status routes and the scrape. See docs/operator.md.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas import __version__
from kvatlas.coordinator.cache_control import CacheControl, Command
from kvatlas.coordinator.cache_control.commands import CommandKind, CommandState
from kvatlas.coordinator.cache_control.quotas import GB
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
from kvatlas.coordinator.views import EmitterView, InstanceView, Readiness
from kvatlas.directory import DirectoryStats, KeyDirectory, SnapshotInfo
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
    last_snapshot: SnapshotInfo | None
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
    ("stream", "kvatlas_stream_errors", {"kind": "redis"}, "{n} Redis stream read error(s)"),
    ("stream", "kvatlas_stream_errors", {"kind": "decode"}, "{n} stream entries undecodable"),
    ("snapshot", "kvatlas_snapshot_failures", {}, "{n} snapshot(s) failed"),
)  # fmt: skip


def _count(metrics: CoordinatorMetrics, family: str, labels: dict[str, str]) -> float:
    """A counter's total over the samples whose labels include ``labels``."""
    attribute = {
        "kvatlas_instances_expired": metrics.instances_expired,
        "kvatlas_digest_exchanges": metrics.digest_exchanges,
        "kvatlas_stream_errors": metrics.stream_errors,
        "kvatlas_snapshot_failures": metrics.snapshot_failures,
    }[family]
    return sum(
        s.value
        for m in attribute.collect()
        for s in m.samples
        if s.name.endswith("_total") and labels.items() <= s.labels.items()
    )


@dataclass(frozen=True, slots=True)
class QuotaRow:
    """One salt: its L2 bytes (what its quota counts), the limit that applies in bytes
    (``None``: exempt), whether that is its own or the default, and its pinned keys."""

    cache_salt: str
    usage_bytes: int
    limit_bytes: float | None
    own: bool
    pinned_keys: int


@dataclass(frozen=True, slots=True)
class CommandCount:
    """How many commands of a kind are in a state (every kind and state, 0 when none)."""

    kind: str
    state: str
    count: int


@dataclass(frozen=True, slots=True)
class OpenCommand:
    """An unfinished cache-control command: where it stands and why (its last error)."""

    command_id: str
    kind: str
    targets: tuple[str, ...]
    keys: int
    state: str
    attempts: int
    age_s: float
    last_error: str


CACHE_ROWS = 50
"""Salts and unfinished commands the page lists at most (the most used / oldest first)."""


USAGE_MIN_AGE_S = 5.0
USAGE_COST_FACTOR = 20
"""Each salt's L2 bytes are counted by a pass over the whole directory (its cost grows with the
keys: docs/operator.md): the page reuses the last count until it is :data:`USAGE_MIN_AGE_S` old and
:data:`USAGE_COST_FACTOR` times as old as that pass took, so however large the directory and
however many tabs refresh, counting takes at most a twentieth of one core."""


@dataclass(frozen=True, slots=True)
class SaltUsage:
    bytes: dict[str, int]
    age_s: float


class SaltUsageCache:
    """The last count of each salt's L2 bytes, renewed by the rule above (``clock``: the
    service's monotonic clock)."""

    def __init__(self, count: Callable[[], dict[str, int]], clock: Callable[[], float]) -> None:
        self._count, self._clock = count, clock
        self._lock = threading.Lock()
        self._last: tuple[float, float, dict[str, int]] | None = None  # (at, took_s, bytes)

    def get(self) -> SaltUsage:
        with self._lock:  # a second reader waits for the pass under way, then shares it
            last = self._last
            now = self._clock()
            if last is None or now - last[0] >= max(USAGE_MIN_AGE_S, USAGE_COST_FACTOR * last[1]):
                counted = self._count()
                done = self._clock()
                last = self._last = (done, done - now, counted)
            return SaltUsage(last[2], max(self._clock() - last[0], 0.0))


@dataclass(frozen=True, slots=True)
class CacheControlStatus:
    """Quotas and pins per salt, and commands by kind and state (docs/cache-control.md)."""

    default_limit_bytes: float | None
    usage_age_s: float  # the usage is counted at most every few seconds (SaltUsage)
    quotas: tuple[QuotaRow, ...]
    salts: int  # how many salts there are; ``quotas`` lists at most CACHE_ROWS of them
    pinned_keys: int
    pinned_bytes: int  # the bytes of every copy of the pinned keys, every tier
    commands: tuple[CommandCount, ...]
    unfinished: tuple[OpenCommand, ...]
    unfinished_total: int


def cache_control_status(
    control: CacheControl, directory: KeyDirectory, usage: SaltUsage, now: float
) -> CacheControlStatus:
    """What the page shows of cache control; ``now`` is wall-clock (commands' times are)."""
    pins = control.pins.rows()
    pinned: dict[str, int] = {}
    for key, _count in pins:
        pinned[key.cache_salt] = pinned.get(key.cache_salt, 0) + 1
    default = control.quotas.default_limit_gb
    own = control.quotas.limits()
    rows = []
    for salt in set(usage.bytes) | set(own) | set(pinned):
        limit = own.get(salt, default)
        rows.append(QuotaRow(
            salt, usage.bytes.get(salt, 0), None if limit is None else limit * GB, salt in own,
            pinned.get(salt, 0),
        ))  # fmt: skip
    rows.sort(key=lambda r: (-_pressure(r), -r.usage_bytes, r.cache_salt))
    pinned_bytes = sum(
        p.size_bytes for found in directory.lookup([k for k, _ in pins]) for p in found.placements
    )
    counts = control.commands.counts()
    unfinished = control.commands.unfinished()  # oldest first
    return CacheControlStatus(
        default_limit_bytes=None if default is None else default * GB,
        usage_age_s=usage.age_s,
        quotas=tuple(rows[:CACHE_ROWS]),
        salts=len(rows),
        pinned_keys=len(pins),
        pinned_bytes=pinned_bytes,
        commands=tuple(
            CommandCount(k, s, counts.get((k, s), 0))
            for k in get_args(CommandKind)
            for s in get_args(CommandState)
        ),
        unfinished=tuple(_open(c, now) for c in unfinished[:CACHE_ROWS]),
        unfinished_total=len(unfinished),
    )


def _open(c: Command, now: float) -> OpenCommand:
    return OpenCommand(
        c.command_id, c.kind, c.targets, len(c.keys), c.state, c.attempts,
        max(now - c.created_at, 0.0), c.last_error,
    )  # fmt: skip


def _pressure(row: QuotaRow) -> float:
    """Usage over limit (a limit of 0 with usage: infinitely over; exempt: 0)."""
    if row.limit_bytes is None:
        return 0.0
    if row.limit_bytes == 0:
        return float("inf") if row.usage_bytes else 0.0
    return row.usage_bytes / row.limit_bytes


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
        self.last_snapshot_at: float | None = None
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
        info, at = self.service.last_snapshot, self.last_snapshot_at
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

    def cache_control(self) -> CacheControlStatus:
        service = self.service
        usage = self.salt_usage.get()
        return cache_control_status(service.cache_control, service.directory, usage, time.time())

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
            "blend index probes the filter let through that no content had",
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
