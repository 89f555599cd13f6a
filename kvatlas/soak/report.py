"""The soak's verdicts: each figure with its target and ✔/✘, as a table and in the JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kvatlas.soak.faults import KINDS

STREAM_NODE_ENTRIES = 100  # Redis's stream-node-max-entries: what MAXLEN ~ may leave over
FLAT = 1.10  # "flat": the last quarter's median within 10% of the third quarter's
LONG_RUN_S = 300.0  # memory flatness is judged from this run length on


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    target: str = ""
    met: bool | None = None  # None: reported, not judged
    notes: str = ""


def _fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f} MiB"


def checks(result: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    settings, work, final = result["settings"], result["workload"], result["final"]
    kinds = Counter(f["kind"] for f in result["faults"])
    out.append(Check(
        "faults injected", str(sum(kinds.values())), "every kind",
        all(kinds[k] for k in KINDS), ", ".join(f"{k}={kinds[k]}" for k in KINDS),
    ))  # fmt: skip
    out.append(Check("events (stream entries added)", str(result["events"])))
    out.append(Check(
        "workload operations", str(sum(work["ops"].values())),
        notes=", ".join(f"{k}={v}" for k, v in sorted(work["ops"].items()))
        + f"; failed: {sum(work['failed'].values())} (calls to a node while it died)",
    ))  # fmt: skip
    checked = work["chunks_checked"]
    out.append(Check(
        "wrong KV served", str(work["wrong_kv"]), "0", work["wrong_kv"] == 0,
        f"chunks checked: prefix={checked.get('prefix', 0)}, blend={checked.get('blend', 0)}; "
        f"max |error| {work['max_error']:.1e}",
    ))  # fmt: skip
    times = [f["converged_s"] for f in result["faults"]]
    target = settings["convergence_target_s"]
    worst = None if None in times or not times else max(times)
    seen = [f.get("confirmed_s") for f in result["faults"]]
    confirmed = None if None in seen or not seen else max(seen)
    per_kind = {
        k: max(
            (f["converged_s"] for f in result["faults"] if f["kind"] == k), key=lambda v: v or 1e9
        )
        for k in kinds
    }
    out.append(Check(
        "max time to converge after a fault", _fmt_s(worst), f"≤ {target:g} s",
        worst is not None and worst <= target,
        ", ".join(f"{k} {_fmt_s(v)}" for k, v in per_kind.items())
        + f"; the harness's comparisons confirmed each within {_fmt_s(confirmed)}",
    ))  # fmt: skip
    for rid, diff in final["replicas"].items():
        note = diff["error"] or "; ".join(diff["ghost_examples"][:2] + diff["missing_examples"][:2])
        out.append(Check(f"{rid}: ghost placements at the end", str(diff["ghosts"]), "0",
                         diff["ghosts"] == 0 and not diff["error"], note))  # fmt: skip
        out.append(Check(f"{rid}: missing placements at the end", str(diff["missing"]), "0",
                         diff["missing"] == 0 and not diff["error"]))  # fmt: skip
    out.append(Check("quiet period: replicas agree after", _fmt_s(final["settled_s"])))
    out.append(Check("node L2 listing vs its disk (keys differing)",
                     str(final["l2_index_drift"]), "0", final["l2_index_drift"] == 0))  # fmt: skip
    r = result["redis"]
    cap = r["stream_max_len"]
    longest = r["stream_len_max"]
    out.append(Check(
        "Redis stream length (max sampled)", str(longest),
        f"≤ {cap} + {STREAM_NODE_ENTRIES}", longest is not None and longest <= cap + STREAM_NODE_ENTRIES,
        f"at the end: {r['stream_len_end']}; MAXLEN ~ trims whole nodes of {STREAM_NODE_ENTRIES}",
    ))  # fmt: skip
    third, last = r["used_memory_third_quarter_median"], r["used_memory_last_quarter_median"]
    judged = result["seconds"] >= LONG_RUN_S and third is not None and last is not None
    out.append(Check(
        "Redis used_memory, first → last half (medians)",
        f"{_mib(r['used_memory_first_half_median'])} → {_mib(r['used_memory_last_half_median'])}",
        f"last half flat (±{FLAT - 1:.0%})" if judged else "",
        (last <= FLAT * third) if judged else None,
        f"third → last quarter {_mib(third)} → {_mib(last)}"
        + ("" if judged else f"; judged from {LONG_RUN_S:g} s runs on"),
    ))  # fmt: skip
    for node, d in result["disk"].items():
        out.append(Check(
            f"{node}: L2 disk (max sampled)", _mib(d["max_bytes"]), f"≤ {_mib(d['cap_bytes'])}",
            d["max_bytes"] <= d["cap_bytes"],
            f"medians first → last half {_mib(d['first_half_median'])} → {_mib(d['last_half_median'])}",
        ))  # fmt: skip
    return out


def show(result: dict[str, Any], found: list[Check], console: Console | None = None) -> None:
    table = Table(title=f"kvatlas soak: {result['seconds']:g} s, seed {result['seed']}")
    for column in ("check", "value", "target", "notes"):
        table.add_column(column)
    for c in found:
        verdict = (
            "-"
            if not c.target
            else f"{c.target} {'✔' if c.met else '✘'}"
            if c.met is not None
            else c.target
        )
        table.add_row(c.name, c.value, verdict, c.notes)
    (console or Console(width=max(Console().width, 150))).print(table)
    judged = [c for c in found if c.met is not None]
    print(f"targets met: {sum(bool(c.met) for c in judged)}/{len(judged)}")


def with_verdicts(result: dict[str, Any], found: list[Check]) -> dict[str, Any]:
    return {
        **result,
        "checks": [asdict(c) for c in found],
        "ok": all(c.met for c in found if c.met is not None),
    }
