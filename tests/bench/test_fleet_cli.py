"""``kvatlas bench fleet``'s frame: flags, the spec's JSON, the same requests for every stack.
The simulation itself is tested in test_fleet_virtual.py; here a stand-in serves requests."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvatlas.bench.fleet import command as fleet_run
from kvatlas.bench.fleet.config import FleetConfig
from kvatlas.bench.fleet.results import RequestRecord
from kvatlas.bench.fleet.stacks import DEFAULT_POLICIES, Stack
from kvatlas.cli import main
from kvatlas.workloads import TraceRequest

RAG = "rag:docs=20,k=2,zipf=1.0,rate=50,seed=3"
POLICY_FIELDS = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_ratio", "prefill_tokens",
                 "fragment_tokens", "throughput_tokens_s", "requests"}  # fmt: skip


def _stand_in(drop: str | None = None) -> fleet_run.RunStack:
    def run_stack(config: FleetConfig, stack: Stack, requests: Sequence[TraceRequest],
                  progress: Callable[[str], None]) -> list[RequestRecord]:  # fmt: skip
        progress("serving")
        served = [r for r in requests if not (stack.name == drop and r.index == 0)]
        return [RequestRecord(r.index, "e0", r.arrival_s, r.arrival_s + 0.1, r.arrival_s + 1.0,
                              r.input_tokens, r.input_tokens // 2, 0, r.output_tokens)
                for r in served]  # fmt: skip

    return run_stack


def test_json_is_exactly_the_specs_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(fleet_run, "_runner", lambda mode: _stand_in())
    out = tmp_path / "fleet.json"
    code = main(["bench", "fleet", "--trace", RAG, "--requests", "30", "--engines", "3", "--jobs", "1",
                 "--policies", "kvatlas,prefix,round-robin", "--json", str(out)])  # fmt: skip
    assert code == 0
    got = json.loads(out.read_text())
    assert set(got) == {"trace", "engines", "mode", "requests", "ceiling_hit_ratio", "policies"}
    assert (got["trace"], got["engines"], got["mode"], got["requests"]) == (RAG, 3, "virtual", 30)
    assert 0.0 < got["ceiling_hit_ratio"] < 1.0
    assert list(got["policies"]) == ["kvatlas", "prefix", "round-robin"]
    for row in got["policies"].values():
        assert set(row) == POLICY_FIELDS
        assert row["requests"] == 30
        assert row["hit_ratio"] == pytest.approx(0.5, abs=0.02)
    captured = capsys.readouterr()
    assert "ceiling" in captured.out and "target" in captured.out
    assert "kvatlas: serving" in captured.err  # progress on stderr


def test_a_stack_that_lost_a_request_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_run, "_runner", lambda mode: _stand_in(drop="prefix"))
    code = main(["bench", "fleet", "--trace", RAG, "--requests", "10",
                 "--policies", "kvatlas,prefix"])  # fmt: skip
    assert code != 0


@pytest.mark.parametrize(
    "flags",
    [
        ["--policies", "kvatlas,nope"],
        ["--policies", "prefix,prefix"],
        ["--engines", "0"],
        ["--chunk-size", "100"],
        ["--load-scale", "0"],
    ],
)
def test_bad_flags_are_refused_with_one_line(flags: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert main(["bench", "fleet", "--trace", RAG, "--requests", "5", *flags]) != 0
    assert "refused" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-num-seqs", "0"],
        ["--max-num-batched-tokens", "0"],
        ["--block-size", "0"],
        ["--gpu-blocks", "0"],
        ["--gpu-blocks", "-1"],
        ["--chunk-size", "0"],
        ["--host-blocks", "-1"],
        ["--l2-chunks", "-1"],
        ["--load-scale", "nan"],
        ["--speed", "inf"],
        ["--json", "/nonexistent-dir/fleet.json"],
        ["--plot", "/nonexistent-dir/fleet.png"],
    ],
)
def test_a_size_that_cannot_work_is_refused_before_running(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step budget or a running-request cap of 0 made the simulation run for ever; a block,
    GPU size or chunk of 0 was a traceback; negative host blocks or L2 chunks ran; --json and
    --plot into a missing directory failed after the whole run. Each is one line, exit 2,
    before any stack runs."""
    ran: list[str] = []

    def never(mode: str) -> fleet_run.RunStack:
        ran.append(mode)
        return _stand_in()

    monkeypatch.setattr(fleet_run, "_runner", never)
    code = main(["bench", "fleet", "--trace", RAG, "--requests", "5", "--jobs", "1", *flags])
    err = capsys.readouterr().err
    assert (code, ran) == (2, []), err
    refusals = [line for line in err.splitlines() if "refused" in line]
    assert len(refusals) == 1 and f"refused: {flags[0]}" in refusals[0], err


def test_a_generator_without_a_count_and_a_missing_trace_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "fleet", "--trace", RAG]) != 0
    assert main(["bench", "fleet", "--trace", str(tmp_path / "none.jsonl")]) != 0
    err = capsys.readouterr().err
    assert "request count" in err and "no trace file" in err


def test_a_virtual_run_of_every_default_stack_on_the_mooncake_trace(tmp_path: Path) -> None:
    """The CI run of the real simulation (issue 27 item 8): the spec's JSON shape, every stack
    saw the same requests (the command refuses a stack that did not serve each once), and the
    ceiling bounds every hit ratio — not the targets (no timing in tests)."""
    source = Path(__file__).parent / "data" / "mooncake-synthetic-head200.jsonl"
    out = tmp_path / "fleet.json"
    code = main(["bench", "fleet", "--trace", str(source), "--requests", "120", "--engines", "4",
                 "--json", str(out)])  # fmt: skip
    assert code == 0
    got = json.loads(out.read_text())
    assert set(got) == {"trace", "engines", "mode", "requests", "ceiling_hit_ratio", "policies"}
    assert (got["engines"], got["mode"], got["requests"]) == (4, "virtual", 120)
    assert set(got["policies"]) == set(DEFAULT_POLICIES.split(","))
    for row in got["policies"].values():
        assert set(row) == POLICY_FIELDS and row["requests"] == 120
        assert 0.0 <= row["hit_ratio"] <= got["ceiling_hit_ratio"] + 1e-9
        assert row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]


def test_stacks_side_by_side_give_what_one_after_the_other_gives(tmp_path: Path) -> None:
    """--jobs 2 simulates the stacks in worker processes that rebuild the workload: the same
    numbers as one process, stack by stack."""
    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        code = main(["bench", "fleet", "--trace", RAG, "--requests", "40", "--engines", "2",
                     "--policies", "kvatlas,round-robin", "--jobs", jobs, "--json", str(out)])  # fmt: skip
        assert code == 0
        outs.append(json.loads(out.read_text()))
    assert outs[0] == outs[1]
