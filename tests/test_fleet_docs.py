"""The docs run: each shape's ``fleet-test`` blocks of docs/fleet.md, and the engine API's
``doc-test`` blocks of docs/node.md, verbatim and in order, one bash shell per section, against
real services on loopback (Redis, coordinator, nodes, a snippet as the engine).

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
DOCS = ROOT / "docs"
_PRELUDE = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n"


_SHOWN = re.compile(r"^# \{(?!.*\.\.\.).*$")
"""A comment showing a reply line in full (no ``...``): the run must print exactly that line."""


def sections(text: str, tag: str) -> dict[str, list[str]]:
    """Heading of each ``## `` section → its ``bash <tag>`` blocks."""
    block = re.compile(rf"^```bash {tag}\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    found: dict[str, list[str]] = {}
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        blocks = block.findall(section)
        if blocks:
            found[section.splitlines()[0]] = blocks
    return found


SHAPES = sections((DOCS / "fleet.md").read_text(), "fleet-test")
ENGINE_API = sections((DOCS / "node.md").read_text(), "doc-test")
LOOKUPS = sections((DOCS / "coordinator.md").read_text(), "doc-test")
RUNS = (
    {f"fleet.md {k}": v for k, v in SHAPES.items()}
    | {f"node.md {k}": v for k, v in ENGINE_API.items()}
    | {f"coordinator.md {k}": v for k, v in LOOKUPS.items()}
)


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


def test_the_pages_have_their_runnable_sections() -> None:
    assert [name.split(".")[0] for name in SHAPES] == ["1", "2", "3"]
    assert list(ENGINE_API) == ["Engine API"]
    assert list(LOOKUPS) == ["Lookups by key, `kv_rank`, holders of blend matches"]


@pytest.mark.parametrize("section", list(RUNS))
def test_doc_section_runs_verbatim(section: str, tmp_path: Path) -> None:
    script = tmp_path / "section.sh"
    script.write_text(_PRELUDE + "\n".join(RUNS[section]))
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
    assert proc.returncode == 0, f"docs/{section!r} failed:\n{out[-6000:]}"
    shown = [line[2:] for line in "\n".join(RUNS[section]).splitlines() if _SHOWN.match(line)]
    missing = [line for line in shown if line not in out.splitlines()]
    assert not missing, f"docs/{section!r} shows output it does not print: {missing}\n{out[-6000:]}"
