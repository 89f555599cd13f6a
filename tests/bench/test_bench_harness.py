"""The benchmark harness itself: verdicts, refused configurations, exit codes, server CPU.

No test here asserts a duration: benchmarks measure, tests check that what they print means
what it says.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvatlas.bench import blend, common, keys, kv_events, server_cpu, service, service_runs
from kvatlas.bench.server_cpu import process_cpu_seconds, process_minor_faults
from kvatlas.cli import _build_parser as build_parser
from kvatlas.directory import BlendIndex


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_target_column_says_met_or_missed() -> None:
    assert common.verdict(common.BenchRow("a", 1e-3, target="≤ 2 ms", met=True)) == "≤ 2 ms ✔"
    assert common.verdict(common.BenchRow("a", 3e-3, target="≤ 2 ms", met=False)) == "≤ 2 ms ✘"
    assert common.verdict(common.BenchRow("a", 3e-3)) == "-"


def test_rows_that_measure_no_time_print_their_unit_not_a_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        common.BenchRow("bytes", None, target="≤ 128 B/chunk", met=True, shown="93.0 B/chunk"),
        common.BenchRow("time", 2e-3, 4e-3, target="≤ 1 ms", met=False),
    ]
    args = argparse.Namespace(json=tmp_path / "out.json", plot=None)
    common.report("t", rows, args, {})
    out = capsys.readouterr().out
    assert "93.0 B/chunk" in out and "0.0 µs" not in out
    assert "targets met: 1/2" in out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert [r["met"] for r in saved["rows"]] == [True, False]
    assert saved["rows"][1]["ratio"] == pytest.approx(2.0)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401 - a dev dependency: missing, the test fails, never skips

    rows = [common.BenchRow("a", 1e-3, 5e-3, target="≤ 2 ms", met=True)]
    common.report("t", rows, argparse.Namespace(json=None, plot=tmp_path / "c.png"), {})
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv",
    [
        ("keys", "--tokens", "300"),
        ("blend", "--sizes", "10000", "--queries", "100"),
        ("blend", "--sizes", "50", "--queries", "8192"),
        ("directory", "--entries", "10"),
        ("service", "--query-tokens", "100"),
        ("service", "--entries", "100", "--batch-entries", "256"),
        ("service", "--lmcache-entries", "0"),
        ("kv_events", "--tokens", "300"),
    ],
)
def test_a_configuration_that_makes_a_row_meaningless_is_refused(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    module = {"keys": keys, "blend": blend, "service": service, "kv_events": kv_events}.get(argv[0])
    if module is None:
        from kvatlas.bench import directory as module
    assert module.run(_args(*argv)) == common.REFUSED
    assert "refused:" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", [16384, 4096, 131072])
def test_bench_keys_places_every_image_inside_the_prompt(tokens: int) -> None:
    items = keys.image_items(tokens)
    assert items
    assert all(it.span.offset >= 0 and it.span.offset + it.span.length <= tokens for it in items)


def test_naive_chunk_hash_is_the_contract() -> None:
    from kvatlas.keys import chunk_hashes

    tokens = np.arange(1000, dtype=np.uint32) * 7919
    assert keys.naive_chunk_hashes(tokens.tolist(), 256) == chunk_hashes(tokens, 256)


SMALL_BLEND = ("blend", "--sizes", "1000", "--queries", "2048", "--repeats", "1")


def test_bench_blend_exits_zero_when_every_answer_is_right() -> None:
    assert blend.run(_args(*SMALL_BLEND, "--naive-max", "0")) == 0


def test_bench_blend_exits_nonzero_when_recall_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_match = BlendIndex.match

    def lossy(self: BlendIndex, *args: object, **kwargs: object) -> object:
        return real_match(self, *args, **kwargs)[1:]  # type: ignore[arg-type]

    monkeypatch.setattr(BlendIndex, "match", lossy)
    assert blend.run(_args(*SMALL_BLEND, "--naive-max", "0")) == 1
    assert "FAILED: match rag" in capsys.readouterr().err


def test_server_cpu_counts_this_process_cpu_time() -> None:
    before = process_cpu_seconds(os.getpid())
    sum(i * i for i in range(3_000_000))  # CPU work, not a sleep
    assert process_cpu_seconds(os.getpid()) > before


def test_server_minor_faults_count_this_process_touching_fresh_pages() -> None:
    """Each first touch of a page of a fresh mapping is a minor fault of the process."""
    before = process_minor_faults(os.getpid())
    with mmap.mmap(-1, 256 * mmap.PAGESIZE) as fresh:
        for at in range(0, len(fresh), mmap.PAGESIZE):
            fresh[at] = 1
    assert process_minor_faults(os.getpid()) - before >= 256


def test_bench_directory_runs_the_snapshot_part_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvatlas.bench import directory

    out = tmp_path / "d.json"
    argv = ("directory", "--only", "snapshot", "--snapshot-keys", "256", "--repeats", "1")
    assert directory.run(_args(*argv, "--json", str(out))) == 0
    # A run of many minutes says what it is doing and prints each row as it finishes, on
    # stderr (stdout keeps the table alone).
    err = capsys.readouterr().err
    assert "building 256 keys" in err
    assert "snapshot 1/1" in err
    assert "done: snapshot at 256 keys" in err
    assert "done: restore 256 keys (blend on" in err
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"].split(":")[0] for r in rows] == [
        "snapshot at 256 keys",
        "restore 256 keys (blend off) in a fresh process",
        "restore 256 keys (blend on",  # ": the index rebuilt) in a fresh process"
    ]
    notes = rows[0]["extra"]
    assert {"same thread, as long, alone", "beside plain Python (floor)"} <= set(notes)
    assert notes["switch interval"] == "1.000 ms"  # the coordinator's


def test_bench_kv_events_times_both_engine_workloads(tmp_path: Path) -> None:
    """Whole requests in one event (the naive code's best case) and decoding, one block per
    event (its worst: it rebuilds and hashes the whole prefix each time); the run checks that
    both re-keyers count the same chunks."""
    out = tmp_path / "k.json"
    argv = ("kv_events", "--requests", "4", "--tokens", "1024", "--repeats", "1", "--only", "rekey")
    assert kv_events.run(_args(*argv, "--json", str(out))) == 0
    cases = [r["case"] for r in json.loads(out.read_text())["rows"]]
    assert any("one event per request" in c for c in cases)
    assert any("then one event per block" in c for c in cases)


def test_bench_resync_draws_its_chart(tmp_path: Path) -> None:
    """Every benchmark takes --plot; resync's rows are bytes, not times."""
    from kvatlas.bench import resync

    png = tmp_path / "r.png"
    assert resync.run(_args("resync", "--placements", "5000", "--plot", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("connections", "threads"), [(1, 1), (2, 2), (8, 2)])
def test_wrk_never_gets_more_threads_than_connections(connections: int, threads: int) -> None:
    """wrk refuses ``-t2 -c1`` ("number of connections must be >= threads"): one client (the
    router benchmark's default) failed every run where wrk is installed."""
    command = server_cpu.wrk_command("wrk", connections, 0.4, Path("post.lua"), "http://h:1")
    assert command[1:5] == [f"-t{threads}", f"-c{connections}", "-d1s", "-s"]


def test_bench_directory_times_prefix_lookups_against_the_naive_directory(tmp_path: Path) -> None:
    from kvatlas.bench import directory

    out = tmp_path / "d.json"
    argv = ("directory", "--only", "consume", "--entries", "512", "--memory-chunks", "256")
    assert directory.run(_args(*argv, "--repeats", "1", "--json", str(out))) == 0
    (row,) = [r for r in json.loads(out.read_text())["rows"] if "prefix lookup" in r["case"]]
    assert row["case"].startswith("prefix lookup, 128 keys of one stored batch, 512 chunks")
    assert row["ours_s"] > 0 and row["reference_s"] > 0
    assert float(row["extra"]["µs/key"]) > 0


@pytest.mark.parametrize(
    ("per_stream", "per_body", "bodies", "late"),
    [(1000, 256, 4, 488), (1024, 256, 4, 512), (100, 256, 1, 100), (768, 256, 3, 512)],
)
def test_the_second_half_counts_the_entries_of_its_bodies(
    per_stream: int, per_body: int, bodies: int, late: int
) -> None:
    """Bodies of ``per_body`` entries, the last one the rest: the first ``bodies // 2`` are
    full, the second half holds the others (a lone body is all second half); streams add."""
    stream = [b""] * bodies
    assert service_runs.second_half_entries([stream], per_stream, per_body) == late
    assert service_runs.second_half_entries([stream] * 3, per_stream, per_body) == 3 * late


def test_the_second_half_row_divides_its_own_growth() -> None:
    """Growth over the second halves over the entries posted there: the run's median, not the
    whole stream's growth over all its entries."""
    runs = tuple(
        service_runs.IngestRun(
            1.0, 1.0, 0, rss_growth=total, rss_growth_idle=0, rss_growth_first_half=h
        )
        for total, h in ((10_000, 6_000), (12_000, 7_000), (9_000, 6_000))
    )
    figures = service_runs.IngestFigures(10, runs, second_half=5)
    assert figures.rss_per_chunk == 1_000  # the median run's growth over all 10 entries
    assert figures.rss_second_half_per_chunk == 4_000 / 5  # the median of 4,000, 5,000, 3,000
    assert service_runs.IngestFigures(10, runs).rss_second_half_per_chunk is None


def test_timed_streams_applies_every_body_once_in_two_halves() -> None:
    """Against a real coordinator: two emitters' streams posted as two halves (the resident
    memory read between them) leave exactly their chunks."""
    args = _args("service", "--entries", "3000", "--emitters", "2", "--batch-entries", "250")
    workload = service._ingest_workload(args, np.random.default_rng(0))
    streams = workload.streams["json"]
    assert [len(s) for s in streams] == [2, 2]  # 1,500 entries each: a body of 1,000, of 500
    with service.service_process(service.COORDINATOR) as (url, pid):
        run = service_runs.timed_streams(
            url, pid, streams, "application/json", workload.warmups["json"]
        )
        stats = httpx.get(f"{url}/directory/stats", timeout=30).json()
    assert stats["keys"] == 64 + 3000  # the warm-up's and every stream's
    # every batch applied once: the warm-up's one and each stream's six, none posted twice
    assert stats["batches"] == {"applied": 1 + 2 * 6, "duplicate": 0, "stale": 0}
    assert run.wall_s > 0
