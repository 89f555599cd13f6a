"""Shared benchmark plumbing: medians over repeats, ratio columns, target verdicts, rich tables,
JSON output and an optional chart.

Machines here are shared and noisy, so every benchmark reports medians and the ratio to a naive
reference measured in the same run; absolute times drift, ratios hold. Every row with a target
says whether it met it (✔/✘); a configuration that would make a row meaningless is refused
(:func:`refuse`) instead of printing a figure that measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REFUSED = 2  # exit status of a refused configuration (as for an argument error)


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
    """One measured case: ours vs the naive reference, in the same run.

    ``ours_s`` is a time; a row that measures something else (bytes, a rate) leaves it ``None``
    and says what it measured in ``shown``. ``met`` is the verdict on ``target`` (``None``: the
    row has no target)."""

    case: str
    ours_s: float | None
    reference_s: float | None = None
    target: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    met: bool | None = None
    shown: str = ""

    @property
    def ratio(self) -> float | None:
        if not self.reference_s or not self.ours_s:
            return None
        return self.reference_s / self.ours_s


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


def verdict(row: BenchRow) -> str:
    if not row.target:
        return "-"
    if row.met is None:
        return row.target
    return f"{row.target} {'✔' if row.met else '✘'}"


_STARTED = time.monotonic()


def progress(benchmark: str, text: str) -> None:
    """One line on stderr (stdout keeps the table): a run of many minutes says what it is doing."""
    elapsed = time.monotonic() - _STARTED
    print(f"kvatlas bench {benchmark} [{elapsed:7.1f} s] {text}", file=sys.stderr, flush=True)


def warn_if_busy(benchmark: str) -> bool:
    """Warn (stderr) when the machine is busy — the 1-minute load average above the core
    count — since every timing then measures the other work too. True when it warned."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return False
    cores = os.cpu_count() or 1
    if load <= cores:
        return False
    print(f"kvatlas bench {benchmark}: warning: the machine is busy (load average {load:.1f} on "
          f"{cores} cores): timings include that other work; rerun on a quiet machine",
          file=sys.stderr)  # fmt: skip
    return True


def finished(benchmark: str, row: BenchRow) -> BenchRow:
    """``row``, announced by :func:`progress` as it finishes (the table comes at the end)."""
    shown = row.shown or (format_seconds(row.ours_s) if row.ours_s is not None else "-")
    progress(benchmark, f"done: {row.case}: {shown} {verdict(row)}".rstrip(" -"))
    return row


def refuse(benchmark: str, reason: str) -> int:
    """Say why a configuration is refused; the caller returns the status."""
    print(f"kvatlas bench {benchmark}: refused: {reason}", file=sys.stderr)
    return REFUSED


def add_common_arguments(parser: argparse.ArgumentParser, repeats: int = 7) -> None:
    parser.add_argument("--seed", type=int, default=0, help="workload seed (deterministic)")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed repeats per case")
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the timed rows (ours vs reference) into this PNG (needs matplotlib: "
        "pip install 'kvatlas[plot]')",
    )


def report(
    title: str, rows: Sequence[BenchRow], args: argparse.Namespace, meta: dict[str, Any]
) -> None:
    table = Table(title=title)
    for column in ("case", "ours (median)", "naive reference", "speed-up", "target", "notes"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.case,
            row.shown or (format_seconds(row.ours_s) if row.ours_s is not None else "-"),
            format_seconds(row.reference_s) if row.reference_s else "-",
            f"{row.ratio:.1f}×" if row.ratio else "-",
            verdict(row),
            ", ".join(f"{k}={v}" for k, v in row.extra.items()),
        )
    Console(width=max(Console().width, 150)).print(table)
    judged = [r for r in rows if r.met is not None]
    print(f"targets met: {sum(bool(r.met) for r in judged)}/{len(judged)}")
    if args.json is not None:
        payload = {
            "title": title,
            "meta": meta,
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    if args.plot is not None:
        plot(title, rows, args.plot)


def plot(title: str, rows: Sequence[BenchRow], path: Path) -> None:
    """A horizontal bar chart of every timed row: ours and, where measured, the reference
    (log scale: the rows span microseconds to seconds)."""
    timed = [r for r in rows if r.ours_s]
    if not timed:
        print("warning: no timed rows to plot", file=sys.stderr)
        return
    labels = [f"{r.case} {'✔' if r.met else '✘' if r.met is False else ''}" for r in timed]
    series = {
        "kvatlas": [r.ours_s or 0.0 for r in timed],
        "naive reference": [r.reference_s or 0.0 for r in timed],
    }
    bar_chart(title, labels, series, "seconds (median, log scale)", path, log=True)


def bar_chart(
    title: str,
    labels: Sequence[str],
    series: dict[str, list[float]],
    xlabel: str,
    path: Path,
    log: bool = False,
) -> None:
    """Horizontal bars, one group per label and one bar per series, into the PNG ``path``
    (warns and draws nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "warning: --plot needs matplotlib (pip install 'kvatlas[plot]'); no chart",
            file=sys.stderr,
        )
        return
    height = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(labels) * max(1, len(series) // 2)))
    ys = list(range(len(labels)))
    for k, (name, values) in enumerate(series.items()):
        shift = (k - (len(series) - 1) / 2) * height
        ax.barh([y + shift for y in ys], values, height, label=name)
    ax.set_yticks(ys, list(labels))
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
