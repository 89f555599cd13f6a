"""Prometheus metrics of the coordinator (``GET /metrics``), on a registry per service.

Counters and histograms are updated on the request path; gauges that mirror directory state
(keys, index contents, bytes, gaps, lag) are read at scrape time by a collector, so the hot
path never pays for them. The directory gauges mirror the fields of ``GET /directory/stats``
(read through ``wire.directory_stats_to_wire``). See docs/coordinator.md.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import kvatlas.coordinator.runtime as runtime
from kvatlas.checks import is_plain_int
from kvatlas.coordinator.kv_events.stats import GAUGES as KV_EVENTS_GAUGES
from kvatlas.coordinator.retention import parse_id
from kvatlas.coordinator.runtime import COLLECTIONS, MEMORY_TRIM
from kvatlas.coordinator.views import MetricsState, Readiness
from kvatlas.coordinator.wire import directory_stats_to_wire, kv_events_to_wire
from kvatlas.directory import Outcome
from kvatlas.events import TIERS
from kvatlas.http_limits import HttpRefusals

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class _StateCollector(Collector):
    def __init__(self, read_state: Callable[[], MetricsState]) -> None:
        self._read_state = read_state

    def collect(self) -> Iterator[Any]:
        state = self._read_state()
        directory = directory_stats_to_wire(state.directory)
        yield _gauge("kvatlas_directory_keys", "keys in the directory", directory["keys"])
        yield _gauge("kvatlas_directory_chunks", "distinct chunk hashes", directory["chunks"])
        yield _gauge("kvatlas_directory_placements", "live placements", directory["placements"])
        yield CounterMetricFamily(
            "kvatlas_directory_content_conflicts",
            "stores of other token ids for a chunk other namespaces of the salt hold (binding kept)",
            value=directory["content_conflicts"],
        )
        by_tier = GaugeMetricFamily("kvatlas_directory_bytes", "bytes per tier", labels=["tier"])
        stored = directory.get("bytes_by_tier", {})
        for tier in sorted(TIERS):  # every tier, 0 when empty: a series never vanishes
            by_tier.add_metric([tier], stored.get(tier, 0))
        yield by_tier
        l1 = GaugeMetricFamily(
            "kvatlas_instance_l1_keys", "L1 placements per instance", labels=["instance_id"]
        )
        for inst, value in sorted(directory.get("l1_placements_by_instance", {}).items()):
            l1.add_metric([inst], value)
        yield l1
        blend = directory.get("blend", {})
        yield _gauge(
            "kvatlas_blend_enabled", "blend lookup enabled", int(bool(blend.get("enabled")))
        )
        for name, value in sorted(blend.items()):
            if is_plain_int(value) or isinstance(value, float):
                yield _gauge(f"kvatlas_blend_index_{name}", f"blend index {name}", value)
        gaps = CounterMetricFamily(
            "kvatlas_event_gaps", "seq gaps per emitter", labels=["instance_id"]
        )
        lag = GaugeMetricFamily(
            "kvatlas_ingest_lag_seconds", "emitter ts to apply", labels=["instance_id"]
        )
        for inst, emitter in sorted(state.emitters.items()):
            gaps.add_metric([inst], emitter.gaps)
            if emitter.event_delivery_delay_seconds is not None:
                lag.add_metric([inst], emitter.event_delivery_delay_seconds)
        yield gaps
        yield lag
        yield _gauge("kvatlas_instances_alive", "registered instances", state.instances_alive)
        if state.readiness is not None:
            readiness = GaugeMetricFamily(
                "kvatlas_readiness", "1 for the readiness state this replica is in (/readyz)",
                labels=["state"],
            )  # fmt: skip
            for each in Readiness:  # every state, 0 but the current one: none vanishes
                readiness.add_metric([each.value], int(each is state.readiness))
            yield readiness
        if state.stream_position is not None:
            yield _gauge(
                "kvatlas_stream_position_seconds",
                "time (Redis's clock) of the last stream entry this replica applied",
                parse_id(state.stream_position)[0] / 1000,
            )
        if state.stream_lag_entries is not None:
            yield _gauge(
                "kvatlas_stream_lag_entries",
                "stream entries this replica's consumer group has not read yet",
                state.stream_lag_entries,
            )
        bypass = CounterMetricFamily(
            "kvatlas_mm_bypass",
            "requests refused a key (no usable multimodal identity)",
            labels=["reason"],
        )
        for reason, value in sorted(state.mm_bypass.items()):
            bypass.add_metric([reason], value)
        yield bypass
        kv_events = {} if state.kv_events is None else kv_events_to_wire(state.kv_events)
        for side, values in kv_events.items():
            family = CounterMetricFamily(
                f"kvatlas_kv_events_{side}", f"vLLM KV events ({side})", labels=["counter"]
            )
            for name, value in values.items():
                if name not in KV_EVENTS_GAUGES:
                    family.add_metric([name], value)
            yield family
            for name in sorted(KV_EVENTS_GAUGES & values.keys()):  # these can go down
                yield _gauge(
                    f"kvatlas_kv_events_{side}_{name}", f"vLLM KV events ({side})", values[name]
                )


class _CollectorStats(Collector):
    """The cyclic garbage collector, process-wide (a full collection stops every thread):
    objects frozen out of its sight, collections and (coordinator process) the longest pause
    per generation; see ``coordinator/runtime.py``."""

    def collect(self) -> Iterator[Any]:
        yield _gauge(
            "kvatlas_gc_frozen_objects", "objects frozen (gc.freeze)", gc.get_freeze_count()
        )
        yield CounterMetricFamily(
            "kvatlas_gc_freezes", "long-lived state frozen (runtime.py)", value=runtime.freezes
        )
        runs = CounterMetricFamily(
            "kvatlas_gc_collections", "collections per generation", labels=["generation"]
        )
        for gen, stats in enumerate(gc.get_stats()):
            runs.add_metric([str(gen)], stats["collections"])
        yield runs
        if COLLECTIONS.installed:
            longest = GaugeMetricFamily(
                "kvatlas_gc_longest_pause_seconds",
                "longest collection so far per generation",
                labels=["generation"],
            )
            for gen, seconds in enumerate(COLLECTIONS.longest_s):
                longest.add_metric([str(gen)], seconds)
            yield longest
        if MEMORY_TRIM.running:
            yield CounterMetricFamily(
                "kvatlas_memory_trims",
                "malloc_trim calls (runtime.MemoryTrim)",
                value=MEMORY_TRIM.trims,
            )
            yield _gauge(
                "kvatlas_memory_trim_longest_seconds",
                "longest malloc_trim so far (an arena's lock held as long)",
                MEMORY_TRIM.longest_s,
            )
            yield _gauge(
                "kvatlas_memory_thresholds_pinned",
                "1 if the C allocator's mmap and trim thresholds are pinned (runtime.MemoryTrim)",
                float(MEMORY_TRIM.pinned),
            )


REPLICA_HEALTH = frozenset(
    {
        "kvatlas_readiness", "kvatlas_stream_position_seconds", "kvatlas_stream_lag_entries",
        "kvatlas_stream_errors", "kvatlas_stream_rejected_entries",
        "kvatlas_event_refused_entries", "kvatlas_event_entries",
        "kvatlas_event_gaps", "kvatlas_ingest_lag_seconds", "kvatlas_directory_keys",
        "kvatlas_directory_chunks", "kvatlas_directory_placements", "kvatlas_directory_bytes",
        "kvatlas_route_score_seconds", "kvatlas_snapshots", "kvatlas_snapshot_failures",
        "kvatlas_snapshot_duration_seconds", "kvatlas_snapshot_pause_seconds",
    }
)  # fmt: skip
"""The families :meth:`CoordinatorMetrics.replica_health` exports (counters by their family
name, without ``_total``), and every ``kvatlas_kv_events_*`` one (the replica's KV-event
subscriptions)."""


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class CoordinatorMetrics:
    def __init__(self, read_state: Callable[[], MetricsState]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches = Counter(
            "kvatlas_event_batches",
            "event batches by outcome",
            ["instance_id", "outcome"],
            registry=r,
        )
        self.entries = Counter("kvatlas_event_entries", "event entries applied", registry=r)
        self.rejected = Counter(
            "kvatlas_event_rejected_bodies",
            "POST /events bodies refused whole (4xx, nothing applied), by reason (those of "
            "kvatlas_stream_rejected_entries)",
            ["reason"],
            registry=r,
        )
        self.refused_entries = Counter(
            "kvatlas_event_refused_entries",
            "cache events refused for their key's cache salt (the emitter's token may not store "
            "for it), by transport: http, in bodies refused whole (the node's sink sends them "
            "again without those); stream, left out of entries applied without them",
            ["transport", "reason"],
            registry=r,
        )
        self.lookup_latency = Histogram(
            "kvatlas_lookup_seconds",
            "prefix lookup latency",
            ["form"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.blend_latency = Histogram(
            "kvatlas_blend_lookup_seconds",
            "blend lookup latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.blend_matches = Counter("kvatlas_blend_matches", "blend matches returned", registry=r)
        self.route_latency = Histogram(
            "kvatlas_route_score_seconds",
            "route scoring latency (POST /route/score)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.snapshot_duration = Gauge(
            "kvatlas_snapshot_duration_seconds", "last snapshot duration", registry=r
        )
        self.snapshot_pause = Gauge(
            "kvatlas_snapshot_pause_seconds", "last snapshot's longest lock hold", registry=r
        )
        self.snapshots = Counter("kvatlas_snapshots", "snapshots written", registry=r)
        self.snapshot_failures = Counter(
            "kvatlas_snapshot_failures", "snapshots that failed", registry=r
        )
        self.journal_failures = Counter(
            "kvatlas_cache_journal_failures",
            "cache-control journal failures: write (refused by the disk, the change refused), "
            "damaged (a record that fails its checksum), orphaned (files without their snapshot)",
            ["reason"],
            registry=r,
        )
        self.instances_expired = Counter(
            "kvatlas_instances_expired", "instances fenced on timeout", registry=r
        )
        self.stream_errors = Counter(
            "kvatlas_stream_errors", "Redis stream read/decode errors", ["kind"], registry=r
        )
        self.stream_rejected = Counter(
            "kvatlas_stream_rejected_entries",
            "Redis stream entries refused by the gate checks (never applied), by reason",
            ["reason"],
            registry=r,
        )
        self.digest_exchanges = Counter(
            "kvatlas_digest_exchanges", "inventory digest exchanges", ["result"], registry=r
        )
        self.stream_trims = Counter(
            "kvatlas_stream_trimmed_entries", "stream entries trimmed by MINID", registry=r
        )
        self.http_refused = HttpRefusals()
        r.register(self.http_refused)
        self._state = _StateCollector(read_state)
        r.register(self._state)
        r.register(_CollectorStats())

    def replica_health(self) -> Iterator[Any]:
        """The series that say whether this replica is healthy (:data:`REPLICA_HEALTH`),
        as this registry exports them, read without a call to Redis (a process hosting the
        replica exports them beside its own: ``kvatlas router --scores-from replica``)."""
        for collector in (self._state, self.stream_errors, self.stream_rejected,
                          self.refused_entries, self.entries,
                          self.route_latency, self.snapshots, self.snapshot_failures,
                          self.snapshot_duration, self.snapshot_pause):  # fmt: skip
            for family in collector.collect():
                if family.name in REPLICA_HEALTH or family.name.startswith("kvatlas_kv_events_"):
                    yield family

    def forget_instance(self, instance_id: str) -> None:
        """Drop an instance's labelled series (it departed: cardinality must not grow)."""
        for outcome in Outcome:
            with contextlib.suppress(KeyError):  # never counted with this outcome
                self.batches.remove(instance_id, outcome.value)
