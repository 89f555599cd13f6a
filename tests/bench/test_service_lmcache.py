"""``bench service``'s LMCache side: ``--lmcache`` finds (or refuses) an environment, LMCache
ingests the first of our bodies, and, against the real LMCache 0.5.6 coordinator (``make test``
installs it into ``.venv-lmcache``; under ``CI`` a missing one fails, never a silent skip), every
row quality.md states against LMCache is measured, on the same work as ours.

No test here asserts a duration or which side is faster: it checks that the rows exist, count
what they say, and hold figures a measurement can give.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.progress import Progress

from kvatlas.bench import common, service, service_lmcache
from kvatlas.bench.comparison import add_to_json, print_comparison
from kvatlas.bench.lmcache_reference import (
    REFERENCE_VERSION,
    LMCacheEnv,
    find_lmcache,
    lmcache_coordinator,
)
from kvatlas.bench.server_cpu import LoadResult
from kvatlas.bench.service_lmcache import (
    LMCacheIngestRounds,
    LMCacheLookupRounds,
    comparisons,
    lmcache_entries,
    lmcache_lookups,
)
from kvatlas.bench.service_runs import (
    IngestFigures,
    IngestRun,
    LookupFigures,
    lookup_workload,
    second_half_entries,
    timed_streams,
)
from kvatlas.cli import _build_parser as build_parser
from kvatlas.errors import Unavailable
from kvatlas.workloads import LLAMA3
from tests.lmcache_mp.server import require_lmcache


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "service", *argv])


def _entries_in(streams: list[list[bytes]]) -> int:
    return sum(
        len(batch["entries"])
        for s in streams
        for body in s
        for batch in json.loads(body)["batches"]
    )


# --------------------------------------------------------------------------- finding LMCache


def test_a_path_without_lmcache_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service.run(_args("--lmcache", str(tmp_path / "absent"))) == common.REFUSED
    err = capsys.readouterr().err
    assert "refused: --lmcache" in err and "no `lmcache` command" in err


def test_an_environment_whose_python_has_no_lmcache_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("lmcache", "python"):  # a Python without LMCache: the probe fails
        (bin_dir / name).write_text("#!/bin/sh\necho 'No module named lmcache' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    for given in (tmp_path / "venv", bin_dir):  # the venv or its bin directory
        assert service.run(_args("--lmcache", str(given))) == common.REFUSED
        assert "has no LMCache installed" in capsys.readouterr().err


def _fake_env(tmp_path: Path, version: str, lmcache_script: str) -> Path:
    """A venv whose Python reports LMCache ``version`` and whose ``lmcache`` runs the script."""
    bin_dir = tmp_path / "fake-venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f"#!/bin/sh\necho {version}\n")
    (bin_dir / "lmcache").write_text(f"#!/bin/sh\n{lmcache_script}\n")
    for name in ("python", "lmcache"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_another_version_is_measured_under_its_own_name_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = find_lmcache(str(_fake_env(tmp_path, "0.5.7", "exit 0").parent))
    assert found is not None and found.label == "LMCache 0.5.7"
    assert "holds LMCache 0.5.7; quality.md's reference is 0.5.6" in capsys.readouterr().err


def test_a_relative_path_names_the_environment_where_the_bench_was_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--lmcache .venv-lmcache`` is the environment under the directory the bench runs in,
    though LMCache's coordinator is started in a work directory of its own (a relative path
    used to be looked up there: `FileNotFoundError`, the whole side-by-side run lost)."""
    started = tmp_path / "started"
    _fake_env(tmp_path, REFERENCE_VERSION, f"touch {started}; exit 3")
    monkeypatch.chdir(tmp_path)
    found = find_lmcache("fake-venv")
    assert found is not None
    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(Unavailable, match=r"exited \(3\)"), lmcache_coordinator(found, 16, workdir):
        pass
    assert started.exists()


def test_an_lmcache_that_does_not_start_is_reported_and_our_rows_stand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = find_lmcache(str(_fake_env(tmp_path, REFERENCE_VERSION, "echo no torch here; exit 3")))
    assert found is not None
    lookup = lookup_workload(np.random.default_rng(0), 10, 1024, LLAMA3)
    with Progress() as progress:
        theirs = LMCacheLookupRounds(found, _args(), lookup, False, progress)
        theirs()  # (after our first lookup run)
        compared = service_lmcache.against_lmcache(
            _args(), found, None, None, (LookupFigures((), ()), theirs)
        )
    assert compared is None  # run() still prints our table, then exits 1
    err = capsys.readouterr().err
    assert "LMCache 0.5.6 could not be measured" in err
    assert "exited (3)" in err and "no torch here" in err


FAILING_COORDINATOR = """
import http.server, os, sys
with open(sys.argv[1], "a") as pids:
    print(os.getpid(), file=pids)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /healthz: up
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):  # every body refused
        self.send_response(500); self.end_headers()
    def log_message(self, *args): pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_lmcache_rounds_end_at_the_first_coordinator_that_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LMCache's ingest runs one a round of ours: the first that fails is the last started
    (its process gone), its reason is what the comparison reports, and no lookup
    coordinator starts after it."""
    server, pids = tmp_path / "server.py", tmp_path / "pids"
    server.write_text(FAILING_COORDINATOR)
    found = find_lmcache(
        str(_fake_env(tmp_path, REFERENCE_VERSION, f'exec {sys.executable} {server} {pids} "$@"'))
    )
    assert found is not None
    rounds = LMCacheIngestRounds(found, [[b"{}"]], 1, b"{}", None, settle_s=0.0)
    for _ in range(3):
        rounds()
    assert rounds.failure is not None and "500" in rounds.failure
    assert rounds.runs == [] and rounds.figures() is None
    lookup = lookup_workload(np.random.default_rng(0), 10, 1024, LLAMA3)
    with Progress() as progress:
        theirs = LMCacheLookupRounds(found, _args(), lookup, False, progress, rounds.failure)
        for _ in range(3):
            theirs()  # (as run() builds it after a failed ingest round: none starts)
        compared = service_lmcache.against_lmcache(
            _args(), found, None, rounds, (LookupFigures((), ()), theirs)
        )
    assert compared is None
    assert "LMCache 0.5.6 could not be measured" in capsys.readouterr().err
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 1 and not _alive(started[0])


def test_lmcache_ingests_once_after_each_of_our_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our four runs of a round, then LMCache's run of that round, ``--repeats`` times: both
    sides' medians come from the same stretch of the machine's time."""
    order: list[str] = []
    args = _args("--entries", "512", "--batch-entries", "64", "--repeats", "3")
    workload = service._ingest_workload(args, np.random.default_rng(0))
    names = {id(streams): run for run, streams in workload.streams.items()}

    @contextmanager
    def no_process(_args: list[str]) -> Iterator[tuple[str, int]]:
        yield "http://127.0.0.1:9", 0

    def recorded(_url: str, _pid: int, streams: list[list[bytes]], *_: Any) -> IngestRun:
        order.append(names[id(streams)])
        return IngestRun(1.0, 1.0, 0, 0, 0, 0)

    monkeypatch.setattr(service, "service_process", no_process)
    monkeypatch.setattr(service, "timed_streams", recorded)
    with Progress() as progress:
        service._bench_ingest(args, workload, progress, lambda: order.append("lmcache"))
    assert order == [*service.RUNS, "lmcache"] * 3


def test_lmcache_looks_up_once_after_each_of_our_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of our lookup runs in a coordinator of its own, then LMCache's run of that round,
    ``--repeats`` times (ours stopped before LMCache's starts); our first run indexes and
    takes the first query's answer once."""
    order: list[str] = []
    args = _args("--index-chunks", "10", "--query-tokens", "1024", "--repeats", "3")
    lookup = lookup_workload(np.random.default_rng(0), 10, 1024, LLAMA3)

    @contextmanager
    def no_process(_args: list[str]) -> Iterator[tuple[str, int]]:
        order.append("up")
        yield "http://127.0.0.1:9", 0
        order.append("down")

    def ran(*_: Any, **kw: Any) -> list[LoadResult]:
        order.append("ours")
        return [LoadResult(kw["repeats"], 1.0, 0.001, 0.002, 0.2, "python")]

    monkeypatch.setattr(service, "service_process", no_process)
    monkeypatch.setattr(service, "post_all", lambda *_: None)
    monkeypatch.setattr(service, "matches_of", lambda *_: [("h", 0, 0)])
    monkeypatch.setattr(service, "run_lookups", ran)
    figures = service.kvatlas_lookups(args, lookup, False, after_run=lambda: order.append("lm"))
    assert order == ["up", "ours", "down", "lm"] * 3
    assert len(figures.runs) == 3 and figures.first_matches == (("h", 0, 0),)


def test_the_lookup_cpu_row_gives_each_rounds_factor() -> None:
    def run(cpu_s: float) -> LoadResult:
        return LoadResult(1000, 1.0, 0.001, 0.002, cpu_s, "wrk")

    ours = LookupFigures((run(0.2), run(0.25), run(0.2)), ())
    theirs = LookupFigures((run(3.0), run(4.0), run(5.0)), ())
    rows = comparisons(_args(), None, None, ours, theirs, "LMCache 0.5.6")
    assert rows[0].case.endswith("server CPU per lookup")
    assert "; round by round: 15.0× · 16.0× · 25.0×" in rows[0].notes


def test_the_cpu_row_gives_each_rounds_factor() -> None:
    """Each round's factor (LMCache's run against ours of the same round) beside the factor
    of the medians; a side of one run gives none."""

    def run(cpu_s: float) -> IngestRun:
        return IngestRun(1.0, cpu_s, 0, 0, 0, 0)

    ours = IngestFigures(1000, (run(0.005), run(0.006), run(0.005)))
    theirs = IngestFigures(500, (run(0.05), run(0.066), run(0.06)))
    rows = comparisons(_args(), ours, theirs, None, None, "LMCache 0.5.6")
    assert rows[0].notes.endswith("; round by round: 20.0× · 22.0× · 24.0×")
    assert rows[0].factor == pytest.approx(24.0)  # medians: 120 µs against 5 µs an entry
    lone = IngestFigures(500, (run(0.05),))
    assert "round by round" not in comparisons(_args(), ours, lone, None, None, "L")[0].notes


def test_auto_says_on_stderr_why_lmcache_is_not_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert find_lmcache("auto", cwd=tmp_path) is None
    assert "LMCache is not measured" in capsys.readouterr().err
    (tmp_path / ".venv-lmcache").mkdir()  # there, but nothing installed in it
    assert find_lmcache("auto", cwd=tmp_path) is None
    assert "no `lmcache` command" in capsys.readouterr().err
    assert find_lmcache("off", cwd=tmp_path) is None
    assert capsys.readouterr().err == ""


def test_lmcache_ingests_the_first_bodies_holding_the_entries_asked_for() -> None:
    args = _args(
        "--entries", "640", "--emitters", "2", "--batch-entries", "64", "--batches-per-post", "2"
    )  # fmt: skip
    workload = service._ingest_workload(args, np.random.default_rng(0))
    streams = workload.streams["json"]
    assert workload.per_emitter == 320 and workload.per_body == 128
    for wanted, expected in (
        (None, 640),
        (150, 256),
        (300, 512),
        (600, 640),
        (1, 256),
        (9999, 640),
    ):
        taken, entries = lmcache_entries(streams, workload.per_emitter, workload.per_body, wanted)
        assert entries == expected == _entries_in(taken)
        assert all(t == s[: len(t)] for t, s in zip(taken, streams, strict=True))


# --------------------------------------------------------------------------- the real LMCache


@pytest.fixture(scope="module")
def lmcache() -> LMCacheEnv:
    found = find_lmcache(str(require_lmcache()))
    assert found is not None and found.version == REFERENCE_VERSION
    return found


def test_lmcache_side_gives_every_row_on_the_same_work(
    lmcache: LMCacheEnv,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[int] = []
    alive_when_starting: list[list[int]] = []
    real = service_lmcache.lmcache_coordinator

    @contextmanager
    def watched(*args: Any, **kwargs: Any) -> Iterator[tuple[str, int]]:
        alive_when_starting.append([pid for pid in started if _alive(pid)])
        with real(*args, **kwargs) as (url, pid):
            started.append(pid)
            yield url, pid

    monkeypatch.setattr(service_lmcache, "lmcache_coordinator", watched)
    args = _args(
        "--entries", "4096", "--index-chunks", "300", "--query-tokens", "4096",
        "--lookup-seconds", "1", "--repeats", "1", "--load-generator", "python",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    workload = service._ingest_workload(args, rng)
    lookup = lookup_workload(rng, args.index_chunks, args.query_tokens, LLAMA3)
    with service.service_process(service.COORDINATOR) as (url, pid):
        ours_run = timed_streams(
            url, pid, workload.streams["json"], "application/json", workload.warmups["json"]
        )
    ours_second_half = second_half_entries(workload.streams["json"], 4096, workload.per_body)
    ours_ingest = IngestFigures(4096, (ours_run,), ours_second_half)
    args.lookup_seconds = 0.3  # the Python load generator: no whole seconds needed
    ours_lookup = service.kvatlas_lookups(args, lookup, use_wrk=False)
    streams, entries = lmcache_entries(
        workload.streams["json"], workload.per_emitter, workload.per_body, 1024
    )
    began = time.perf_counter()
    rounds = LMCacheIngestRounds(
        lmcache, streams, entries, workload.warmups["json"], workload.per_body, settle_s=0.0
    )
    rounds()  # the run of a round
    theirs_lookup = lmcache_lookups(lmcache, args, lookup, use_wrk=False)
    measured_s = time.perf_counter() - began
    theirs_ingest = rounds.figures()
    assert rounds.failure is None and theirs_ingest is not None
    # one LMCache process at a time, as ours run: the ingesting one is gone before the other
    assert len(started) == 2 and alive_when_starting == [[], []]
    assert not any(_alive(pid) for pid in started)
    # the same work: LMCache answers the first query as our coordinator does
    assert theirs_lookup.first_matches == ours_lookup.first_matches
    assert len(ours_lookup.first_matches) > 0
    assert theirs_ingest.entries == 1024 and len(theirs_ingest.runs) == 1
    assert (ours_second_half, theirs_ingest.second_half) == (2048, 1024)  # 4 bodies · a lone one
    assert theirs_lookup.requests > 0 and len(theirs_lookup.runs) == 1

    rows = comparisons(args, ours_ingest, theirs_ingest, ours_lookup, theirs_lookup, lmcache.label)
    assert [r.case.split(": ", 1)[1] for r in rows] == [
        "server CPU per entry",
        "entries/s, one sequential emitter",
        "server RSS growth per chunk after 4,096 chunks (LMCache 0.5.6 after 1,024)",
        "server CPU per lookup",
        "requests/s",
        "p99 latency",
    ]
    for row in rows:
        assert math.isfinite(row.kvatlas) and math.isfinite(row.reference), row
        if row.unit != "B":  # resident memory may shrink over a thousand entries
            assert row.kvatlas > 0 and row.reference > 0, row
            assert row.factor is not None and row.factor > 0
        assert row.target and row.met is not None, row
    # per operation, not per run: a run's server CPU over the operations LMCache did in it (its
    # 1,024 entries, not our 4,096); a latency is one request's, so within the whole measurement
    ingested, looked_up = theirs_ingest.runs[0], theirs_lookup.runs[0]
    assert theirs_ingest.cpu_per_entry_s == ingested.cpu_s / 1024
    assert theirs_lookup.cpu_per_lookup_s == looked_up.server_cpu_s / looked_up.requests
    assert 0 < theirs_lookup.p50_s <= theirs_lookup.p99_s < measured_s
    assert "kvatlas 1 run × 4,096 entries, LMCache 0.5.6 1 run × 1,024" in rows[0].notes
    assert f"the same {len(ours_lookup.first_matches)} matches" in rows[3].notes
    assert (
        "; over the second halves: kvatlas " in rows[2].notes and "LMCache 0.5.6 " in rows[2].notes
    )

    out = tmp_path / "out.json"
    common.report("t", [], argparse.Namespace(json=out, plot=None), {})
    add_to_json(out, lmcache.label, rows)
    saved = json.loads(out.read_text())["comparison"]
    assert saved["reference"] == "LMCache 0.5.6" and len(saved["rows"]) == 6
    assert saved["rows"][3]["factor"] == pytest.approx(rows[3].factor)
    print_comparison("t", lmcache.label, rows)
    assert "kvatlas ahead by" in capsys.readouterr().out
