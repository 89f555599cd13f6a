"""LMCache 0.5.6's own command line (``lmcache query coordinator``, ``lmcache quota``) pointed at a
kvatlas coordinator answers as it does against LMCache's coordinator: exit code 0 and the same
report. Each difference was found driving both side by side (the CLI reads reply fields that
the golden exchanges leave out). Under ``CI`` a missing LMCache fails these tests, never skips
them (``tests/lmcache_mp/server.py``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.bench.lmcache_reference import lmcache_env
from tests.coordinator.helpers import post_batches, running, wire_batch
from tests.lmcache_mp.server import CHUNK_SIZE, require_lmcache


@pytest.fixture(scope="module")
def coordinator() -> Iterator[tuple[str, httpx.Client]]:
    with running(chunk_size=CHUNK_SIZE) as (server, client):
        yield server.url, client


def lmcache_cli(tmp_path: Path, *args: str) -> tuple[int, Any, str]:
    """Run ``lmcache <args> --format json --output F``: exit code, the JSON report, stderr."""
    bin_dir = require_lmcache()
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [str(bin_dir / "lmcache"), *args, "--format", "json", "--output", str(out), "-q"],
        capture_output=True, text=True, env=lmcache_env(), timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, report, proc.stderr[-2000:]


def test_instances_lists_an_emitter_that_never_registered(
    coordinator: tuple[str, httpx.Client], tmp_path: Path
) -> None:
    """An emitter known only by its events is a row of ``GET /instances``; LMCache's CLI read
    its ``ip`` and ``http_port`` and failed with a ``KeyError`` (exit 1)."""
    url, client = coordinator
    body = {"instance_id": "cli-a", "ip": "10.0.0.7", "http_port": 8080}
    assert client.post("/instances", json=body).status_code == 200
    assert post_batches(client, wire_batch("cli-b", 1, 1)).status_code == 200
    code, report, err = lmcache_cli(
        tmp_path, "query", "coordinator", "--api", "instances", "--url", url
    )
    assert code == 0, err
    rows = {r["instance"]: r for r in report["metrics"]["instances"]}
    assert rows["cli-a"]["address"] == "10.0.0.7:8080"
    assert "cli-b" in rows


def test_quota_delete_of_a_salt_without_one_exits_0_as_against_lmcache(
    coordinator: tuple[str, httpx.Client], tmp_path: Path
) -> None:
    """``lmcache quota delete`` of a salt without a quota: LMCache's coordinator answers 200
    ``not_found`` and its CLI reports it (exit 0); kvatlas's 404 made it exit 1."""
    url, _ = coordinator
    code, report, err = lmcache_cli(tmp_path, "quota", "delete", "cli-none", "--url", url)
    assert code == 0, err
    assert report["metrics"] == {"cache_salt": "cli-none", "status": "not_found"}
    assert lmcache_cli(tmp_path, "quota", "set", "cli-t", "--limit-gb", "1", "--url", url)[0] == 0
    code, report, err = lmcache_cli(tmp_path, "quota", "delete", "cli-t", "--url", url)
    assert (code, report["metrics"]) == (0, {"cache_salt": "cli-t", "status": "removed"}), err
