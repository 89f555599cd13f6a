"""Every benchmark is in the README, has a smoke size, warns on a busy machine, and judges
the project's targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvatlas.bench import BENCHMARKS
from kvatlas.bench.common import warn_if_busy
from kvatlas.bench.directory import CHUNK_BYTES, CONSUME_RATE
from kvatlas.cli import _build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
SIZED_BY_REQUESTS = {"fleet"}  # a trace replay: --requests / --minutes


def test_the_readme_names_every_benchmark() -> None:
    (listed,) = re.findall(r"kvatlas bench ([\w|]+)", README)
    assert sorted(listed.split("|")) == sorted(BENCHMARKS)


@pytest.mark.parametrize("name", [b for b in BENCHMARKS if b not in SIZED_BY_REQUESTS])
def test_every_benchmark_has_a_quick_smoke_size(name: str) -> None:
    args = _build_parser().parse_args(["bench", name, "--quick"])
    assert args.quick is True


def test_a_busy_machine_is_warned_about(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 1.0, 1.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert warn_if_busy("keys")
    assert "the machine is busy (load average 64.0 on 2 cores)" in capsys.readouterr().err
    monkeypatch.setattr("os.getloadavg", lambda: (0.5, 1.0, 1.0))
    assert not warn_if_busy("keys")


def test_the_directory_benchmark_judges_the_quality_targets() -> None:
    """``bench directory``'s consume and memory rows judge the project's quality targets
    ("directory consume, token-bearing store entries, blend on: ≥ 1M entries/s, ≤ 0.9 KB per
    chunk"), not weaker ones of their own (≥ 300k entries/s, ≤ 1.2 KB until 2026-12-04)."""
    assert (CONSUME_RATE, CHUNK_BYTES) == (1_000_000, 900)
