"""Issue 25 item 13: the coordinator and the node check tokens by one rule (``kvatlas/auth.py``):
a token file group or others may read is refused, a token shorter than 32 characters is
refused, and with auth on ``/docs`` and ``/openapi.json`` need a valid token unless
``--public-docs``. Each against a real process of each service."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.auth import DOCS_PATHS, MIN_TOKEN_CHARS
from kvatlas.processes import spawn_service, stop
from tests.helpers import write_tokens

TOKEN = "one-rule-token-" + "x" * 32
NODE = ["--model-name", "toy", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
        "--chunk-size", "16", "--dtype", "float32", "--l2", "none"]  # fmt: skip
SERVICES = ("coordinator", "node")


ROUTER = ["--coordinator-url", "http://127.0.0.1:9", "--engine", "e=http://127.0.0.1:9"]


def _args(service: str, port: int, *flags: str) -> list[str]:
    extra = {"node": NODE, "router": ROUTER}.get(service, ["--chunk-size", "16"])
    return ["-m", "kvatlas.cli", service, "--port", str(port), "--log-level", "warning",
            *extra, *flags]  # fmt: skip


def _token_file(path: Path, token: str, mode: int) -> Path:
    return write_tokens(path, {"token": token, "role": "admin"}, mode=mode)


def _start(service: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run the service expecting it to refuse to start (a hang detector bounds the wait)."""
    return subprocess.run(
        [sys.executable, *_args(service, free_port(), *flags)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("service", (*SERVICES, "router"))
def test_a_token_file_others_may_read_is_refused(service: str, tmp_path: Path) -> None:
    tokens = _token_file(tmp_path / "tokens.json", TOKEN, 0o644)
    done = _start(service, "--auth-token-file", str(tokens))
    assert done.returncode != 0
    assert "chmod 600" in done.stderr, done.stderr[-2000:]


def test_the_routers_coordinator_token_file_follows_the_rule(tmp_path: Path) -> None:
    """The router's own secret file: 0644 refused, then a short token refused."""
    secret = tmp_path / "coordinator.token"
    secret.write_text(TOKEN)
    secret.chmod(0o644)
    done = _start("router", "--coordinator-token-file", str(secret))
    assert done.returncode != 0 and "chmod 600" in done.stderr, done.stderr[-2000:]
    secret.write_text("t" * (MIN_TOKEN_CHARS - 1))
    secret.chmod(0o600)
    done = _start("router", "--coordinator-token-file", str(secret))
    assert done.returncode != 0 and f">= {MIN_TOKEN_CHARS} characters" in done.stderr


@pytest.mark.parametrize("service", (*SERVICES, "router"))
def test_a_short_token_is_refused(service: str, tmp_path: Path) -> None:
    assert MIN_TOKEN_CHARS == 32
    tokens = _token_file(tmp_path / "tokens.json", "t" * (MIN_TOKEN_CHARS - 1), 0o600)
    done = _start(service, "--auth-token-file", str(tokens))
    assert done.returncode != 0
    assert f">= {MIN_TOKEN_CHARS} characters" in done.stderr, done.stderr[-2000:]


@pytest.fixture(params=[(s, public) for s in SERVICES for public in (False, True)])
def running(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, bool]]:
    service, public = request.param
    tokens = _token_file(tmp_path / "tokens.json", TOKEN, 0o600)
    port = free_port()
    flags = ["--auth-token-file", str(tokens), *(["--public-docs"] if public else [])]
    proc = spawn_service(_args(service, port, *flags), f"http://127.0.0.1:{port}")
    yield f"http://127.0.0.1:{port}", public
    stop([proc])


def test_docs_need_a_token_with_auth_unless_public(running: tuple[str, bool]) -> None:
    url, public = running
    assert {"/docs", "/openapi.json"} <= DOCS_PATHS
    for path in ("/docs", "/openapi.json"):
        anonymous = httpx.get(url + path, timeout=30)
        assert anonymous.status_code == (200 if public else 401), (path, anonymous.text[:200])
        known = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert known.status_code == 200, (path, known.text[:200])
    unknown = httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer " + "u" * 40})
    assert unknown.status_code == (200 if public else 401)
