"""The coordinator end to end over HTTP: event ingestion (JSON vs msgpack, and a naive
reference service) and blend-lookup throughput/latency with concurrent clients (``wrk`` when
installed), each with the server process's CPU time per operation; and, when LMCache is
installed, the same JSON bodies and lookups against LMCache's own coordinator in the same run
(``service_lmcache``), the reference of quality.md's HTTP rows.

Token ids come from Llama 3's vocabulary (they do not fit 16 bits); JSON ingestion and the
lookups are measured again with Llama 2's (they do) as second rows, labelled as such."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from rich.progress import Progress

from kvatlas.asgi_thread import free_port
from kvatlas.bench.common import BenchRow, add_common_arguments, refuse, report
from kvatlas.bench.comparison import add_to_json, print_comparison
from kvatlas.bench.ingest_bodies import CHUNK, bodies_of, post_all, store_batches
from kvatlas.bench.lmcache_reference import find_lmcache
from kvatlas.bench.server_cpu import LoadResult, warn_no_wrk, wrk_path
from kvatlas.bench.service_lmcache import (
    LMCacheIngestRounds,
    LMCacheLookupRounds,
    against_lmcache,
    lmcache_entries,
)
from kvatlas.bench.service_runs import (
    SETTLE_S,
    IngestFigures,
    IngestRun,
    LookupFigures,
    LookupWorkload,
    lookup_workload,
    matches_of,
    run_lookups,
    second_half_entries,
    timed_streams,
)
from kvatlas.errors import InvalidInput
from kvatlas.events import encode_json, encode_msgpack
from kvatlas.processes import spawn_service, stop
from kvatlas.workloads import LLAMA2, LLAMA3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, repeats=3)
    parser.add_argument(
        "--entries", type=int, default=100_000, help="store entries to ingest per run"
    )
    parser.add_argument("--batch-entries", type=int, default=256, help="entries per batch")
    parser.add_argument("--batches-per-post", type=int, default=4, help="batches per POST body")
    parser.add_argument(
        "--emitters", type=int, default=1, help="concurrent emitters (one connection each)"
    )
    parser.add_argument(
        "--index-chunks", type=int, default=20_000, help="chunks indexed for lookups"
    )
    parser.add_argument(
        "--query-tokens", type=int, default=32_768, help="tokens per blend-lookup query"
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent blend-lookup clients")
    parser.add_argument(
        "--lookup-seconds", type=float, default=5.0, help="duration of the lookup load"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument(
        "--only", choices=("ingest", "lookup"), default=None, help="run one part only"
    )
    parser.add_argument(
        "--load-generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="lookups: wrk when installed (auto), or the Python one",
    )
    parser.add_argument(
        "--lmcache",
        default="auto",
        metavar="auto|off|PATH",
        help="measure LMCache's coordinator in the same run: from ./.venv-lmcache when there "
        "(auto; `make lmcache` installs it), not at all (off), or from the virtual "
        "environment (or its bin directory) at PATH",
    )
    parser.add_argument(
        "--lmcache-entries",
        type=int,
        default=None,
        help="JSON entries LMCache ingests, the first of ours (default: all of --entries, one "
        "run after each round of ours: it takes ≈0.1–0.2 ms of CPU an entry)",
    )


COORDINATOR = [
    "-m",
    "kvatlas.cli",
    "coordinator",
    "--enable-blend-lookup",
    "--chunk-size",
    str(CHUNK),  # LMCache's coordinator is started with the same
    "--log-level",
    "warning",
]


@contextmanager
def service_process(args: list[str]) -> Iterator[tuple[str, int]]:
    """A service process on a free port: its URL and pid (for its CPU time)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    port_args = ["--port", str(port)] if args[:3] == COORDINATOR[:3] else [str(port)]
    proc = spawn_service([*args, *port_args], url)
    try:
        yield url, proc.pid
    finally:
        stop([proc])


RUNS = ("json", "msgpack", "naive", "json-compact")
_VOCAB = {"json": LLAMA3, "msgpack": LLAMA3, "naive": LLAMA3, "json-compact": LLAMA2}
_FORMAT = {"json": "json", "msgpack": "msgpack", "naive": "json", "json-compact": "json"}
_CONTENT_TYPE = {"json": "application/json", "msgpack": "application/msgpack"}


@dataclass(frozen=True)
class IngestWorkload:
    """Each run's bodies, one list per emitter, encoded before any server starts; the warm-up
    body of each format; entries per emitter and per body."""

    streams: dict[str, list[list[bytes]]]
    warmups: dict[str, bytes]
    per_emitter: int
    per_body: int


def _ingest_workload(args: argparse.Namespace, rng: np.random.Generator) -> IngestWorkload:
    per_emitter = args.entries // args.emitters
    emitters = {
        v: [
            store_batches(rng, per_emitter, args.batch_entries, f"node-{e}", v)[0]
            for e in range(args.emitters)
        ]
        for v in (LLAMA3, LLAMA2)
    }
    encoders = {"json": encode_json, "msgpack": encode_msgpack}
    streams = {
        run: [
            bodies_of(b, args.batches_per_post, encoders[_FORMAT[run]])
            for b in emitters[_VOCAB[run]]
        ]
        for run in RUNS
    }
    warm, _ = store_batches(rng, 64, 64, "warm-up")
    warmups = {"json": encode_json(warm), "msgpack": encode_msgpack(warm)}
    return IngestWorkload(streams, warmups, per_emitter, args.batch_entries * args.batches_per_post)


def _bench_ingest(
    args: argparse.Namespace,
    workload: IngestWorkload,
    progress: Progress,
    after_round: Callable[[], None] | None = None,
) -> tuple[list[BenchRow], IngestFigures]:
    """JSON, msgpack and the naive service with Llama 3's vocabulary, then JSON again with
    Llama 2's (ids that fit 16 bits: the second row), each run on a fresh coordinator, a round
    of the four ``--repeats`` times, ``after_round`` called after each (LMCache's run of the
    round); and the figures of the JSON run with Llama 3's (what LMCache is compared with)."""
    task = progress.add_task("ingestion over HTTP", total=args.repeats * 4)
    service = {run: COORDINATOR for run in RUNS} | {"naive": ["-m", "kvatlas.bench.naive_service"]}
    runs: dict[str, list[IngestRun]] = {run: [] for run in RUNS}
    for _ in range(args.repeats):
        for run in RUNS:
            fmt = _FORMAT[run]
            with service_process(service[run]) as (url, pid):
                settle = SETTLE_S if fmt == "json" and run != "naive" else 0.0
                runs[run].append(
                    timed_streams(
                        url, pid, workload.streams[run], _CONTENT_TYPE[fmt], workload.warmups[fmt],
                        settle,
                    )
                )  # fmt: skip
            progress.advance(task)
        if after_round is not None:
            after_round()
    total = workload.per_emitter * args.emitters
    figures = {
        run: IngestFigures(
            total,
            tuple(runs[run]),
            second_half_entries(workload.streams[run], workload.per_emitter, workload.per_body),
        )
        for run in RUNS
    }
    naive = figures["naive"]
    naive_faults = statistics.median(r.minor_faults for r in naive.runs) / total
    rows = []
    for run in ("json", "msgpack", "json-compact"):
        fig, fmt, vocab = figures[run], _FORMAT[run], _VOCAB[run]
        ours = statistics.median(r.wall_s for r in fig.runs)
        cpu, rate = fig.cpu_per_entry_s, fig.entries_per_s
        kinder = run == "json-compact"
        headline = args.emitters == 1 and not kinder
        case = (
            f"ingest {total} token-bearing entries, {fmt}, {args.emitters} emitter(s), "
            f"{vocab.label}"
        )
        rows.append(
            BenchRow(
                f"{case}: wall",
                ours,
                None if kinder else total / naive.entries_per_s,
                "≥ 100k entries/s" if headline else "",
                {"entries/s": f"{rate:,.0f}"}
                | ({} if kinder else {"naive entries/s": f"{naive.entries_per_s:,.0f}"}),
                met=rate >= 100_000 if headline else None,
            )
        )
        judged = run == "json"
        rows.append(
            BenchRow(
                f"{case}: server CPU per entry",
                cpu,
                None if kinder else naive.cpu_per_entry_s,
                "≤ 7 µs" if judged else "",
                {
                    "server CPU s": f"{statistics.median(r.cpu_s for r in fig.runs):.2f}",
                    "minflt/entry": f"{statistics.median(r.minor_faults for r in fig.runs) / total:.3f}",
                }
                | ({} if kinder else {"naive minflt/entry": f"{naive_faults:.3f}"}),
                met=cpu <= 7e-6 if judged else None,
            )
        )
        if fmt == "json":
            per_chunk = fig.rss_per_chunk
            rows.append(
                BenchRow(
                    f"{case}: server RSS growth per chunk",
                    None,
                    target="" if kinder else "≤ 0.9 KB/chunk",
                    met=None if kinder else per_chunk <= 900,
                    shown=f"{per_chunk:,.0f} B/chunk",
                    extra={
                        "spread": _spread([r.rss_growth / total for r in fig.runs], 1, "B"),
                        f"after {SETTLE_S:g} s idle": f"{fig.rss_idle_per_chunk:,.0f} B",
                    }
                    | _second_half(fig)
                    | ({} if kinder else {"naive": f"{naive.rss_per_chunk:,.0f} B"}),
                )
            )
    return rows, figures["json"]


def _second_half(fig: IngestFigures) -> dict[str, str]:
    """The RSS row's note of the growth a chunk over the streams' second halves, if known."""
    grown = fig.rss_second_half_per_chunk
    return {} if grown is None else {"second half": f"{grown:,.0f} B"}


def _bench_lookup(
    args: argparse.Namespace,
    rng: np.random.Generator,
    progress: Progress,
    use_wrk: bool,
    lmcache: Callable[[LookupWorkload], LMCacheLookupRounds] | None = None,
) -> tuple[list[BenchRow], LookupFigures, LMCacheLookupRounds | None]:
    """``--repeats`` load runs of ``--lookup-seconds``, each against a fresh coordinator; each
    row is the median run, with the spread (min–max) in its notes: one run moves with the
    machine's load by ±10% and more. Llama 3's vocabulary, then the server CPU row again with
    Llama 2's. Also the Llama 3 figures (what LMCache is compared with) and, given
    ``lmcache`` (its rounds of a workload), LMCache's runs, one after each of those."""
    task = progress.add_task("blend lookups over HTTP", total=2 * (1 + args.repeats))
    workload = lookup_workload(rng, args.index_chunks, args.query_tokens, LLAMA3)
    theirs = None if lmcache is None else lmcache(workload)
    main = kvatlas_lookups(
        args, workload, use_wrk, lambda: progress.advance(task), theirs or (lambda: None)
    )
    compact_workload = lookup_workload(rng, args.index_chunks, args.query_tokens, LLAMA2)
    compact = kvatlas_lookups(args, compact_workload, use_wrk, lambda: progress.advance(task))
    cpu = [r.per_request_cpu_s for r in main.runs]
    rates = [r.requests / r.seconds for r in main.runs]
    p99s = [r.p99_s for r in main.runs]
    rate = main.requests_per_s
    case = f"blend-lookup {args.query_tokens} tok, {args.clients} conns, {args.index_chunks} chunks"
    runs = {"runs": len(main.runs), "load generator": main.generator}
    compact_cpu = [r.per_request_cpu_s for r in compact.runs]
    rows = [
        BenchRow(
            f"{case}, {LLAMA3.label}: server CPU per lookup",
            main.cpu_per_lookup_s,
            target="≤ 0.4 ms",
            met=main.cpu_per_lookup_s <= 0.4e-3,
            extra={"spread": _spread(cpu, 1e6, "µs"), **runs},
        ),
        BenchRow(
            f"{case}, {LLAMA3.label}: requests/s",
            None,
            target="≥ 2,000 req/s",
            met=rate >= 2000,
            shown=f"{rate:,.0f} req/s",
            extra={"spread": _spread(rates, 1, "req/s"), "requests": main.requests},
        ),
        BenchRow(f"{case}, {LLAMA3.label}: p50 latency", main.p50_s),
        BenchRow(
            f"{case}, {LLAMA3.label}: p99 latency",
            main.p99_s,
            target="≤ 5 ms",
            met=main.p99_s <= 5e-3,
            extra={"spread": _spread(p99s, 1e3, "ms")},
        ),
        BenchRow(
            f"{case}, {LLAMA2.label}: server CPU per lookup",
            compact.cpu_per_lookup_s,
            extra={
                "spread": _spread(compact_cpu, 1e6, "µs"),
                "requests/s": f"{compact.requests_per_s:,.0f}",
                "p99": f"{compact.p99_s * 1e3:.1f} ms",
            },
        ),
    ]
    return rows, main, theirs


def kvatlas_lookups(
    args: argparse.Namespace,
    workload: LookupWorkload,
    use_wrk: bool,
    after_each: Callable[[], object] = lambda: None,
    after_run: Callable[[], object] = lambda: None,
) -> LookupFigures:
    """``--repeats`` load runs, each against a fresh coordinator indexing ``workload``'s
    chunks (``after_run`` once it is stopped: LMCache's run of the round)."""
    results: list[LoadResult] = []
    first: list[tuple[str, int, int]] = []
    index = bodies_of(workload.index_batches, 4, encode_msgpack)  # (encoded once: every run's)
    for i in range(args.repeats):
        with service_process([*COORDINATOR, "--max-body-bytes", str(1 << 30)]) as (url, pid):
            post_all(url, index, "application/msgpack")
            if i == 0:
                after_each()
                first = matches_of(url, workload.bodies[0])
            results += run_lookups(
                url, pid, workload.bodies, clients=args.clients, seconds=args.lookup_seconds,
                repeats=1, use_wrk=use_wrk, after_each=after_each,
            )  # fmt: skip
        after_run()
    return LookupFigures(tuple(results), tuple(first))


def _spread(values: list[float], scale: float, unit: str) -> str:
    return f"{min(values) * scale:,.0f}–{max(values) * scale:,.0f} {unit}"


def check_config(args: argparse.Namespace) -> str | None:
    """Why a configuration makes a row meaningless, or ``None``."""
    if args.entries < args.batch_entries * args.emitters:
        return "--entries must give every emitter at least one batch of --batch-entries"
    if args.query_tokens < 2 * CHUNK:
        return f"--query-tokens below {2 * CHUNK} hold no chunk at a random offset"
    if args.clients < 1 or args.lookup_seconds < 1:
        return "--clients must be >= 1 and --lookup-seconds >= 1 (wrk counts whole seconds)"
    if args.load_generator == "wrk" and wrk_path() is None:
        return "--load-generator wrk: wrk is not installed (make bench installs it)"
    if args.lmcache_entries is not None and args.lmcache_entries < 1:
        return "--lmcache-entries must be >= 1"
    return None


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.entries, args.index_chunks, args.lookup_seconds = 10_000, 10_000, 2.0
    reason = check_config(args)
    if reason is not None:
        return refuse("service", reason)
    try:
        lmcache = find_lmcache(args.lmcache)
    except InvalidInput as e:
        return refuse("service", e.detail)
    use_wrk = args.load_generator == "wrk" or (
        args.load_generator == "auto" and wrk_path() is not None
    )
    if args.only != "ingest" and args.load_generator == "auto" and not use_wrk:
        warn_no_wrk()
    rng = np.random.default_rng(args.seed)
    meta: dict[str, Any] = vars(args).copy()
    meta.pop("json", None)
    meta.pop("plot", None)
    meta["lmcache_measured"] = lmcache.label if lmcache is not None else None
    rows: list[BenchRow] = []
    ours_ingest: IngestFigures | None = None
    lookup: tuple[LookupFigures, LMCacheLookupRounds] | None = None
    rounds: LMCacheIngestRounds | None = None
    with Progress(transient=True) as progress:
        if args.only in (None, "ingest"):
            workload = _ingest_workload(args, rng)
            if lmcache is not None:
                streams, entries = lmcache_entries(
                    workload.streams["json"], workload.per_emitter, workload.per_body,
                    args.lmcache_entries,
                )  # fmt: skip
                rounds = LMCacheIngestRounds(
                    lmcache, streams, entries, workload.warmups["json"], workload.per_body, progress
                )
            ingest_rows, ours_ingest = _bench_ingest(args, workload, progress, rounds)
            rows += ingest_rows
        if args.only in (None, "lookup"):
            failed = None if rounds is None else rounds.failure  # (then none starts)
            theirs = None if lmcache is None else partial(
                LMCacheLookupRounds, lmcache, args, use_wrk=use_wrk, progress=progress,
                failure=failed,
            )  # fmt: skip
            lookup_rows, lookup_figures, lm_lookups = _bench_lookup(
                args, rng, progress, use_wrk, theirs
            )
            rows += lookup_rows
            lookup = None if lm_lookups is None else (lookup_figures, lm_lookups)
        compared = (
            None if lmcache is None else against_lmcache(args, lmcache, ours_ingest, rounds, lookup)
        )
    report("kvatlas bench service", rows, args, meta)
    if lmcache is None:
        return 0
    if compared is None:
        return 1  # said why on stderr: the run did not measure what it was asked to
    title = (
        f"kvatlas vs {lmcache.label} over HTTP, same run, same bodies: {args.entries:,} "
        f"entries in bodies of {args.batch_entries * args.batches_per_post}; blend lookups of "
        f"{args.query_tokens:,} tokens, {args.clients} connections, {args.index_chunks:,} "
        "chunks indexed"
    )
    print_comparison(title, lmcache.label, compared)
    if args.json is not None:
        add_to_json(args.json, lmcache.label, compared)
    return 0
