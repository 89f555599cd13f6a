"""``/metrics`` with vLLM 0.33's metric names, labels (``model_name``, ``engine``) and the
time-to-first-token buckets of its ``vllm/v1/metrics/buckets.py``, so a router or a dashboard
built for vLLM reads the simulated engine unchanged. Times are model seconds (wall seconds
times ``--speed``). Counters are set from the engine's own counts at scrape time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from kvatlas.engine_sim.scheduler import EngineCore

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LABELS = ("model_name", "engine")


class _Total:
    """A Prometheus counter that mirrors a count kept elsewhere (only ever goes up)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen = 0

    def sync(self, value: int) -> None:
        if value > self.seen:
            self.counter.inc(value - self.seen)
            self.seen = value


class EngineMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, (model, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> _Total:
            return _Total(Counter(name, doc, LABELS, registry=r).labels(*labels))

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")  # fmt: skip
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")  # fmt: skip
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")  # fmt: skip
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")  # fmt: skip
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")  # fmt: skip
        self.ext_queries = counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.")  # fmt: skip
        self.ext_hits = counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.")  # fmt: skip
        self.prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")  # fmt: skip
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")  # fmt: skip
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*LABELS, "finished_reason"], registry=r)  # fmt: skip
        self.model = model
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=r).labels(*labels)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=LATENCY_BUCKETS, registry=r).labels(*labels)  # fmt: skip

    def finished(self, reason: str) -> None:
        self.success.labels(self.model, "0", reason).inc()

    def render(self, core: EngineCore) -> bytes:
        counts = core.counts
        self.running.set(len(core.running))
        self.waiting.set(len(core.waiting))
        self.kv_usage.set(core.pool.usage())
        self.queries.sync(counts.prefix_queries)
        self.hits.sync(counts.prefix_hits)
        self.ext_queries.sync(counts.prefix_queries - counts.prefix_hits)
        self.ext_hits.sync(counts.cpu_hit_tokens + counts.node_hit_tokens)
        self.prompt.sync(counts.prompt_tokens)
        self.generation.sync(counts.generation_tokens)
        self.preemptions.sync(counts.preemptions)
        return bytes(generate_latest(self.registry))
