"""The status page's history: rates and percentiles of the last minute and per-minute
sparklines, all differences of samples taken on an injected clock."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvatlas.coordinator.history import (
    SAMPLE_EVERY_S,
    History,
    Sample,
    read_buckets,
    read_counter,
)
from kvatlas.coordinator.node_reports import ValueCounters

BUCKETS = (0.0005, 0.001, 0.25, 1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_traffic_of_the_last_minute_and_sparklines() -> None:
    registry = CollectorRegistry()
    entries = Counter("entries", "", registry=registry)
    lookups = Histogram("lookup_seconds", "", ["form"], buckets=BUCKETS, registry=registry)
    blend = Histogram("blend_seconds", "", buckets=BUCKETS, registry=registry)
    value = [ValueCounters()]
    clock = Clock()

    def read(now: float) -> Sample:
        return Sample(
            now, read_counter(entries), read_buckets(lookups), read_buckets(blend), value[0]
        )

    history = History(read, clock)
    history.maybe_sample()
    history.maybe_sample()  # too soon: not kept
    assert len(history.samples()) == 1
    # three minutes: each minute 600 entries, 98 fast lookups and two slow, growing value
    for minute in range(3):
        for _ in range(int(60 / SAMPLE_EVERY_S)):
            clock.now += SAMPLE_EVERY_S
            entries.inc(50)
            history.maybe_sample()
        for _ in range(98):
            lookups.labels("keys" if minute % 2 else "tokens").observe(0.0003)
        lookups.labels("keys").observe(0.2)
        lookups.labels("keys").observe(0.2)
        v = value[0]
        hits = [25, 50, 0][minute]
        value[0] = ValueCounters(
            v.query_tokens + 100, v.prefix_hit_tokens + hits, v.fragment_hit_tokens + 10 * minute,
            v.regret_tokens + 10 * minute, v.blend_query_tokens + 40,
        )  # fmt: skip
    clock.now += SAMPLE_EVERY_S
    history.maybe_sample()
    traffic = history.traffic(read(clock.now))
    assert traffic.window_s == 60.0
    assert traffic.events_per_s == (50 * 11) / 60  # the last 5 s saw none
    assert traffic.lookups_per_s == 100 / 60
    assert traffic.lookup_p50_s == 0.0005 and traffic.lookup_p99_s == 0.25
    assert traffic.blend_p50_s is None and traffic.blend_lookups_per_s == 0
    spark = history.sparklines(clock.now)
    assert len(spark.prefix_hit_rate) == 4  # the history is 3 minutes and 5 s old
    assert spark.prefix_hit_rate[-3:] == (0.25, 0.5, 0.0)
    # recomputed = query − prefix hits − fragment hits: 75, 40, 80
    assert spark.regret_ratio[-3:] == (0.0, 10 / 40, 20 / 80)
    # fragment hits ÷ blend query tokens (not ÷ the prefix retrievals' query tokens)
    assert spark.fragment_hit_rate[-3:] == (0.0, 10 / 40, 20 / 40)
