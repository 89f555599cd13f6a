"""The last hour of the coordinator's traffic and value counters, sampled every few seconds,
for the status page: rates and latency percentiles over the last minute, and per-minute
sparklines of the hit rates and the regret ratio.

Only counters are sampled (what the request path counts anyway), so the history costs the
request path nothing; everything it reports is a difference of two samples. Percentiles come
from histogram buckets and are bucket upper bounds ("p99 ≤ 2.5 ms"). See docs/operator.md.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from kvatlas.coordinator.node_reports import ValueCounters

SAMPLE_EVERY_S = 5.0
HOUR_S = 3600.0
MINUTE_S = 60.0
SPARK_POINTS = 60


@dataclass(frozen=True, slots=True)
class Buckets:
    """A histogram's cumulative bucket counts (upper bounds ascending, +Inf last)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Buckets) -> Buckets:
        if earlier.bounds != self.bounds:
            return self
        return Buckets(
            self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True))
        )

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile; ``None`` without data."""
        if self.total <= 0:
            return None
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= q * self.total:
                return bound
        return self.bounds[-1]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    entries: float
    lookups: Buckets
    blend_lookups: Buckets
    value: ValueCounters


@dataclass(frozen=True, slots=True)
class Traffic:
    """The last minute (or since the first sample, when younger): rates per second and
    latency bucket bounds in seconds (``None``: no request)."""

    window_s: float
    events_per_s: float
    lookups_per_s: float
    blend_lookups_per_s: float
    lookup_p50_s: float | None
    lookup_p99_s: float | None
    blend_p50_s: float | None
    blend_p99_s: float | None


@dataclass(frozen=True, slots=True)
class ValueRatios:
    """Hit rates, each ÷ the tokens its kind of lookup asked (prefix: retrievals' query tokens;
    fragment: blend lookups' tokens after the prefix), and the regret ratio (÷ tokens
    recomputed); ``None`` where the divisor is 0, never above 1 (a client that retrieves the
    same segments twice counts its hits twice)."""

    prefix_hit_rate: float | None
    fragment_hit_rate: float | None
    regret_ratio: float | None

    @classmethod
    def of(cls, v: ValueCounters) -> ValueRatios:
        return cls(
            _ratio(v.prefix_hit_tokens, v.query_tokens),
            _ratio(v.fragment_hit_tokens, v.blend_query_tokens),
            _ratio(min(v.regret_tokens, v.recomputed_tokens), v.recomputed_tokens),
        )


@dataclass(frozen=True, slots=True)
class Sparklines:
    """Per-minute ratios over the last hour, oldest first (``None``: nothing that minute)."""

    prefix_hit_rate: tuple[float | None, ...]
    fragment_hit_rate: tuple[float | None, ...]
    regret_ratio: tuple[float | None, ...]


def _ratio(part: int, whole: int) -> float | None:
    return min(part, whole) / whole if whole > 0 else None


def read_counter(counter: Counter) -> float:
    """A label-less counter's total (``_total`` sample), through the public ``collect``."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def read_buckets(histogram: Histogram) -> Buckets:
    """A histogram's buckets summed over its label values."""
    by_bound: dict[float, float] = {}
    for metric in histogram.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + s.value
    bounds = tuple(sorted(by_bound))
    return Buckets(bounds, tuple(by_bound[b] for b in bounds))


class History:
    """Samples taken by :meth:`maybe_sample` (called from a service thread every second or
    so) at most every ``SAMPLE_EVERY_S``; one hour kept."""

    def __init__(self, read: Callable[[float], Sample], clock: Callable[[], float]) -> None:
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=int(HOUR_S / SAMPLE_EVERY_S) + 2)

    def maybe_sample(self) -> None:
        now = self._clock()
        with self._lock:
            if self._samples and now - self._samples[-1].at < SAMPLE_EVERY_S:
                return
        sample = self._read(now)
        with self._lock:
            self._samples.append(sample)

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def traffic(self, current: Sample) -> Traffic:
        """The last minute, ending at ``current`` (read now, not kept)."""
        then = _at_or_before(self.samples(), current.at - MINUTE_S)
        if then is None:
            return Traffic(0.0, 0.0, 0.0, 0.0, None, None, None, None)
        span = max(current.at - then.at, 1e-9)
        lookups = current.lookups.minus(then.lookups)
        blend = current.blend_lookups.minus(then.blend_lookups)
        return Traffic(
            window_s=current.at - then.at,
            events_per_s=(current.entries - then.entries) / span,
            lookups_per_s=lookups.total / span,
            blend_lookups_per_s=blend.total / span,
            lookup_p50_s=lookups.quantile(0.5),
            lookup_p99_s=lookups.quantile(0.99),
            blend_p50_s=blend.quantile(0.5),
            blend_p99_s=blend.quantile(0.99),
        )

    def sparklines(self, now: float) -> Sparklines:
        """One point per minute of the last hour (of the history's life, when younger): the
        ratios of that minute's growth."""
        samples = self.samples()
        minutes = 1 if not samples else int((now - samples[0].at) // MINUTE_S) + 1
        points: list[ValueRatios] = []
        for i in range(min(SPARK_POINTS, minutes), 0, -1):
            start = _at_or_before(samples, now - i * MINUTE_S)
            end = _at_or_before(samples, now - (i - 1) * MINUTE_S)
            if start is None or end is None or end is start:
                points.append(ValueRatios(None, None, None))
            else:
                points.append(ValueRatios.of(end.value.minus(start.value)))
        return Sparklines(
            tuple(p.prefix_hit_rate for p in points),
            tuple(p.fragment_hit_rate for p in points),
            tuple(p.regret_ratio for p in points),
        )


def _at_or_before(samples: Sequence[Sample], at: float) -> Sample | None:
    """The latest sample taken at or before ``at``; the oldest one when all are later (so a
    young coordinator still shows its whole life)."""
    best = None
    for s in samples:
        if s.at <= at:
            best = s
        else:
            break
    return best if best is not None else (samples[0] if samples else None)
