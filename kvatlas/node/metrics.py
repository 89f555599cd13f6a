"""Prometheus metrics of a cache node (``GET /metrics``) and the value report it sends the
coordinator (``PUT /instances/{id}/report``, the regret ratio's source).

Where a thing happens it is counted there, in the node's ``counters`` (stores, lookups,
evictions, hit and query tokens, segment misses by cause, regret) or in the two histograms
kept here (fetch latency by source, re-RoPE time); tier sizes, the event outbox, coordinator
call failures and the multimodal bypass guard are read at scrape time. One registry per node,
so nodes embedded in one process do not mix. See docs/operator.md ("Node metrics").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.http_limits import HttpRefusals
from kvatlas.keys import MM_BYPASS_GUARD

_SECONDS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5,
)  # fmt: skip

VALUE_COUNTERS = (
    "query_tokens", "prefix_hit_tokens", "fragment_hit_tokens", "regret_tokens",
    "blend_query_tokens",
)  # fmt: skip
"""Counters of ``CacheNode.counters`` that go to the coordinator in a value report."""

COUNTERS: Mapping[str, tuple[str, str]] = {
    # node counter -> (metric name without _total, help)
    "chunks_stored": ("kvatlas_node_chunks_stored", "chunks stored in L1"),
    "l1_evictions": ("kvatlas_node_l1_evictions", "chunks evicted from L1"),
    "l1_rejected": ("kvatlas_node_l1_rejected", "chunks L1 could not take"),
    "l2_chunks_written": ("kvatlas_node_l2_chunks_written", "chunks written to L2"),
    "l2_write_failures": ("kvatlas_node_l2_write_failures", "L2 writes that failed"),
    "store_refused_uncacheable": (
        "kvatlas_node_store_refused_uncacheable",
        "stores refused: no usable multimodal identity",
    ),
    "query_tokens": ("kvatlas_node_query_tokens", "tokens of requests that retrieved"),
    "blend_query_tokens": (
        "kvatlas_node_blend_query_tokens",
        "tokens after the prefix of requests that blend-looked up (fragment hits' divisor)",
    ),
    "l2_bytes_written": ("kvatlas_node_l2_bytes_written", "bytes written to L2"),
    "regret_tokens": (
        "kvatlas_node_regret_tokens",
        "tokens recomputed although the directory listed them on another instance",
    ),
    "segments_reused": ("kvatlas_node_segments_reused", "blend segments served"),
    "l1_refused_pinned": (
        "kvatlas_node_l1_refused_pinned",
        "stores L1 refused because only pinned chunks could have made room",
    ),
    "l2_refused_pinned": (
        "kvatlas_node_l2_refused_pinned",
        "writes a capped fs L2 refused because only pinned chunks could have made room",
    ),
    "pin_refresh_failures": (
        "kvatlas_node_pin_refresh_failures",
        "reads of this node's pins from the coordinator that failed (the last set kept)",
    ),
    "moved_in_chunks": (
        "kvatlas_node_moved_in_chunks",
        "chunks a move's hold loaded into L1 from its source (a peer's L1 or private L2)",
    ),
}
LABELLED: Mapping[str, tuple[str, str, str]] = {
    # counter prefix -> (metric name, label, help)
    "lookups_": ("kvatlas_node_lookups", "kind", "lookups by kind (prefix, blend)"),
    "segment_miss_": (
        "kvatlas_node_segment_misses",
        "cause",
        "blend segments not served, by cause",
    ),
    "peer_fetch_": ("kvatlas_node_peer_fetch_failures", "failure", "peer fetches that failed"),
    "rejected_": (
        "kvatlas_node_chunks_refused",
        "cause",
        "fetched chunks refused by verification, by cause",
    ),
}


def hit_tokens(kind: str) -> str:
    """The counter of hit tokens of ``kind`` (``prefix`` or ``fragment``)."""
    return f"{kind}_hit_tokens"


class NodeTimings:
    """The node's histograms (observed where the work happens) and its registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http_refused = HttpRefusals()
        self.registry.register(self.http_refused)
        self.fetch_seconds = Histogram(
            "kvatlas_node_fetch_seconds",
            "chunk fetch latency by source (one batched step per source)",
            ["source"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.rerope_seconds = Histogram(
            "kvatlas_node_rerope_seconds",
            "re-RoPE time per reused segment",
            buckets=_SECONDS,
            registry=self.registry,
        )

    def observe_fetch(self, source: str, seconds: float) -> None:
        self.fetch_seconds.labels(source).observe(seconds)

    def watch(self, read: Callable[[], Mapping[str, Any]]) -> None:
        """Export what ``read`` returns at each scrape (see :class:`_StateCollector`)."""
        self.registry.register(_StateCollector(read))


class _StateCollector(Collector):
    """Reads ``{"counters", "l1_bytes", "l1_capacity_bytes", "l1_chunks", "outbox": {...},
    "coordinator_failures"}`` at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        state = self._read()
        counters: Mapping[str, int] = state["counters"]
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=counters.get(key, 0))
        for prefix, (name, label, doc) in LABELLED.items():
            family = CounterMetricFamily(name, doc, labels=[label])
            for key, value in sorted(counters.items()):
                if key.startswith(prefix):
                    family.add_metric([key[len(prefix) :]], value)
            yield family
        hits = CounterMetricFamily(
            "kvatlas_node_hit_tokens", "tokens served from cache, by kind", labels=["kind"]
        )
        for kind in ("prefix", "fragment"):
            hits.add_metric([kind], counters.get(hit_tokens(kind), 0))
        yield hits
        for name in ("l1_bytes", "l1_capacity_bytes", "l1_chunks"):
            yield GaugeMetricFamily(f"kvatlas_node_{name}", name.replace("_", " "), state[name])
        yield GaugeMetricFamily(
            "kvatlas_node_pinned_keys",
            "keys the coordinator lists as pinned on this node (never evicted here)",
            state.get("pinned_keys", 0),
        )
        yield GaugeMetricFamily(
            "kvatlas_node_held_keys",
            "keys moves hold in L1 here until their source's copy is deleted (never evicted)",
            state.get("held_keys", 0),
        )
        outbox = state.get("outbox") or {}
        yield GaugeMetricFamily(
            "kvatlas_node_outbox_depth",
            "event batches queued or in flight",
            outbox.get("pending", 0),
        )
        yield CounterMetricFamily(
            "kvatlas_node_outbox_dropped_batches",
            "event batches dropped (full outbox, refused, close)",
            value=outbox.get("dropped_batches", 0) + outbox.get("quarantined_batches", 0),
        )
        refused = CounterMetricFamily(
            "kvatlas_node_events_refused",
            "cache events the coordinator refused for good, by reason (cache_salt: left out of "
            "their delivered batch; batch: in a batch quarantined whole, a gap)",
            labels=["reason"],
        )
        refused.add_metric(["cache_salt"], outbox.get("salt_refused_entries", 0))
        refused.add_metric(["batch"], outbox.get("quarantined_entries", 0))
        yield refused
        yield CounterMetricFamily(
            "kvatlas_node_coordinator_call_failures",
            "coordinator calls that failed (registration, heartbeats, lookups, blend, reports)",
            value=state.get("coordinator_failures", 0),
        )
        bypass = CounterMetricFamily(
            "kvatlas_node_mm_bypass",
            "requests refused a key by the multimodal bypass guard, by reason",
            labels=["reason"],
        )
        for reason, value in sorted(MM_BYPASS_GUARD.reasons.items()):
            bypass.add_metric([reason], value)
        yield bypass


def value_report(
    boot: str, counters: Mapping[str, int], tiers: Mapping[str, int]
) -> dict[str, Any]:
    """The body of ``PUT /instances/{id}/report``: cumulative value counters since ``boot``
    and the tier gauges (see ``kvatlas.coordinator.node_reports``)."""
    return {"boot": boot, **{k: counters.get(k, 0) for k in VALUE_COUNTERS}, **tiers}


def new_boot() -> str:
    """An id for this process's counters: a restarted node's counters start from zero."""
    return uuid.uuid4().hex
