"""Cache control on ``GET /metrics``, read at scrape time: commands by kind and state
(:meth:`CommandLog.counts`; every kind and state, 0 when none, so no series vanishes), pinned
keys and the bytes of their copies (every tier), each salt's own quota in bytes, and from the
fleet eviction passes: each salt's L2 usage at the last pass and its ratio to the limit that
applies, and the bytes evicted by salt and reason (the policy); with the Redis transport, how
many times this replica seeded again a Redis that had lost the shared state."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.coordinator.cache_control.commands import CommandKind, CommandState
from kvatlas.coordinator.cache_control.eviction import limit_bytes_of
from kvatlas.coordinator.cache_control.eviction_loop import FleetEviction
from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.coordinator.cache_control.service import CacheControl
from kvatlas.errors import Unavailable
from kvatlas.keys import ObjectKey


class CacheControlCollector(Collector):
    def __init__(
        self,
        control: Callable[[], CacheControl],
        copy_bytes: Callable[[list[ObjectKey]], int],
        eviction: FleetEviction | None = None,
    ) -> None:
        self._control = control
        self._copy_bytes = copy_bytes  # bytes of every copy of these keys (the directory's)
        self._eviction = eviction

    def collect(self) -> Iterator[Any]:
        control = self._control()
        if control.store is not None:  # counted in this process: there while Redis is away
            yield CounterMetricFamily(
                "kvatlas_cache_store_reseeds",
                "times this replica seeded again a Redis that lost the cache-control state",
                value=control.store.reseeds,
            )
        try:  # with the Redis transport these are read from Redis: none while it is away
            counts, rows = control.commands.counts(), control.pins.rows()
            limits_gb = control.quotas.limits()
        except Unavailable:
            return
        commands = GaugeMetricFamily(
            "kvatlas_cache_commands",
            "cache-control commands kept, by kind and state",
            labels=["kind", "state"],
        )
        for kind in get_args(CommandKind):
            for state in get_args(CommandState):
                commands.add_metric([kind, state], counts.get((kind, state), 0))
        yield commands
        yield GaugeMetricFamily("kvatlas_pinned_keys", "keys holding a pin", value=len(rows))
        yield GaugeMetricFamily(
            "kvatlas_pinned_bytes", "bytes of the copies of pinned keys",
            value=self._copy_bytes([k for k, _n in rows]),
        )  # fmt: skip
        limits = GaugeMetricFamily(
            "kvatlas_quota_limit_bytes", "each salt's own quota", labels=["cache_salt"]
        )
        for salt, gb in sorted(limits_gb.items()):
            limits.add_metric([salt], gb * GB)
        yield limits
        if self._eviction is not None:
            yield from self._eviction_figures(control, self._eviction)

    @staticmethod
    def _eviction_figures(control: CacheControl, eviction: FleetEviction) -> Iterator[Any]:
        usage = GaugeMetricFamily(
            "kvatlas_quota_usage_bytes", "each salt's L2 bytes at the last eviction pass",
            labels=["cache_salt"],
        )  # fmt: skip
        ratio = GaugeMetricFamily(
            "kvatlas_quota_usage_ratio",
            "each salt's L2 bytes at the last eviction pass over the limit that applies to it "
            "(salts with a limit above 0)",
            labels=["cache_salt"],
        )
        for salt, used in sorted(eviction.usage().items()):
            usage.add_metric([salt], used)
            limit = limit_bytes_of(control.quotas, salt)
            if limit:
                ratio.add_metric([salt], used / limit)
        yield usage
        yield ratio
        evicted = CounterMetricFamily(
            "kvatlas_cache_evicted_bytes",
            "bytes the fleet eviction passes chose to evict, by salt and reason (the policy)",
            labels=["cache_salt", "reason"],
        )
        for (salt, reason), n in sorted(eviction.evicted_bytes().items()):
            evicted.add_metric([salt, reason], n)
        yield evicted
