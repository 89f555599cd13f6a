"""``bench service``'s LMCache side: the same pre-encoded JSON bodies and the same blend lookups,
with the same load generator, against LMCache's own coordinator (``lmcache_reference``), and
the rows quality.md states against it (kvatlas's figure, LMCache's, the factor, the target).

LMCache spends ≈0.1–0.2 ms of CPU an ingested entry and ≈4–7 ms a 32k-token lookup. It ingests
once a round of ours (:class:`LMCacheIngestRounds`, by default the same entries as one of our
runs; ``--lmcache-entries`` takes fewer, the first of ours), right after our runs of the round,
so both sides' medians are taken over the same stretch of the machine's time (a run's figure
moves by a tenth and more from one minute to the next on a shared machine), and it serves the
same lookups for the same time, once after each of our lookup runs
(:class:`LMCacheLookupRounds`), each side's run in a fresh coordinator of its own; every row
says how many operations each side did,
per-operation figures being what compare. The answers must be the same: both sides' matches
for the first query are compared, and a difference is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from rich.progress import Progress

from kvatlas.bench.comparison import Comparison
from kvatlas.bench.ingest_bodies import CHUNK, bodies_of, post_all
from kvatlas.bench.lmcache_reference import LMCacheEnv, lmcache_coordinator
from kvatlas.bench.server_cpu import LoadResult
from kvatlas.bench.service_runs import (
    SETTLE_S,
    IngestFigures,
    IngestRun,
    LookupFigures,
    LookupWorkload,
    matches_of,
    run_lookups,
    second_half_entries,
    timed_streams,
)
from kvatlas.errors import Unavailable
from kvatlas.events import encode_json
from kvatlas.workloads import LLAMA3


def lmcache_entries(
    streams: list[list[bytes]], per_emitter: int, per_body: int, wanted: int | None
) -> tuple[list[list[bytes]], int]:
    """The first bodies of each emitter's stream holding at least ``wanted`` entries in all
    (``None``: every body), and how many entries they hold."""
    if wanted is None or wanted >= per_emitter * len(streams):
        return streams, per_emitter * len(streams)
    per_stream = -(-wanted // len(streams))
    bodies = -(-per_stream // per_body)
    return [s[:bodies] for s in streams], len(streams) * min(per_emitter, bodies * per_body)


@contextmanager
def _fresh_coordinator(
    lmcache: LMCacheEnv, name: str, progress: Progress | None, doing: str
) -> Iterator[tuple[str, int, Callable[[str], None]]]:
    """A fresh LMCache coordinator in a temporary directory of its own (its log there), on
    ``progress`` while it is up: its URL, its pid and a function saying what it does now.
    Stopped on the way out, whatever happened (``Unavailable`` when it would not start)."""
    task = None if progress is None else progress.add_task(f"{lmcache.label}: {doing}", total=None)

    def say(text: str) -> None:
        if progress is not None and task is not None:
            progress.update(task, description=f"{lmcache.label}: {text}")

    try:
        with (
            tempfile.TemporaryDirectory(prefix="kvatlas-bench-lmcache-") as tmp,
            lmcache_coordinator(lmcache, CHUNK, Path(tmp), name) as (url, pid),
        ):
            yield url, pid, say
    finally:
        if progress is not None and task is not None:
            progress.remove_task(task)


def lmcache_lookups(
    lmcache: LMCacheEnv,
    args: argparse.Namespace,
    lookup: LookupWorkload,
    use_wrk: bool,
    progress: Progress | None = None,
    repeats: int | None = None,
) -> LookupFigures:
    """``lookup`` run against a fresh LMCache coordinator, as ours runs (alone: no other
    process of either side is up): its lookup figures (``repeats`` runs, by default
    ``--repeats``, of ``--lookup-seconds``, ``--clients`` connections). ``Unavailable`` or
    ``httpx.HTTPError`` when it would not start or answer (it is stopped either way)."""
    doing = "starting its coordinator"
    with _fresh_coordinator(lmcache, "lookup", progress, doing) as (url, pid, say):
        say(f"indexing {sum(len(b.entries) for b in lookup.index_batches):,} chunks")
        post_all(url, bodies_of(lookup.index_batches, 4, encode_json), "application/json")
        first = matches_of(url, lookup.bodies[0])
        say("blend lookups")
        results = run_lookups(
            url, pid, lookup.bodies, clients=args.clients,
            seconds=args.lookup_seconds, repeats=repeats or args.repeats, use_wrk=use_wrk,
        )  # fmt: skip
        return LookupFigures(tuple(results), tuple(first))


class LMCacheLookupRounds:
    """LMCache's lookup runs, one each time it is called, each against a fresh coordinator
    indexing ``lookup``'s chunks, stopped after it: after each of our lookup runs (each in a
    fresh coordinator of ours too), so both sides' medians come from the same stretch of the
    machine's time and LMCache's from several of its processes (a process's figure moved by
    half from one run of the bench to the next). The first that fails ends them, as
    :class:`LMCacheIngestRounds`; ``failure``, if given, is an earlier one's (none starts)."""

    def __init__(
        self,
        lmcache: LMCacheEnv,
        args: argparse.Namespace,
        lookup: LookupWorkload,
        use_wrk: bool,
        progress: Progress | None = None,
        failure: str | None = None,
    ) -> None:
        self.lmcache, self.args, self.lookup = lmcache, args, lookup
        self.use_wrk, self.progress = use_wrk, progress
        self.runs: list[LoadResult] = []
        self.first_matches: tuple[tuple[str, int, int], ...] = ()
        self.failure = failure

    def __call__(self) -> None:
        if self.failure is not None:
            return
        try:
            figures = lmcache_lookups(
                self.lmcache, self.args, self.lookup, self.use_wrk, self.progress, repeats=1
            )
        except (Unavailable, httpx.HTTPError) as e:
            self.failure = str(e)
            return
        self.runs += figures.runs
        self.first_matches = self.first_matches or figures.first_matches

    def figures(self) -> LookupFigures | None:
        """The runs as the figures its rows compare (``None``: none ran)."""
        return LookupFigures(tuple(self.runs), self.first_matches) if self.runs else None


class LMCacheIngestRounds:
    """LMCache's ingest runs, one each time it is called, each into a fresh coordinator
    stopped after it: after each round of ours (``bench service`` calls it between rounds).
    The first that fails ends them: its reason is kept (:attr:`failure`) and no other
    starts."""

    def __init__(
        self,
        lmcache: LMCacheEnv,
        streams: list[list[bytes]],
        entries: int,
        warmup: bytes,
        per_body: int | None,
        progress: Progress | None = None,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.lmcache, self.streams, self.entries = lmcache, streams, entries
        self.warmup, self.per_body, self.settle_s = warmup, per_body, settle_s
        self.progress = progress
        self.runs: list[IngestRun] = []
        self.failure: str | None = None

    def __call__(self) -> None:
        if self.failure is not None:
            return
        doing = f"ingesting {self.entries:,} JSON entries"
        try:
            with _fresh_coordinator(self.lmcache, "ingest", self.progress, doing) as (url, pid, _):
                run = timed_streams(
                    url, pid, self.streams, "application/json", self.warmup, self.settle_s
                )
            self.runs.append(run)
        except (Unavailable, httpx.HTTPError) as e:
            self.failure = str(e)

    def figures(self) -> IngestFigures | None:
        """The runs as the figures its rows compare (``None``: none ran)."""
        if not self.runs:
            return None
        per_stream = self.entries // len(self.streams)
        second_half = (
            None
            if self.per_body is None
            else second_half_entries(self.streams, per_stream, self.per_body)
        )
        return IngestFigures(self.entries, tuple(self.runs), second_half)


def against_lmcache(
    args: argparse.Namespace,
    lmcache: LMCacheEnv,
    ours_ingest: IngestFigures | None,
    rounds: LMCacheIngestRounds | None,
    lookup: tuple[LookupFigures, LMCacheLookupRounds] | None,
) -> list[Comparison] | None:
    """LMCache's side of what ran (its ingest runs, one a round of ours, in ``rounds``; its
    lookup runs, one after each of ours, in ``lookup``) and the rows comparing both, or
    ``None`` (said on stderr) when one of its coordinators would not start or answer:
    ``bench service`` still prints our table."""
    failure = None if rounds is None else rounds.failure
    lm_lookup = None
    if failure is None and lookup is not None:
        failure = lookup[1].failure
        lm_lookup = lookup[1].figures()
        if failure is None and lm_lookup is None:
            failure = "its lookups never ran"
    if failure is not None:
        print(
            f"kvatlas bench service: {lmcache.label} could not be measured: {failure}",
            file=sys.stderr,
        )
        return None
    return comparisons(
        args,
        ours_ingest,
        None if rounds is None else rounds.figures(),
        None if lookup is None else lookup[0],
        lm_lookup,
        lmcache.label,
    )


def comparisons(
    args: argparse.Namespace,
    ours_ingest: IngestFigures | None,
    their_ingest: IngestFigures | None,
    ours_lookup: LookupFigures | None,
    their_lookup: LookupFigures | None,
    label: str,
) -> list[Comparison]:
    """quality.md's HTTP rows, kvatlas against LMCache, with its targets."""
    rows: list[Comparison] = []
    if ours_ingest is not None and their_ingest is not None:
        rows += _ingest_rows(args, ours_ingest, their_ingest, label)
    if ours_lookup is not None and their_lookup is not None:
        rows += _lookup_rows(args, ours_lookup, their_lookup, label)
    return rows


def _ingest_rows(
    args: argparse.Namespace, ours: IngestFigures, theirs: IngestFigures, label: str
) -> list[Comparison]:
    one = args.emitters == 1
    case = f"ingest JSON, {LLAMA3.name} ids"
    ops = (
        f"kvatlas {_runs(len(ours.runs))} × {ours.entries:,} entries, "
        f"{label} {_runs(len(theirs.runs))} × {theirs.entries:,}"
    )
    cpu = Comparison(
        f"{case}: server CPU per entry", "s", ours.cpu_per_entry_s, theirs.cpu_per_entry_s,
        lower_is_better=True, target="≤ 7 µs, ≥ 20×",
        notes=ops + _by_round(_per_entry(ours), _per_entry(theirs)),
    )  # fmt: skip
    rate = Comparison(
        f"{case}: entries/s, {'one sequential emitter' if one else f'{args.emitters} emitters'}",
        "entries/s", ours.entries_per_s, theirs.entries_per_s, lower_is_better=False,
        target="≥ 100k/s" if one else "", met=ours.entries_per_s >= 100_000 if one else None,
        notes=ops,
    )  # fmt: skip
    rss = Comparison(
        f"{case}: server RSS growth per chunk after {ours.entries:,} chunks"
        + ("" if theirs.entries == ours.entries else f" ({label} after {theirs.entries:,})"),
        "B", ours.rss_per_chunk, theirs.rss_per_chunk, lower_is_better=True,
        target="≤ 0.9 KB", met=ours.rss_per_chunk <= 900,
        notes=f"after {SETTLE_S:g} s idle: kvatlas {ours.rss_idle_per_chunk:,.0f} B, "
        f"{label} {theirs.rss_idle_per_chunk:,.0f} B" + _second_halves(ours, theirs, label),
    )  # fmt: skip
    factor = cpu.factor or 0.0
    cpu = _judged(cpu, ours.cpu_per_entry_s <= 7e-6 and factor >= 20)
    return [cpu, rate, rss]


def _per_entry(fig: IngestFigures) -> list[float]:
    return [run.cpu_s / fig.entries for run in fig.runs]


def _by_round(ours: list[float], theirs: list[float]) -> str:
    """A CPU row's note of each round's factor (LMCache's CPU an operation in a run against
    ours of the same round), when both sides ran in the same rounds."""
    if len(ours) != len(theirs) or len(ours) < 2:
        return ""
    factors = (t / o for o, t in zip(ours, theirs, strict=True))
    return "; round by round: " + " · ".join(f"{f:.1f}×" for f in factors)


def _second_halves(ours: IngestFigures, theirs: IngestFigures, label: str) -> str:
    """The RSS row's note of both sides' growth a chunk over the streams' second halves."""
    mine, their = ours.rss_second_half_per_chunk, theirs.rss_second_half_per_chunk
    if mine is None or their is None:
        return ""
    return f"; over the second halves: kvatlas {mine:,.0f} B, {label} {their:,.0f} B"


def _lookup_rows(
    args: argparse.Namespace, ours: LookupFigures, theirs: LookupFigures, label: str
) -> list[Comparison]:
    case = f"blend-lookup, {LLAMA3.name} ids"
    same = ours.first_matches == theirs.first_matches
    if not same:
        print(
            f"kvatlas bench service: warning: kvatlas and {label} answer the first query "
            f"differently ({len(ours.first_matches)} and {len(theirs.first_matches)} matches): "
            "the lookups compared do not do the same work",
            file=sys.stderr,
        )
    ops = (
        f"kvatlas {ours.requests:,} lookups in {_runs(len(ours.runs))}, {label} "
        f"{theirs.requests:,} in {_runs(len(theirs.runs))}; {ours.generator}; first query: "
        + (
            f"the same {len(ours.first_matches)} matches"
            if same
            else f"ANSWERS DIFFER ({len(ours.first_matches)} vs {len(theirs.first_matches)})"
        )
    )
    per_lookup = [[r.per_request_cpu_s for r in fig.runs] for fig in (ours, theirs)]
    cpu = Comparison(
        f"{case}: server CPU per lookup", "s", ours.cpu_per_lookup_s, theirs.cpu_per_lookup_s,
        lower_is_better=True, target="≤ 0.4 ms, ≥ 15×", notes=ops + _by_round(*per_lookup),
    )  # fmt: skip
    rate = Comparison(
        f"{case}: requests/s", "req/s", ours.requests_per_s, theirs.requests_per_s,
        lower_is_better=False, target=f"≥ 15× {label}'s",
    )  # fmt: skip
    p99 = Comparison(
        f"{case}: p99 latency", "s", ours.p99_s, theirs.p99_s, lower_is_better=True,
        target="≤ 5 ms", met=ours.p99_s <= 5e-3,
        notes=f"p50: kvatlas {ours.p50_s * 1e3:.1f} ms, {label} {theirs.p50_s * 1e3:.1f} ms",
    )  # fmt: skip
    return [
        _judged(cpu, ours.cpu_per_lookup_s <= 0.4e-3 and (cpu.factor or 0.0) >= 15),
        _judged(rate, (rate.factor or 0.0) >= 15),
        p99,
    ]


def _judged(row: Comparison, met: bool) -> Comparison:
    return dataclasses.replace(row, met=met)


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"
