"""The services' logs (coordinator and node processes): one format, JSON lines by default
(uvicorn's lines included), no access log unless ``--access-log``, httpx's per-request lines
(registration, heartbeats) only at DEBUG; ``--log-format text`` for humans."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvatlas.asgi_thread import free_port
from kvatlas.processes import is_healthy
from tests.conftest import HTTP, wait_for

NODE = ["--model-name", "m", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
        "--chunk-size", "16", "--dtype", "float32", "--l2", "none"]  # fmt: skip


@contextmanager
def service(args: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvatlas.cli", *args, "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        assert wait_for(lambda: is_healthy(url, HTTP) or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, log.read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _fleet_logs(tmp_path: Path, *extra: str) -> tuple[list[str], list[str]]:
    """Log lines of a coordinator and a node registered with it, after one engine call."""
    coordinator_log, node_log = tmp_path / "coordinator.log", tmp_path / "node.log"
    with service(["coordinator", "--chunk-size", "16", *extra], coordinator_log) as coordinator:
        node_args = [
            "node",
            *NODE,
            "--coordinator-url",
            coordinator,
            "--coordinator-event-reporting",
            *extra,
        ]
        with service(node_args, node_log) as node:
            lookup = httpx.post(f"{node}/engine/lookup", json={"tokens": ""})
            assert lookup.status_code == 200
    return coordinator_log.read_text().splitlines(), node_log.read_text().splitlines()


def test_json_lines_without_access_log_or_httpx_lines_by_default(tmp_path: Path) -> None:
    for lines in _fleet_logs(tmp_path):
        entries = [json.loads(line) for line in lines]  # every line is one JSON object
        loggers = {e["logger"] for e in entries}
        assert "uvicorn.error" in loggers  # uvicorn's own lines share the format
        assert "uvicorn.access" not in loggers and "httpx" not in loggers, loggers


def test_access_log_and_text_format_on_request(tmp_path: Path) -> None:
    coordinator, node = _fleet_logs(tmp_path, "--access-log", "--log-format", "text")
    assert not any(line.startswith("{") for line in coordinator + node)
    assert any("uvicorn.access" in line and "/engine/lookup" in line for line in node)
    assert any("uvicorn.access" in line and "/instances" in line for line in coordinator)
