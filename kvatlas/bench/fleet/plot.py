"""``--plot``: each stack's TTFT CDF (log time) and its hit ratio against the ceiling."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from kvatlas.bench.fleet.results import FleetReport, RequestRecord


def plot_fleet(report: FleetReport, records: Mapping[str, Sequence[RequestRecord]],
               path: Path) -> None:  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: --plot needs matplotlib (pip install 'kvatlas[plot]'); no chart",
              file=sys.stderr)  # fmt: skip
        return
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(13, 5))
    for name, got in records.items():
        ttft = np.sort([r.ttft_s for r in got])
        cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("time to first token (s, model time, log scale)")
    cdf.set_ylabel("share of requests")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    names = list(report.stacks)
    bars.barh(names, [report.stacks[n].hit_ratio for n in names])
    bars.axvline(report.ceiling_hit_ratio, color="black", linestyle="--", label="ceiling")
    bars.set_xlabel("hit ratio (prompt tokens not recomputed)")
    bars.invert_yaxis()
    bars.legend()
    fig.suptitle(f"{report.trace} · {report.engines} engines · {report.mode} · "
                 f"{report.requests} requests")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
