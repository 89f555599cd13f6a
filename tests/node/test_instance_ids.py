"""Instance ids name directories under ``--l2-path`` (issue 16, item 9): one rule everywhere
(the salt rule, non-empty, not ``.``/``..``), checked at the node's config, on the id a
coordinator assigns, at the coordinator's registration, and an L2 directory resolved strictly
inside its root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvatlas.asgi_thread import ThreadedServer
from kvatlas.client import CoordinatorError
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.errors import InvalidInput
from kvatlas.keys import check_instance_id
from kvatlas.node.config import NodeConfig
from kvatlas.node.l2 import instance_dir
from kvatlas.node.server import NodeProcess

BAD_IDS = ["", ".", "..", "../escaped", "a/b", "/abs", "a\\b", "a@b", "a\x00b", "x" * 129]


@pytest.mark.parametrize("good", ["node-a", "inst-0123abcd", "host:9400", "a.b", "..a", "x" * 128])
def test_good_ids_pass(good: str) -> None:
    assert check_instance_id(good) == good


@pytest.mark.parametrize("bad", [*BAD_IDS, 5, None])
def test_bad_ids_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="instance_id"):
        check_instance_id(bad)


def test_instance_dir_stays_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert instance_dir(root, "node-a") == (root / "node-a").resolve()
    for bad in BAD_IDS:
        with pytest.raises(InvalidInput):
            instance_dir(root, bad)
    root.mkdir()
    (root / "link").symlink_to(tmp_path)  # a valid name whose path leads out of the root
    with pytest.raises(InvalidInput, match="not inside"):
        instance_dir(root, "link")


def test_node_config_refuses_an_escaping_instance_id() -> None:
    with pytest.raises(ValueError, match="instance_id"):
        NodeConfig(instance_id="../escaped")


def test_node_process_with_an_escaping_id_refuses_to_start(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvatlas.cli", "node", "--instance-id", "../escaped",
         "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--l2", "fs", "--l2-path", str(root), "--port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the node started with --instance-id ../escaped")
    assert proc.returncode != 0 and b"instance_id" in err
    assert not (tmp_path / "escaped").exists()


class FakeCoordinator(ThreadedServer):
    """Answers registration with an id that would escape the node's L2 root."""

    def __init__(self, assigned: str) -> None:
        app = FastAPI()

        @app.get("/healthz")
        async def health() -> dict[str, Any]:
            return {"hash_scheme": NodeConfig().scheme.name, "chunk_size": NodeConfig().chunk_size}

        @app.post("/instances")
        async def register() -> dict[str, Any]:
            return {"instance_id": assigned, "re_registered": False}

        super().__init__(app, port=free_port(), name="fake-coordinator")


def test_an_escaping_id_assigned_by_a_coordinator_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    fake = FakeCoordinator("../../escaped")
    fake.start()
    try:
        config = NodeConfig(l2="fs", l2_path=root, coordinator_url=fake.url, port=free_port())
        with pytest.raises(CoordinatorError, match="instance id"):
            NodeProcess(config)
    finally:
        fake.stop()
    assert not (tmp_path / "escaped").exists()


def test_the_coordinator_refuses_to_register_an_escaping_id() -> None:
    with BackgroundServer(CoordinatorConfig(port=free_port())) as server:
        for bad in ("../escaped", "..", "a/b"):
            r = httpx.post(f"{server.url}/instances", json={"instance_id": bad})
            assert r.status_code == 422, (bad, r.text)
        assert httpx.post(f"{server.url}/instances", json={"instance_id": "ok"}).status_code == 200
