"""Rows measured on two services in one run (kvatlas and a reference product), with the factor
by which kvatlas is ahead: a table of its own beside the benchmark's, and a ``comparison``
entry in its JSON.

A factor reads the same way on every row, whatever the unit: above 1 kvatlas is ahead (less
CPU, memory or latency; more requests or entries a second). Each row says how many operations
each side did, since the reference may be measured with fewer (per-operation figures are what
compare).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvatlas.bench.common import format_seconds


@dataclass(frozen=True)
class Comparison:
    """One figure of kvatlas and of the reference. ``unit``: ``"s"`` (a time, shown as µs/ms),
    or the unit shown after the number (``"B"``, ``"req/s"``)."""

    case: str
    unit: str
    kvatlas: float
    reference: float
    lower_is_better: bool
    target: str = ""
    met: bool | None = None
    notes: str = ""

    @property
    def factor(self) -> float | None:
        """How many times kvatlas is ahead (``None`` when a side measured nothing)."""
        if self.kvatlas <= 0 or self.reference <= 0:
            return None
        if self.lower_is_better:
            return self.reference / self.kvatlas
        return self.kvatlas / self.reference


def shown(value: float, unit: str) -> str:
    if unit == "s":
        return format_seconds(value)
    return f"{value:,.0f} {unit}"


def print_comparison(title: str, reference: str, rows: Sequence[Comparison]) -> None:
    table = Table(title=title)
    for column in (
        "case",
        "kvatlas",
        reference,
        "kvatlas ahead by",
        "target (quality.md)",
        "ops, notes",
    ):
        table.add_column(column)
    for row in rows:
        factor = row.factor
        mark = "" if row.met is None else (" ✔" if row.met else " ✘")
        table.add_row(
            row.case,
            shown(row.kvatlas, row.unit),
            shown(row.reference, row.unit),
            f"{factor:.1f}×" if factor is not None else "-",
            f"{row.target}{mark}" if row.target else "-",
            row.notes,
        )
    Console(width=max(Console().width, 150)).print(table)
    judged = [r for r in rows if r.met is not None]
    print(f"targets against {reference} met: {sum(bool(r.met) for r in judged)}/{len(judged)}")


def add_to_json(path: Path, reference: str, rows: Sequence[Comparison]) -> None:
    """Add the rows to the benchmark's JSON file (written before) as ``comparison``."""
    payload = json.loads(path.read_text())
    payload["comparison"] = {
        "reference": reference,
        "rows": [asdict(r) | {"factor": r.factor} for r in rows],
    }
    path.write_text(json.dumps(payload, indent=2))
