"""The coordinator calls nodes that have auth on with ``--node-token-file``'s token: a
prefetch to a ``kvatlas node`` with ``--auth-token-file`` is submitted (202) with it, and
refused by the node (the coordinator answers 502, the command failed) without it — the case
where every cache-control command to an authenticated fleet failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.cli import mp_servers
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.processes import spawn_service, stop
from tests.helpers import C, toy_node_flags, write_tokens

ADMIN = "z" * 32 + "-admin-token"


@pytest.fixture(scope="module")
def node_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tokens = write_tokens(
        tmp_path_factory.mktemp("node") / "tokens.json",
        {"token": ADMIN, "roles": ["admin"], "name": "coordinator"},
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn_service(
        ["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "node-a",
         *toy_node_flags(C), "--auth-token-file", str(tokens)],
        url,
    )  # fmt: skip
    try:
        yield url
    finally:
        stop([proc])


def prefetch(config: CoordinatorConfig, node_url: str) -> httpx.Response:
    with BackgroundServer(config, mp_servers=mp_servers(config)) as server:
        port = int(node_url.rsplit(":", 1)[1])
        registration = {"instance_id": "node-a", "ip": "127.0.0.1", "http_port": port}
        assert httpx.post(f"{server.url}/instances", json=registration).status_code == 200
        body = {"instance_id": "node-a", "model_name": "toy", "world_size": 1,
                "token_ids": list(range(1, 2 * C + 1))}  # fmt: skip
        return httpx.post(f"{server.url}/cache/prefetches", json=body, timeout=30)


def test_the_node_token_reaches_a_node_with_auth(tmp_path: Path, node_url: str) -> None:
    secret = tmp_path / "node-token"
    secret.write_text(ADMIN)
    secret.chmod(0o600)
    config = CoordinatorConfig(port=free_port(), chunk_size=C, node_token_file=secret)
    reply = prefetch(config, node_url)
    assert reply.status_code == 202, reply.text
    assert reply.json()["status"] == "submitted"


def test_without_it_the_node_refuses_and_the_coordinator_says_so(node_url: str) -> None:
    reply = prefetch(CoordinatorConfig(port=free_port(), chunk_size=C), node_url)
    assert reply.status_code == 502, reply.text
    assert "401" in reply.text or "token" in reply.text.lower(), reply.text


def test_an_exposed_node_token_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "node-token"
    secret.write_text(ADMIN)
    secret.chmod(0o644)
    with pytest.raises(ValueError, match="--node-token-file"):
        CoordinatorConfig(node_token_file=secret)
