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
