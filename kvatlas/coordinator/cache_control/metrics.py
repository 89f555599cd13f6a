"""Cache control on ``GET /metrics``, read at scrape time: commands by kind and state
(:meth:`CommandLog.counts`; every kind and state, 0 when none, so no series vanishes), pinned
keys and the bytes of their copies (every tier), and each salt's own quota in bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, get_args

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.coordinator.cache_control.commands import CommandKind, CommandState
from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.coordinator.cache_control.service import CacheControl
from kvatlas.keys import ObjectKey


class CacheControlCollector(Collector):
    def __init__(
        self, control: Callable[[], CacheControl], copy_bytes: Callable[[list[ObjectKey]], int]
    ) -> None:
        self._control = control
        self._copy_bytes = copy_bytes  # bytes of every copy of these keys (the directory's)

    def collect(self) -> Iterator[Any]:
        control = self._control()
        counts = control.commands.counts()
        commands = GaugeMetricFamily(
            "kvatlas_cache_commands",
            "cache-control commands kept, by kind and state",
            labels=["kind", "state"],
        )
        for kind in get_args(CommandKind):
            for state in get_args(CommandState):
                commands.add_metric([kind, state], counts.get((kind, state), 0))
        yield commands
        rows = control.pins.rows()
        yield GaugeMetricFamily("kvatlas_pinned_keys", "keys holding a pin", value=len(rows))
        yield GaugeMetricFamily(
            "kvatlas_pinned_bytes", "bytes of the copies of pinned keys",
            value=self._copy_bytes([k for k, _n in rows]),
        )  # fmt: skip
        limits = GaugeMetricFamily(
            "kvatlas_quota_limit_bytes", "each salt's own quota", labels=["cache_salt"]
        )
        for salt, gb in sorted(control.quotas.limits().items()):
            limits.add_metric([salt], gb * GB)
        yield limits
