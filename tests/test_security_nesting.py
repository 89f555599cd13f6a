"""Issue 25 item 11: a deeply nested body (4 KB of ``[[[[…``, as the whole body or as a field;
JSON, and msgpack where a route takes msgpack) is a 4xx on every body route of the coordinator
and the node, counted in ``kvatlas_http_refused_total{reason="nested_too_deep"}``, with no
traceback in the service's log. Real processes over loopback."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.processes import spawn_service, stop

DEPTH = 4096
DEEP_JSON = b"[" * DEPTH + b"]" * DEPTH
DEEP_MSGPACK = b"\x91" * DEPTH + b"\xc0"  # a one-element array in a one-element array ...
JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}
NODE = ["--model-name", "toy", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
        "--chunk-size", "16", "--dtype", "float32", "--l2", "none"]  # fmt: skip


def _field(name: str) -> bytes:
    return b'{"' + name.encode() + b'": ' + DEEP_JSON + b"}"


COORDINATOR_BODIES = [
    ("POST", "/directory/lookup", DEEP_JSON, JSON),
    ("POST", "/directory/lookup", _field("token_ids"), JSON),
    ("POST", "/directory/lookup", _field("keys"), JSON),
    ("POST", "/directory/lookup", _field("other"), JSON),
    ("POST", "/directory/blend-lookup", _field("token_ids"), JSON),
    ("POST", "/route/score", _field("instances"), JSON),
    ("POST", "/events", DEEP_JSON, JSON),
    ("POST", "/events", _field("batches"), JSON),
    ("POST", "/events", DEEP_MSGPACK, MSGPACK),
    ("PUT", "/instances/n1/report", DEEP_JSON, JSON),
    ("PUT", "/instances/n1/report", _field("counters"), JSON),
    ("POST", "/instances/n1/digest", DEEP_JSON, JSON),
    ("POST", "/instances/n1/digest", _field("tiers"), JSON),
    ("POST", "/instances", _field("metadata"), JSON),
    ("PUT", "/config/chunk-size", DEEP_JSON, JSON),
]
NODE_BODIES = [
    ("POST", "/engine/lookup", DEEP_JSON, JSON),
    ("POST", "/engine/lookup", DEEP_MSGPACK, MSGPACK),
    ("POST", "/engine/store", DEEP_MSGPACK, MSGPACK),
    ("POST", "/engine/blend-lookup", _field("mm_items"), JSON),
    ("POST", "/peer/kv", DEEP_JSON, JSON),
]


class Service:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.url, self.log = proc, f"http://127.0.0.1:{port}", log

    def refused_deep(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found = re.search(r'kvatlas_http_refused_total\{reason="nested_too_deep"\} (\S+)', text)
        assert found, text[-400:]
        return float(found.group(1))


def _spawn(tmp: Path, service: str, *flags: str) -> Service:
    port, log = free_port(), tmp / f"{service}.log"
    args = ["-m", "kvatlas.cli", service, "--port", str(port), "--log-level", "info", *flags]
    return Service(spawn_service(args, f"http://127.0.0.1:{port}", log=log), port, log)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = _spawn(tmp_path_factory.mktemp("deep"), "coordinator", "--chunk-size", "16")
    yield service
    stop([service.proc])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = _spawn(tmp_path_factory.mktemp("deep"), "node", *NODE)
    yield service
    stop([service.proc])


def _check(service: Service, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
    before = service.refused_deep()
    r = httpx.request(method, service.url + path, content=body, headers=headers, timeout=30)
    assert r.status_code in (400, 413, 422), (r.status_code, r.text[:300])
    assert service.refused_deep() >= before  # counted when a decoder gave up on the depth
    log = service.log.read_text()
    assert "Traceback" not in log and "RecursionError" not in log, log[-2000:]


@pytest.mark.parametrize(("method", "path", "body", "headers"), COORDINATOR_BODIES)
def test_coordinator_refuses_deep_bodies(
    coordinator: Service, method: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    _check(coordinator, method, path, body, headers)


@pytest.mark.parametrize(("method", "path", "body", "headers"), NODE_BODIES)
def test_node_refuses_deep_bodies(
    node: Service, method: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    _check(node, method, path, body, headers)


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        # decoded without a type, to the depth (3 KB: within the route's 4 KiB)
        ("/instances/n1/report", b"[" * 1500 + b"]" * 1500, JSON),
        ("/directory/lookup", _field("other"), JSON),  # an unknown field, skipped to the depth
    ],
)
def test_bodies_a_decoder_cannot_follow_are_counted(
    coordinator: Service, path: str, body: bytes, headers: dict[str, str]
) -> None:
    """Where a decoder follows the nesting until it gives up, the refusal is counted (typed
    decoders refuse the first level that is not what they expect: a plain 422)."""
    before = coordinator.refused_deep()
    method = "PUT" if path.endswith("/report") else "POST"
    r = httpx.request(method, coordinator.url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == 422, r.text[:300]
    assert r.json()["detail"] == "request body nests too deeply"
    assert coordinator.refused_deep() == before + 1
