"""The node process wiring: scheme/chunk-size/event-transport mismatch refused, blend lookup
off at the coordinator warned about, the gating rule, registration."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.api import HealthReply
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.keys import KeySchemeMismatch
from kvatlas.node.config import NodeConfig
from kvatlas.node.server import NodeProcess, TransportMismatch, check_coordinator_compatible
from tests.helpers import TINY
from tests.helpers import node_config as toy_config


def node_config(tmp_path: Path, url: str, **kw: Any) -> NodeConfig:
    return toy_config(**{"model_name": "m", **TINY, "l2": "fs", "l2_path": tmp_path,
                         "coordinator_url": url, "port": free_port(), **kw})  # fmt: skip


@pytest.fixture(scope="module")
def coordinator() -> BackgroundServer:
    with BackgroundServer(
        CoordinatorConfig(port=free_port(), chunk_size=16, enable_blend_lookup=True)
    ) as s:
        yield s  # type: ignore[misc]


@pytest.mark.parametrize("mismatch", [{"chunk_size": 32}, {"hash_scheme": "blake3-x1"}])
def test_refuses_to_start_on_scheme_or_chunk_size_mismatch(
    coordinator: BackgroundServer, tmp_path: Path, mismatch: dict[str, object]
) -> None:
    with pytest.raises(KeySchemeMismatch):
        NodeProcess(node_config(tmp_path, coordinator.url, **mismatch))


def test_node_on_redis_refuses_a_coordinator_on_http(
    coordinator: BackgroundServer, tmp_path: Path
) -> None:
    """A real node process whose events would go to a Redis stream the coordinator never reads
    exits non-zero before serving, naming both transports."""
    args = [
        sys.executable, "-m", "kvatlas.cli", "node", "--model-name", "m", "--num-layers", "1",
        "--num-kv-heads", "1", "--head-dim", "8", "--chunk-size", "16", "--dtype", "float32",
        "--l2", "none", "--port", str(free_port()), "--coordinator-url", coordinator.url,
        "--coordinator-event-reporting", "--event-transport", "redis",
        "--redis-url", "redis://127.0.0.1:1/0",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=120)  # a wide bound: today's bug is "serves forever"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"node kept running despite the transport mismatch:\n{out.decode()}")
    text = out.decode()
    assert proc.returncode != 0, text
    assert "event transport mismatch" in text and "redis" in text and "http" in text, text


def test_node_refuses_a_coordinator_reading_another_stream(tmp_path: Path) -> None:
    config = node_config(
        tmp_path, "http://127.0.0.1:1", coordinator_event_reporting=True,
        event_transport="redis", redis_url="redis://127.0.0.1:1/0", event_stream="a",
    )  # fmt: skip
    health = {"hash_scheme": "blake3", "chunk_size": 16, "event_transport": "redis"}
    with pytest.raises(TransportMismatch, match=r"--event-stream a.*--event-stream b"):
        check_coordinator_compatible(config, HealthReply(**health, event_stream="b"))
    check_coordinator_compatible(config, HealthReply(**health, event_stream="a"))


def test_blend_lookup_off_at_the_coordinator_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        BackgroundServer(
            CoordinatorConfig(port=free_port(), chunk_size=16, enable_blend_lookup=False)
        ) as off,
        caplog.at_level(logging.WARNING, logger="kvatlas.node"),
    ):
        process = NodeProcess(node_config(tmp_path, off.url, coordinator_event_reporting=True))
        process.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        "blend lookup" in m and "enable-blend-lookup" in m and "off" in m and "on" in m
        for m in warnings
    ), warnings


def test_url_without_event_reporting_is_not_configured(
    coordinator: BackgroundServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvatlas.node"):
        process = NodeProcess(
            node_config(tmp_path, coordinator.url, coordinator_event_reporting=False)
        )
    try:
        assert (
            process.sink is None and process.node.fleet is None and process.node.blend.fleet is None
        )
        assert "treated as not configured" in caplog.text
    finally:
        process.close()


@pytest.mark.parametrize(("reporting", "mode"), [(False, "lookup only"), (True, "fleet")])
def test_instances_say_whether_a_node_reports_events(
    coordinator: BackgroundServer, tmp_path: Path, reporting: bool, mode: str
) -> None:
    """A node with a coordinator URL but no event reporting registers (it is alive) but holds
    nothing the coordinator knows of: GET /instances says "lookup only"."""
    config = node_config(
        tmp_path, coordinator.url, coordinator_event_reporting=reporting, instance_id="n2"
    )
    process = NodeProcess(config)
    try:
        listed = httpx.get(f"{coordinator.url}/instances").json()["instances"]
        rows = {r["instance_id"]: r for r in listed}
        assert rows["n2"]["alive"] is True
        assert rows["n2"]["metadata"]["mode"] == mode
    finally:
        process.close()


def test_reporting_node_registers_and_advertises_its_peer_url(
    coordinator: BackgroundServer, tmp_path: Path
) -> None:
    config = node_config(
        tmp_path, coordinator.url, coordinator_event_reporting=True, instance_id="n1"
    )
    process = NodeProcess(config)
    try:
        rows = {r.instance_id: r for r in coordinator.service.instances_view()}
        registration = rows["n1"].registration
        assert registration is not None
        assert registration.p2p_advertised_url == f"http://127.0.0.1:{config.port}"
        assert process.sink is not None and process.node.blend.fleet is not None
    finally:
        process.close()
    rows = {r.instance_id: r for r in coordinator.service.instances_view()}
    assert "n1" not in rows  # deregistered on close
