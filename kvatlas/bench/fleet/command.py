"""``kvatlas bench fleet``: every stack on the same trace, seed, fleet and cold start.

Prints one row per stack, the ceiling, and the spec's targets for the stacks present (met or
missed, with the numbers); ``--json`` writes the spec's shape, ``--plot`` TTFT CDFs and hit
ratios; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Final

from rich.console import Console
from rich.table import Table

from kvatlas.bench.common import REFUSED, progress, refuse
from kvatlas.bench.fleet.ceiling import ceiling_hit_ratio
from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.results import FleetReport, RequestRecord, StackResult, summarize
from kvatlas.bench.fleet.stacks import DEFAULT_POLICIES, Stack, parse_stacks
from kvatlas.errors import InvalidInput
from kvatlas.workloads import TraceRequest, open_workload
from kvatlas.workloads.rag import PREFIX as RAG_PREFIX

MODES: Final = ("virtual", "live")
_SIZES: Final = (
    "block_size", "gpu_blocks", "host_blocks", "chunk_size", "l2_chunks",
    "max_num_batched_tokens", "max_num_seqs", "recompute_share", "load_scale", "speed",
)  # fmt: skip
RunStack = Callable[[FleetConfig, Stack, Sequence[TraceRequest], Callable[[str], None]],
                    list[RequestRecord]]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True,
                        help="a Mooncake-format trace (JSONL) or a rag:... generator spec")  # fmt: skip
    parser.add_argument("--engines", type=int, default=8, help="engines in the fleet")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="stacks to compare, comma-separated (docs/fleet-value.md)")  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="virtual",
                        help="virtual: one-process simulation; live: real processes on loopback")  # fmt: skip
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--requests", type=int, default=None, help="the first N requests")
    count.add_argument("--minutes", type=float, default=None,
                       help="the requests arriving in the trace's first M minutes")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="policies' random choices")
    parser.add_argument("--jobs", type=int, default=None,
                        help="virtual: stacks simulated side by side, one process each (default: "
                             "the cores); live runs one stack at a time")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw TTFT CDFs and hit ratios per stack into this PNG")  # fmt: skip
    defaults = {f.name: f.default for f in fields(FleetConfig)}
    helps = {
        "block_size": "tokens per engine KV block (vLLM's --block-size)",
        "gpu_blocks": "GPU KV blocks per engine",
        "host_blocks": "host-memory KV blocks per engine (vLLM CPU offload, or the node's L1)",
        "chunk_size": "tokens per directory chunk (coordinator and nodes)",
        "l2_chunks": "the connector stacks' shared L2 pool in chunks (0: unbounded)",
        "max_num_batched_tokens": "token budget of one engine step",
        "max_num_seqs": "requests running at once per engine",
        "recompute_share": "share of a reused fragment's tokens recomputed (CacheBlend)",
        "load_scale": "arrivals compressed by this factor (2: twice the request rate)",
        "speed": "live: model seconds per wall second",
    }
    for name in _SIZES:
        default = defaults[name]
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=f"{helps[name]} (default {default})")  # fmt: skip


def config_of(args: argparse.Namespace) -> FleetConfig:
    if args.engines < 1:
        raise InvalidInput("--engines must be at least 1")
    if args.requests is not None and args.requests < 1:
        raise InvalidInput("--requests must be at least 1")
    if args.minutes is not None and not args.minutes > 0:
        raise InvalidInput("--minutes must be positive")
    for name in ("block_size", "gpu_blocks", "chunk_size", "max_num_batched_tokens",
                 "max_num_seqs"):  # fmt: skip
        if getattr(args, name) < 1:  # 0 steps nothing (the run never ended) or divides by 0
            raise InvalidInput(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("host_blocks", "l2_chunks"):
        if getattr(args, name) < 0:
            raise InvalidInput(f"--{name.replace('_', '-')} must be at least 0")
    if args.chunk_size % args.block_size:
        raise InvalidInput("--chunk-size must be a multiple of --block-size")
    for name in ("load_scale", "speed"):
        if not 0 < getattr(args, name) < math.inf:  # NaN too
            raise InvalidInput(f"--{name.replace('_', '-')} must be a finite number > 0")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.is_dir():  # found before the run, not after
            raise InvalidInput(f"{flag} {path}: {path.parent} is not a directory")
    if not 0.0 <= args.recompute_share <= 1.0:
        raise InvalidInput("--recompute-share must be in [0, 1]")
    sizes = {name: getattr(args, name) for name in _SIZES}
    return FleetConfig(args.trace, tuple(parse_stacks(args.policies)), args.engines,
                       args.requests, args.minutes, seed=args.seed, **sizes)  # fmt: skip


def workload(config: FleetConfig) -> list[TraceRequest]:
    requests = list(open_workload(config.trace, config.requests))
    if config.minutes is not None:
        requests = [r for r in requests if r.arrival_s < config.minutes * 60.0]
    if not requests:
        raise InvalidInput(f"{config.trace!r} gives no request to replay")
    return requests


def _runner(mode: str) -> RunStack:
    """``virtual.run_stack`` or ``live.run_stack`` (imported when chosen: each is heavy)."""
    run_stack: RunStack = importlib.import_module(f"kvatlas.bench.fleet.{mode}").run_stack
    return run_stack


def run(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        progress("fleet", text)

    try:
        config = config_of(args)
        requests = workload(config)
    except InvalidInput as exc:
        return refuse("fleet", str(exc))
    say(f"{len(requests)} requests of {config.trace}, {config.engines} engines, {args.mode}")
    ceiling = ceiling_hit_ratio(requests, config.block_size, config.chunk_size,
                                any(s.connector for s in config.stacks), config.recompute_share)  # fmt: skip
    say(f"ceiling hit ratio {ceiling:.1%}")
    results: dict[str, StackResult] = {}
    records: dict[str, list[RequestRecord]] = {}
    expected = sorted(r.index for r in requests)
    jobs = 1 if args.mode == "live" else max(1, args.jobs or os.cpu_count() or 1)
    for stack, got in _served(config, requests, args.mode, jobs):
        if sorted(r.index for r in got) != expected:
            print(f"kvatlas bench fleet: {stack.name} did not serve every request once",
                  file=sys.stderr)  # fmt: skip
            return REFUSED
        records[stack.name], results[stack.name] = got, summarize(got)
        say(f"{stack.name}: done, hit ratio {results[stack.name].hit_ratio:.1%}, "
            f"p50 TTFT {results[stack.name].ttft_p50_s:.3f} s")  # fmt: skip
    report = FleetReport(config.trace, config.engines, args.mode, len(requests), ceiling, results)
    _print(report)
    for line in target_lines(report, config.trace.startswith(RAG_PREFIX)):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.plot is not None:
        from kvatlas.bench.fleet.plot import plot_fleet

        plot_fleet(report, records, args.plot)
    return 0


def _served(config: FleetConfig, requests: list[TraceRequest], mode: str, jobs: int
            ) -> Iterator[tuple[Stack, list[RequestRecord]]]:  # fmt: skip
    """Each stack's records, in ``config.stacks`` order: one after the other, or (virtual,
    ``jobs`` > 1) in worker processes that each rebuild the workload (no prompt is pickled;
    every stack still sees the same requests, cold)."""
    if jobs == 1 or len(config.stacks) == 1:
        run_stack = _runner(mode)
        for stack in config.stacks:
            _say_for(stack.name, "start")
            yield stack, run_stack(config, stack, requests, functools.partial(_say_for, stack.name))
        return
    with ProcessPoolExecutor(min(jobs, len(config.stacks))) as pool:
        futures = [pool.submit(_run_in_worker, config, stack, mode) for stack in config.stacks]
        for stack, future in zip(config.stacks, futures, strict=True):
            yield stack, future.result()


def _run_in_worker(config: FleetConfig, stack: Stack, mode: str) -> list[RequestRecord]:
    _say_for(stack.name, "start")
    return _runner(mode)(config, stack, workload(config), functools.partial(_say_for, stack.name))


def _say_for(stack: str, text: str) -> None:
    progress("fleet", f"{stack}: {text}")


def _print(report: FleetReport) -> None:
    table = Table(title=f"fleet: {report.trace} · {report.engines} engines · {report.mode} · "
                        f"{report.requests} requests · ceiling {report.ceiling_hit_ratio:.1%}")  # fmt: skip
    for column in ("stack", "TTFT p50", "p90", "p99", "hit ratio", "of ceiling",
                   "prefill tokens", "fragment tokens", "tokens/s"):  # fmt: skip
        table.add_column(column, justify="right" if column != "stack" else "left")
    for name, r in report.stacks.items():
        share = r.hit_ratio / report.ceiling_hit_ratio if report.ceiling_hit_ratio else 0.0
        table.add_row(name, f"{r.ttft_p50_s:.3f} s", f"{r.ttft_p90_s:.3f} s",
                      f"{r.ttft_p99_s:.3f} s", f"{r.hit_ratio:.1%}", f"{share:.0%}",
                      f"{r.prefill_tokens:,}", f"{r.fragment_tokens:,}",
                      f"{r.throughput_tokens_s:,.0f}")  # fmt: skip
    Console(width=max(Console().width, 140)).print(table)


def target_lines(report: FleetReport, rag: bool) -> list[str]:
    """The spec's targets for the stacks present: met or missed, with the numbers."""
    s = report.stacks
    out: list[str] = []

    def verdict(label: str, met: bool, detail: str) -> None:
        out.append(f"target {'met' if met else 'MISSED'}: {label}: {detail}")

    ours, base = s.get("kvatlas"), s.get("prefix")
    if ours is not None and base is not None:
        speedup = base.ttft_p50_s / ours.ttft_p50_s if ours.ttft_p50_s > 0 else float("inf")
        need = 2.0 if rag else 1.3
        verdict(f"kvatlas p50 TTFT ≥ {need}× lower than prefix", speedup >= need,
                f"{speedup:.2f}× ({ours.ttft_p50_s:.3f} s vs {base.ttft_p50_s:.3f} s)")  # fmt: skip
        if rag:
            gain = ours.hit_ratio / base.hit_ratio if base.hit_ratio > 0 else float("inf")
            verdict("kvatlas hit ratio ≥ 1.3× prefix's", gain >= 1.3,
                    f"{gain:.2f}× ({ours.hit_ratio:.1%} vs {base.hit_ratio:.1%})")  # fmt: skip
        else:
            verdict("kvatlas p99 TTFT no higher than prefix", ours.ttft_p99_s <= base.ttft_p99_s,
                    f"{ours.ttft_p99_s:.3f} s vs {base.ttft_p99_s:.3f} s")  # fmt: skip
    if ours is not None and not rag and report.ceiling_hit_ratio > 0:
        share = ours.hit_ratio / report.ceiling_hit_ratio
        verdict("kvatlas hit ratio ≥ 90% of the ceiling", share >= 0.9,
                f"{share:.0%} ({ours.hit_ratio:.1%} of {report.ceiling_hit_ratio:.1%})")  # fmt: skip
    rr = s.get("round-robin")
    if rr is not None and not rag:
        for name in ("kvatlas", "prefix"):
            r = s.get(name)
            if r is not None and r.ttft_p50_s > 0:
                ratio = rr.ttft_p50_s / r.ttft_p50_s
                verdict(f"{name} p50 TTFT ≤ ⅓ of round-robin's (where round-robin queues)",
                        ratio >= 3.0, f"{ratio:.2f}× lower")  # fmt: skip
    return out
