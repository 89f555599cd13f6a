"""Shared benchmark plumbing: medians over repeats, ratio columns, rich tables, JSON output.

Machines here are shared and noisy, so every benchmark reports medians and the ratio to a naive
reference measured in the same run; absolute times drift, ratios hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@dataclass(frozen=True)
class BenchRow:
    """One measured case: ours vs the naive reference, in the same run."""

    case: str
    ours_s: float
    reference_s: float | None = None
    target: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return None if not self.reference_s else self.reference_s / self.ours_s


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


def add_common_arguments(parser: argparse.ArgumentParser, repeats: int = 7) -> None:
    parser.add_argument("--seed", type=int, default=0, help="workload seed (deterministic)")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed repeats per case")
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON here")


def report(
    title: str, rows: Sequence[BenchRow], json_path: Path | None, meta: dict[str, Any]
) -> None:
    table = Table(title=title)
    for column in ("case", "ours (median)", "naive reference", "speed-up", "target", "notes"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.case,
            format_seconds(row.ours_s),
            format_seconds(row.reference_s) if row.reference_s else "-",
            f"{row.ratio:.1f}×" if row.ratio else "-",
            row.target,
            ", ".join(f"{k}={v}" for k, v in row.extra.items()),
        )
    Console(width=max(Console().width, 150)).print(table)
    if json_path is not None:
        payload = {
            "title": title,
            "meta": meta,
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
        }
        json_path.write_text(json.dumps(payload, indent=2))
