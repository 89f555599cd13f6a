"""The router's ``/metrics`` (Prometheus): decisions, their latency, what was predicted against
what the engine reported reusing, TTFT and end-to-end latency measured at the router,
retries, untokenized requests, engines out of the set, the connections and requests the
HTTP guard refused, and the scorer's own series (a replica's health; docs/router.md,
"Metrics")."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.registry import Collector

from kvatlas.http_limits import HttpRefusals

DECISION_BUCKETS = (
    *(round(k * 0.00025, 5) for k in range(1, 21)),  # every 0.25 ms up to the 5 ms target
    0.006, 0.007, 0.008, 0.009, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
"""Fine enough to read a p99 against the spec's 5 ms to a quarter of a millisecond
(``kvatlas bench router`` interpolates inside a bucket, as Prometheus's histogram_quantile)."""
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class EngineSeries:
    """One engine's labelled counters, looked up once (``labels()`` takes a lock and builds
    a key on every call: once per engine, not four times per request)."""

    policy: str
    decisions: Counter
    prompt_tokens: Counter
    predicted_reused: Counter
    reported_reused: Counter


class _Exported(Collector):
    """Series the router exports from elsewhere at scrape time (its scorer's)."""

    def __init__(self, series: Callable[[], Iterable[Metric]]) -> None:
        self._series = series

    def collect(self) -> Iterator[Metric]:
        yield from self._series()


class RouterMetrics:
    def __init__(self, series: Callable[[], Iterable[Metric]] = tuple) -> None:
        """``series``: more series to export at each scrape (the scorer's: a replica's)."""
        self._engines: dict[str, EngineSeries] = {}
        self._scrape = threading.Lock()
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "kvatlas_router_decisions", "requests routed, by policy and chosen engine",
            ["policy", "engine"], registry=r,
        )  # fmt: skip
        self.decision_seconds = Histogram(
            "kvatlas_router_decision_seconds", "route decision latency (score + choice)",
            buckets=DECISION_BUCKETS, registry=r,
        )  # fmt: skip
        self.predicted_reused = Counter(
            "kvatlas_router_predicted_reused_tokens",
            "prompt tokens the chosen engine was predicted to reuse (prefix + fragments)",
            ["engine"], registry=r,
        )  # fmt: skip
        self.reported_reused = Counter(
            "kvatlas_router_reported_reused_tokens",
            "prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["engine"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvatlas_router_prompt_tokens", "prompt tokens of routed requests (as tokenized)",
            ["engine"], registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "kvatlas_router_ttft_seconds", "request arrival to the engine's first byte",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_seconds = Histogram(
            "kvatlas_router_e2e_seconds", "request arrival to the engine's last byte",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvatlas_router_retries", "requests retried on the next engine after a refusal",
            registry=r,
        )  # fmt: skip
        self.untokenized = Counter(
            "kvatlas_router_untokenized", "requests routed by load: tokens unknown (reason)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.score_failures = Counter(
            "kvatlas_router_score_failures",
            "coordinator scores not had in time or refused: routed by load", registry=r,
        )  # fmt: skip
        self.score_json_fallbacks = Counter(
            "kvatlas_router_score_json_fallbacks",
            "score calls the coordinator answered only in JSON (older than the router: msgpack "
            "refused); JSON bodies follow for 5 min", registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "kvatlas_router_errors", "requests answered with an error by the router (status)",
            ["status"], registry=r,
        )  # fmt: skip
        self.aborted_streams = Counter(
            "kvatlas_router_aborted_streams",
            "replies not relayed to their end (the engine cut them, or the client left)",
            registry=r,
        )  # fmt: skip
        self.engines_out = Gauge(
            "kvatlas_router_engines_out", "engines out of the candidate set (unhealthy)",
            registry=r,
        )  # fmt: skip
        self.engines_known = Gauge(
            "kvatlas_router_engines", "engines known (in or out of the set)", registry=r
        )
        self.in_flight = Gauge(
            "kvatlas_router_in_flight", "requests in flight per engine", ["engine"], registry=r
        )
        self.http_refused = HttpRefusals()  # the coordinator's and the node's series
        r.register(self.http_refused)
        r.register(_Exported(series))

    def render(
        self, engines_out: int, engines_known: int, in_flight: list[tuple[str, int]]
    ) -> bytes:
        """The exposition, with the engine gauges set from a view taken on the event loop;
        one scrape at a time (another's clearing of ``in_flight`` would drop series)."""
        with self._scrape:
            self.engines_out.set(engines_out)
            self.engines_known.set(engines_known)
            self.in_flight.clear()  # an engine that left the set leaves no series behind
            for engine_id, n in in_flight:
                self.in_flight.labels(engine_id).set(n)
            return generate_latest(self.registry)

    def engine(self, engine_id: str, policy: str) -> EngineSeries:
        """The counters of ``engine_id`` (its decisions under ``policy``, the router's one)."""
        series = self._engines.get(engine_id)
        if series is None:
            series = self._engines[engine_id] = EngineSeries(
                policy,
                self.decisions.labels(policy, engine_id),
                self.prompt_tokens.labels(engine_id),
                self.predicted_reused.labels(engine_id),
                self.reported_reused.labels(engine_id),
            )
        return series

    def retain(self, engine_ids: Iterable[str]) -> None:
        """Drop the labelled series of every engine not in ``engine_ids`` (it left the set:
        engines that come and go under new ids must not grow the exposition for ever, as
        the coordinator drops a departed instance's). On the event loop, as :meth:`engine`."""
        keep = set(engine_ids)
        for engine_id in [e for e in self._engines if e not in keep]:
            series = self._engines.pop(engine_id)
            self.decisions.remove(series.policy, engine_id)
            for counter in (self.prompt_tokens, self.predicted_reused, self.reported_reused):
                counter.remove(engine_id)
