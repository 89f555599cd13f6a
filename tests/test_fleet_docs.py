"""docs/fleet.md runs: each shape's ``fleet-test`` blocks, verbatim and in order, in one bash
shell against real services on loopback (Redis, coordinator, nodes, a snippet as the engine).

Each shape runs in a network namespace of its own when the machine allows one (``unshare
--net``), so the documented ports never collide with anything else running here; otherwise on
this machine's loopback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLEET = ROOT / "docs" / "fleet.md"
_BLOCK = re.compile(r"^```bash fleet-test\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_PRELUDE = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n"


def shapes(text: str) -> dict[str, list[str]]:
    """Heading of each ``## `` section → its ``fleet-test`` blocks."""
    found: dict[str, list[str]] = {}
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        blocks = _BLOCK.findall(section)
        if blocks:
            found[section.splitlines()[0]] = blocks
    return found


SHAPES = shapes(FLEET.read_text())


def _isolated() -> list[str]:
    probe = ["unshare", "--net", "--map-root-user", "true"]
    if shutil.which("unshare") and subprocess.run(probe, capture_output=True).returncode == 0:
        return [
            "unshare",
            "--net",
            "--map-root-user",
            "bash",
            "-c",
            'ip link set lo up && exec "$0" "$@"',
        ]
    return []


def test_the_page_has_the_runnable_shapes() -> None:
    assert [name.split(".")[0] for name in SHAPES] == ["1", "2"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fleet_shape_runs_verbatim(shape: str, tmp_path: Path) -> None:
    script = tmp_path / "shape.sh"
    script.write_text(_PRELUDE + "\n".join(SHAPES[shape]))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),  # this tree's kvatlas, for the CLI and the snippets alike
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    env = {k: v for k, v in env.items() if not k.startswith("KVATLAS_")}
    proc = subprocess.Popen(
        [*_isolated(), "bash", str(script)], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"docs/fleet.md, shape {shape!r} failed:\n{out[-6000:]}"
