"""In-process consume, this tree against a base tree's versions of the consume path, in one
process: the base's blend-index state (``blend/state.py``), write kernel
(``blend/kernels/writes.py``), index columns (``blend/op_columns.py``), bulk store
(``fresh_chunks.py``) and ``EntryColumns`` builder (``events/columns.py``) are loaded from
``--base`` (a worktree of the base commit) and swapped in and out run by run, alternating
which goes first. On a shared, busy machine the wall time
of one run moves 2x between runs of one tree; pairs of runs made seconds apart in one process
see the same load, so the paired difference of thread CPU per entry is what to quote
(docs/performance.md, "Directory: design figures"). The rest of the
package is this tree's: compare only trees whose other modules agree.

    PYTHONPATH=$PWD python scripts/bench_consume_ab.py --base ../wt-base --entries 100000 --repeats 12
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import kvatlas.directory.blend.index as index_module
import kvatlas.directory.blend.state as state_module
import kvatlas.directory.chunk_stores as stores_module
import kvatlas.events.columns as columns_module
from kvatlas.bench.directory_workload import CHUNK, workload
from kvatlas.directory import KeyDirectory, warm_up_kernels
from kvatlas.directory.blend import kernels
from kvatlas.workloads import LLAMA2, LLAMA3


def _load(base: Path, rel: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, base / "kvatlas" / rel)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _variant(state: Any, writes: Any, ops: Any, fresh: Any, columns: Any) -> dict[str, Any]:
    return {
        "state": state.IndexState,
        "kernels": (writes.apply_ops, writes.apply_ops_releasing),
        "op_columns": ops.op_columns,
        "fresh": fresh.store_fresh,
        "of_entries": columns.EntryColumns.__dict__["of_entries"],
    }


def _use(v: dict[str, Any]) -> None:
    index_module.IndexState = v["state"]  # type: ignore[attr-defined]
    kernels.apply_ops, kernels.apply_ops_releasing = v["kernels"]
    index_module.op_columns = v["op_columns"]  # type: ignore[attr-defined]
    stores_module.store_fresh = v["fresh"]  # type: ignore[attr-defined]
    columns_module.EntryColumns.of_entries = v["of_entries"]  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="a worktree of the base commit")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=12, help="runs of each (alternating)")
    parser.add_argument("--vocab", choices=("llama3", "llama2"), default="llama3")
    parser.add_argument("--blend-off", action="store_true")
    args = parser.parse_args()
    import kvatlas.directory.blend.kernels.writes as writes_module
    import kvatlas.directory.blend.op_columns as ops_module
    import kvatlas.directory.fresh_chunks as fresh_module

    base = _variant(
        _load(args.base, "directory/blend/state.py", "base_state"),
        _load(args.base, "directory/blend/kernels/writes.py", "base_writes"),
        _load(args.base, "directory/blend/op_columns.py", "base_op_columns"),
        _load(args.base, "directory/fresh_chunks.py", "base_fresh"),
        _load(args.base, "events/columns.py", "base_columns"),
    )
    ours = _variant(state_module, writes_module, ops_module, fresh_module, columns_module)
    warm_up_kernels()  # (both trees' kernels: each registers its twins)
    n = args.entries
    batches = workload(n, 7, vocab=LLAMA2 if args.vocab == "llama2" else LLAMA3)
    runs: dict[str, list[float]] = {"base": [], "this tree": []}
    for r in range(args.repeats):
        order = [("base", base), ("this tree", ours)]
        for label, variant in order if r % 2 == 0 else order[::-1]:
            _use(variant)
            gc.collect()
            d = KeyDirectory(CHUNK, enable_blend_lookup=not args.blend_off)
            start = time.thread_time_ns()
            for b in batches:
                d.consume(b)
            runs[label].append((time.thread_time_ns() - start) / n / 1e3)
            del d
    for label, v in runs.items():
        print(f"{label}: thread CPU {statistics.median(v):.3f} µs/entry (median), min {min(v):.3f}")
    paired = [a - b for a, b in zip(runs["this tree"], runs["base"], strict=True)]
    print(f"paired difference (this tree - base): median {statistics.median(paired):+.3f} µs/entry")


if __name__ == "__main__":
    main()
