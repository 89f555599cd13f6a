"""``kvatlas bench router`` runs end to end on small sizes: every request it times was routed
with a score from the coordinator (no score failure), and it prints every row it promises."""

from __future__ import annotations

import json
from pathlib import Path

from kvatlas.bench import router
from kvatlas.cli import _build_parser as build_parser


def test_bench_router_scores_every_request(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", "router", "--chunks", "800", "--prompt-tokens", "1024", "--seconds", "0.5",
            "--ttft-requests", "8", "--clients", "2", "--json", str(out)]  # fmt: skip
    assert router.run(build_parser().parse_args(argv)) == 0
    rows = json.loads(out.read_text())["rows"]
    cases = [r["case"] for r in rows]
    assert sum("route decision" in c for c in cases) == 2
    assert any("--policy kvatlas (score + proxy)" in c for c in cases)
    assert any("--policy round-robin (proxy alone)" in c for c in cases)
    for row in rows[:2]:
        assert row["extra"]["score_failures"] == "0"
        assert float(row["extra"]["req_per_s"].replace(",", "")) > 0


def test_decision_quantiles_and_failures_come_from_the_prometheus_parser() -> None:
    """The bench reads the router's ``/metrics`` with prometheus_client's parser: bucket
    bounds (``+Inf`` included), the quantile's bucket between two scrapes, a counter."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    registry = CollectorRegistry()
    name = "kvatlas_router_decision_seconds"
    decisions = Histogram(name, "d", buckets=(0.001, 0.005, 0.01), registry=registry)
    failures = Counter("kvatlas_router_score_failures", "f", registry=registry)
    decisions.observe(0.0005)
    before = generate_latest(registry).decode()
    for seconds in (0.0005, 0.0005, *[0.004] * 7, 0.02):
        decisions.observe(seconds)
    failures.inc(3)
    after = generate_latest(registry).decode()
    inf = float("inf")
    assert router._histogram(after, name) == [
        (0.001, 3.0),
        (0.005, 10.0),
        (0.01, 10.0),
        (inf, 11.0),
    ]
    assert router._quantile_bound(before, after, name, 0.5) == 0.005
    assert router._quantile_bound(before, after, name, 0.99) == inf
    assert [s.value for s in router._samples(after, "kvatlas_router_score_failures_total")] == [3.0]
