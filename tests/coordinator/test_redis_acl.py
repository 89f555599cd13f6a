"""Issue 25 item 10: the documented Redis ACL users work. A real redis-server loads exactly
``deploy/redis/users.acl`` (``--aclfile``; only the password-hash placeholders filled in);
two coordinator replicas, each as its own coordinator user, and a cache node as the emit user
run with auth on through a retention pass and a restart of one replica: every entry reaches
both replicas (the second never saw the node register: the signature stands for it), the
stream is trimmed, and neither a process log nor Redis's ``ACL LOG`` shows a refusal."""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from kvatlas.coordinator.server import free_port
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service
from tests.conftest import HTTP, wait_for
from tests.coordinator.security_support import ADMIN, bearer, token, write_tokens
from tests.helpers import TOY_LAYOUT

ACL_FILE = Path(__file__).parents[2] / "deploy" / "redis" / "users.acl"
STREAM = "kvatlas:events"  # the stream the ACL file names
C = 16
NODE_TOKEN = token("node-1")
NODE_FLAGS = [
    "--model-name", "toy", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
    "--chunk-size", str(C), "--dtype", "float32", "--l2", "none", "--log-level", "info",
]  # fmt: skip
LAYOUT = TOY_LAYOUT


def password(user: str) -> str:
    return f"{user}-password-" + "p" * 24


def render_acl(path: Path) -> dict[str, str]:
    """The repository's ACL file with each ``<ROLE>_PASSWORD_SHA256`` replaced by the SHA-256
    of a password (nothing else changes); returns each user's password."""
    text = ACL_FILE.read_text()
    users = re.findall(r"^user (\S+) on #([A-Z0-9]+_PASSWORD_SHA256)\b", text, re.M)
    assert {u for u, _ in users} == {"kvatlas-admin", "kvatlas-emit", "kvatlas-coord-1",
                                     "kvatlas-coord-2"}  # fmt: skip
    for user, placeholder in users:
        text = text.replace(placeholder, hashlib.sha256(password(user).encode()).hexdigest())
    path.write_text(text)
    return {u: password(u) for u, _ in users}


class Fleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.redis_port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Path] = []

    def url(self, user: str) -> str:
        return f"redis://{user}:{password(user)}@127.0.0.1:{self.redis_port}/0"

    def spawn(self, name: str, args: list[str], http_url: str) -> None:
        log = self.root / f"{name}-{len(self.logs)}.log"
        self.logs.append(log)
        self.procs[name] = spawn_service(["-m", "kvatlas.cli", *args], http_url, log=log)

    def coordinator(self, replica: int, port: int, tokens: Path) -> None:
        args = [
            "coordinator", "--port", str(port), "--chunk-size", str(C),
            "--event-transport", "redis", "--redis-url", self.url(f"kvatlas-coord-{replica}"),
            "--replica-id", f"r{replica}", "--consumer-heartbeat-s", "2",
            "--snapshot-path", str(self.root / f"r{replica}.snap"),
            "--snapshot-interval", "0.3", "--auth-token-file", str(tokens),
            "--log-level", "info", "--log-format", "text",
        ]  # fmt: skip
        self.spawn(f"coord-{replica}", args, f"http://127.0.0.1:{port}")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    render_acl(tmp_path / "users.acl")
    server = subprocess.Popen(
        [
            "redis-server", "--port", str(f.redis_port), "--bind", "127.0.0.1",
            "--dir", str(tmp_path), "--save", "", "--appendonly", "no",
            "--aclfile", str(tmp_path / "users.acl"),
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    admin = redis.Redis.from_url(f.url("kvatlas-admin"))
    try:
        assert wait_for(lambda: _pings(admin), timeout=20)
        yield f
    finally:
        for proc in f.procs.values():
            proc.terminate()
        for proc in f.procs.values():
            proc.wait(timeout=30)
        admin.close()
        server.terminate()
        server.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _keys(url: str) -> int:
    r = HTTP.get(f"{url}/directory/stats", headers=bearer(ADMIN), timeout=10)
    assert r.status_code == 200, r.text
    keys: int = r.json()["keys"]
    return keys


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=bearer(ADMIN), timeout=10).text
    pattern = rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$"
    return {labels or "": float(v) for labels, v in re.findall(pattern, text, re.M)}


def _ready(url: str) -> bool:
    try:
        return HTTP.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_fleet_runs_under_the_documented_acl_file(fleet: Fleet) -> None:
    tokens = write_tokens(
        fleet.root / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": NODE_TOKEN, "roles": ["emit", "lookup"], "instance_ids": ["node-1"]},
    )
    node_token = fleet.root / "node-token"
    node_token.write_text(NODE_TOKEN)
    node_token.chmod(0o600)
    p1, p2, pn = free_port(), free_port(), free_port()
    c1, c2 = f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"
    fleet.coordinator(1, p1, tokens)
    fleet.coordinator(2, p2, tokens)
    node = [
        "node", "--port", str(pn), "--instance-id", "node-1", "--coordinator-url", c1,
        "--coordinator-event-reporting", "--coordinator-token-file", str(node_token),
        "--event-transport", "redis", "--redis-url", fleet.url("kvatlas-emit"), *NODE_FLAGS,
    ]  # fmt: skip
    fleet.spawn("node", node, f"http://127.0.0.1:{pn}")
    engine = NodeEngineClient(f"http://127.0.0.1:{pn}", LAYOUT)
    model = ToyRopeModel(LAYOUT)
    rng = np.random.default_rng(7)
    admin = redis.Redis.from_url(fleet.url("kvatlas-admin"))
    try:
        first = rng.integers(0, 500, 3 * C).astype(np.uint32)
        assert engine.store(first, model.kv_chunks(first), request_id="s1") == 3
        for url in (c1, c2):  # replica 2 admits the node it never saw register
            assert wait_for(lambda url=url: _keys(url) == 3, timeout=60), url
            assert wait_for(lambda url=url: _ready(url), timeout=60), url

        # a retention pass: both replicas recorded their snapshots' positions and trimmed
        assert wait_for(lambda: _trims(c1) + _trims(c2) > 0, timeout=60)
        recorded = admin.hgetall(f"{STREAM}:replicas")
        assert set(recorded) == {b"kvatlas-r1", b"kvatlas-r2"}, recorded

        fleet.stop("coord-1")  # a restart of replica 1 (its shutdown snapshot, then back)
        second = rng.integers(0, 500, 2 * C).astype(np.uint32)
        assert engine.store(second, model.kv_chunks(second), request_id="s2") == 2
        fleet.coordinator(1, p1, tokens)
        for url in (c1, c2):
            assert wait_for(lambda url=url: _keys(url) == 5, timeout=60), url
        assert wait_for(lambda: _ready(c1), timeout=60)
        before = _trims(c1) + _trims(c2)
        recorded_r1 = admin.hget(f"{STREAM}:replicas", "kvatlas-r1")
        third = rng.integers(0, 500, 1 * C).astype(np.uint32)
        assert engine.store(third, model.kv_chunks(third), request_id="s3") == 1
        assert wait_for(lambda: _keys(c1) == 6 and _keys(c2) == 6, timeout=60)
        # retention after the restart: replica 1 records its snapshot's position again, and
        # the stream is trimmed. Whichever replica records last trims (MINID to the older of
        # the two records); the other then finds nothing left to remove, so the trimmed
        # entries are counted by one replica or the other, not always by replica 1.
        assert wait_for(
            lambda: admin.hget(f"{STREAM}:replicas", "kvatlas-r1") != recorded_r1, timeout=60
        )
        assert wait_for(lambda: _trims(c1) + _trims(c2) > before, timeout=60)

        # cache control, kept in Redis under <stream>:cache:* and shared by both replicas
        _cache_control(c1, c2, [int(t) for t in first], [int(t) for t in second])

        for url in (c1, c2):
            errors = _metric(url, "kvatlas_stream_errors_total")
            assert errors == {}, (url, errors)  # no redis, retention or group error
            assert _metric(url, "kvatlas_stream_rejected_entries_total") == {}, url
        acl_log: list[Any] = admin.acl_log()  # type: ignore[assignment]
        assert acl_log == [], acl_log  # no command, key or auth refused
        # and nothing granted beyond what the roles issued: every command the file grants
        # the emit and coordinator users was called during this run
        called = {name.removeprefix("cmdstat_") for name in admin.info("commandstats")}
        assert _granted() <= called, _granted() - called
    finally:
        engine.close()
        admin.close()
        for name in list(fleet.procs):
            fleet.stop(name)
    for log in fleet.logs:
        text = log.read_text()
        assert "NOPERM" not in text and "no permissions" not in text, (log.name, text[-3000:])


def _cache_control(c1: str, c2: str, first: list[int], second: list[int]) -> None:
    """Pins, quotas and a delete command through both replicas (every script and command of
    the shared store runs): what one replica did, the other answers."""
    admin = bearer(ADMIN)

    def call(method: str, url: str, **kw: Any) -> Any:
        r = httpx.request(method, url, headers=admin, timeout=30, **kw)
        assert r.status_code == 200, (method, url, r.status_code, r.text)
        return r.json()

    doc = {"model_name": "toy", "world_size": 1, "token_ids": second}
    call("POST", f"{c1}/cache/pins", json=doc)
    call("POST", f"{c2}/cache/pins", json={**doc, "token_ids": second[:C]})
    assert [p["pin_count"] for p in call("GET", f"{c2}/cache/pins")["pins"]] == [2, 1]
    call("DELETE", f"{c2}/cache/pins", json=doc)
    assert [p["pin_count"] for p in call("GET", f"{c1}/cache/pins")["pins"]] == [1]
    call("PUT", f"{c1}/quota/tenant", json={"limit_gb": 1.0})
    assert call("GET", f"{c2}/quota/tenant")["quota_exists"] is True
    call("DELETE", f"{c2}/quota/tenant")
    reply = call(
        "POST",
        f"{c1}/cache/delete",
        json={**doc, "token_ids": first, "instance_id": "node-1", "tier": "l1"},
    )
    assert reply["affected"] == 3, reply
    # an instance this replica knows without an MP-server port: a prefetch for it waits for a
    # replica that can reach it, and this one lets its lease go (DEL)
    call("POST", f"{c1}/instances", json={"instance_id": "no-port", "ip": "127.0.0.1"})
    r = httpx.post(f"{c1}/cache/prefetches", headers=admin, timeout=30,
                   json={**doc, "instance_id": "no-port"})  # fmt: skip
    assert r.status_code == 502 and r.json()["request_id"], r.text
    pattern = r'^kvatlas_cache_commands\{kind="delete",state="completed"\} 1\.0$'
    for url in (c1, c2):  # delivered by one, finished from the events, seen by both
        assert wait_for(lambda url=url: re.search(pattern, _text(url), re.M), timeout=60), url


def _text(url: str) -> str:
    return HTTP.get(f"{url}/metrics", headers=bearer(ADMIN), timeout=10).text


def _granted() -> set[str]:
    """The commands ``deploy/redis/users.acl`` grants its emit and coordinator users."""
    lines = [line for line in ACL_FILE.read_text().splitlines() if "kvatlas-admin" not in line]
    return set(re.findall(r" \+([a-z|]+)", "\n".join(lines)))


def _trims(url: str) -> float:
    return sum(_metric(url, "kvatlas_stream_trimmed_entries_total").values())
