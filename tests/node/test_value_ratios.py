"""Every value ratio has its own denominator and never exceeds 100% (issue 29 item 1): random
mixes of prefix-only, blend-only and mixed traffic through a real CacheNode, its counters read
as the node's ``/metrics``, its value report as the coordinator parses it, and the ratios the
status page and ``/status.json`` show (``ValueRatios``).

Before: blend retrievals added fragment hit tokens but never query tokens, so a blend-only
client showed a fragment hit rate of thousands of percent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.coordinator.history import ValueRatios
from kvatlas.coordinator.node_reports import NodeReport, NodeReports
from kvatlas.node.embedded import EmbeddedFleet
from kvatlas.node.metrics import value_report
from kvatlas.node.toy_model import ToyRopeModel
from tests.node.test_cache_node import C, config

KINDS = ("prefix", "blend", "mixed")


def _traffic(node: object, model: ToyRopeModel, docs: list[np.ndarray],
             plan: list[tuple[str, int, int]], rng: np.random.Generator) -> None:  # fmt: skip
    for i, (kind, d, noise) in enumerate(plan):
        doc = docs[d]
        query = np.concatenate([rng.integers(600, 900, noise).astype(np.uint32), doc])
        tracker = node.tracker(token_ids=query, request_id=f"r{i}")  # type: ignore[attr-defined]
        prefix = 0
        if kind in ("prefix", "mixed"):
            prefix = node.retrieve(tracker).hit_tokens  # type: ignore[attr-defined]
        if kind in ("blend", "mixed"):
            result = node.blend_lookup(tracker, prefix_len=prefix)  # type: ignore[attr-defined]
            assert result is not None
            for _ in range(2 if i % 3 == 0 else 1):  # a client that retrieves twice
                node.blend_retrieve(tracker, result.segments)  # type: ignore[attr-defined]
        if i % 2 == 0:  # some requests are stored after their prefill
            node.store(tracker, model.kv_chunks(query))  # type: ignore[attr-defined]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(0, 40)),
                min_size=1, max_size=12), st.integers(0, 2**16))  # fmt: skip
def test_every_ratio_is_at_most_100_percent(tmp_path: Path, plan: list[tuple[str, int, int]],
                                            seed: int) -> None:  # fmt: skip
    with EmbeddedFleet([config()], l2_root=tmp_path, fleet_blend=False) as solo:
        node = solo.nodes["node-0"]
        model = ToyRopeModel(node.layout)
        rng = np.random.default_rng(seed)
        docs = [rng.integers(0, 500, n * C).astype(np.uint32) for n in (1, 2, 3)]
        for doc in docs:  # every document cached once, at offset 0
            node.store(node.tracker(token_ids=doc), model.kv_chunks(doc))
        _traffic(node, model, docs, plan, rng)
        counters = node.scrape()["counters"]
        # the node's own counters: hits within their denominators
        assert counters.get("prefix_hit_tokens", 0) <= counters.get("query_tokens", 0)
        assert counters.get("fragment_hit_tokens", 0) <= counters.get("blend_query_tokens", 0)
        # /metrics says the same
        text = node.timings.registry and _metrics_text(node)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
        hit = samples[("kvatlas_node_hit_tokens_total", (("kind", "fragment"),))]
        assert hit <= samples[("kvatlas_node_blend_query_tokens_total", ())]
        # the coordinator's view: the ratios of the page and /status.json
        reports = NodeReports()
        wire = value_report("boot-1", counters, {})
        reports.accept("node-0", NodeReport.from_wire(wire))
        ratios = ValueRatios.of(reports.totals())
        for name in ("prefix_hit_rate", "fragment_hit_rate", "regret_ratio"):
            value = getattr(ratios, name)
            assert value is None or 0.0 <= value <= 1.0, (name, value, wire)
        if counters.get("blend_query_tokens", 0):  # tokens after a prefix were blend-looked-up
            assert ratios.fragment_hit_rate is not None
        elif any(k != "prefix" for k, _, _ in plan):  # only whole-prefix hits were blended
            assert ratios.fragment_hit_rate is None


def _metrics_text(node: object) -> str:
    from prometheus_client import generate_latest

    return generate_latest(node.timings.registry).decode()  # type: ignore[attr-defined]
