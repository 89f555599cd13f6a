"""``kvatlas soak`` (convergence.md §6): a short chaos run as real processes — redis-server,
two coordinator replicas, four nodes — with every fault kind injected; at the end every
replica's directory equals the ground truth read from the nodes, no served chunk was wrong,
the stream and each private L2 stayed under their caps. No wall-clock assertion: the
convergence times are reported in the JSON, not asserted (they are judged by the run's own
targets and exit status, which this test does not require on a loaded machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvatlas.soak.faults import KINDS, schedule
from kvatlas.soak.fleet import FleetSettings
from kvatlas.soak.report import STREAM_NODE_ENTRIES


def test_the_schedule_is_a_function_of_seed_and_length() -> None:
    settings = FleetSettings()
    a = schedule(7, 600, settings)
    assert a == schedule(7, 600, settings)
    assert a != schedule(8, 600, settings)
    assert len(a) == 30 and {f.kind for f in a} == set(KINDS)
    assert [f.at for f in a] == sorted(f.at for f in a) and a[-1].at < 600
    short = schedule(7, 20, settings)
    assert sorted(f.kind for f in short) == sorted(KINDS)  # every kind, even in a short run


def test_a_short_soak_converges_to_the_truth(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli", "soak", "--seconds", "25", "--seed", "3",
         "--json", str(out), "--workdir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    report = done.stdout[-4000:]
    assert sorted(f["kind"] for f in result["faults"]) == sorted(KINDS), report
    assert result["workload"]["wrong_kv"] == 0, report
    checked = result["workload"]["chunks_checked"]
    assert checked.get("prefix", 0) > 0 and checked.get("blend", 0) > 0, report
    for fault in result["faults"]:  # dated by the last change, confirmed by a comparison after
        if fault["converged_s"] is not None:  # (the timings themselves are not judged here)
            assert 0 <= fault["converged_s"] <= fault["confirmed_s"], (fault, report)
    for replica, diff in result["final"]["replicas"].items():
        assert (diff["ghosts"], diff["missing"], diff["error"]) == (0, 0, ""), (replica, report)
    assert set(result["final"]["replicas"]) == {"soak-r1", "soak-r2"}
    assert result["final"]["l2_index_drift"] == 0, report
    redis = result["redis"]
    assert redis["stream_len_max"] <= redis["stream_max_len"] + STREAM_NODE_ENTRIES, report
    for node, disk in result["disk"].items():
        assert 0 < disk["max_bytes"] <= disk["cap_bytes"], (node, report)
