"""Issue 16, node side, against real ``kvatlas node`` processes: with ``--auth-token-file`` the
engine API needs an engine token bound to the call's salt and the peer API a peer token; the
engine API can have a listener of its own; request ids are no capability across tokens (the
two attacks of item 3); ``/peer/kv`` never returns token ids; bodies and held trackers are
bounded; secrets come from private files or the environment (item 13)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.node.chunk_digest import tokens_digest
from kvatlas.node.config import NodeConfig, add_arguments, config_from_args
from kvatlas.node.engine_client import EngineCallError, NodeEngineClient
from kvatlas.node.peer import PEER_KV_PATH, PeerClient, max_chunk_bytes
from kvatlas.node.server import announce_security
from kvatlas.node.stored_chunk import decode_chunk
from kvatlas.processes import spawn_service
from tests.conftest import wait_for
from tests.helpers import write_tokens

C = 16
MODEL = ["--model-name", "toy", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
         "--chunk-size", str(C), "--dtype", "float32", "--l2", "none"]  # fmt: skip
LAYOUT = NodeConfig(
    model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32"
).layout
ENGINE_A, ENGINE_B = "a" * 32 + "-engine-token", "b" * 32 + "-engine-token"
PEER, ADMIN = "p" * 32 + "-peer-token", "z" * 32 + "-admin-token"
TRACKER_BUDGET = 64 * 1024


def write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def token_file(tmp: Path) -> Path:
    return write_tokens(
        tmp / "tokens.json",
        {"token": ENGINE_A, "roles": ["engine"], "cache_salts": ["tenant-a"], "name": "a"},
        {"token": ENGINE_B, "roles": ["engine"], "cache_salts": ["tenant-b"], "name": "b"},
        {"token": PEER, "roles": ["peer"], "name": "peer"},
        {"token": ADMIN, "roles": ["admin"], "name": "admin"},
    )


class Node:
    def __init__(self, proc: subprocess.Popen[bytes], peer_port: int, engine_port: int) -> None:
        self.proc = proc
        self.peer_url = f"http://127.0.0.1:{peer_port}"
        self.engine_url = f"http://127.0.0.1:{engine_port}"

    def engine(self, token: str | None) -> NodeEngineClient:
        return NodeEngineClient(self.engine_url, LAYOUT, token=token)

    def stats(self) -> dict[str, Any]:
        with self.engine(ADMIN) as client:
            return client.stats()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("auth")
    peer_port, engine_port = free_port(), free_port()
    args = [
        "-m", "kvatlas.cli", "node", *MODEL, "--port", str(peer_port),
        "--engine-port", str(engine_port), "--auth-token-file", str(token_file(tmp)),
        "--tracker-memory-bytes", str(TRACKER_BUDGET), "--max-query-tokens", "4096",
        "--log-level", "warning",
    ]  # fmt: skip
    proc = spawn_service(args, f"http://127.0.0.1:{peer_port}")
    try:
        yield Node(proc, peer_port, engine_port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def prompt(seed: int, n_chunks: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n_chunks * C).astype(np.uint32)


def kv(n_chunks: int, value: float) -> list[np.ndarray]:
    return [np.full(LAYOUT.shape, value, dtype=np.float32) for _ in range(n_chunks)]


def post(url: str, path: str, token: str | None, **fields: Any) -> httpx.Response:
    headers = {"content-type": "application/msgpack"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return httpx.post(url + path, content=msgspec.msgpack.encode(fields), headers=headers)


# ---------------------------------------------------------------------------- item 2


@pytest.mark.parametrize(
    ("path", "token", "status"),
    [
        ("/engine/lookup", None, 401),
        ("/engine/lookup", "x" * 40, 401),
        ("/engine/lookup", PEER, 403),  # a peer token is no engine token
        ("/engine/stats", None, 401),
    ],
)
def test_engine_api_needs_an_engine_token(
    node: Node, path: str, token: str | None, status: int
) -> None:
    if path == "/engine/stats":
        r = httpx.get(node.engine_url + path, headers={"accept": "application/msgpack"})
    else:
        r = post(node.engine_url, path, token, tokens=prompt(0).tobytes())
    assert r.status_code == status, r.content
    assert msgspec.msgpack.decode(r.content)["detail"]


def test_node_stats_are_for_salt_unbound_tokens(node: Node) -> None:
    with node.engine(ENGINE_A) as a, pytest.raises(EngineCallError) as refused:
        a.stats()
    assert refused.value.reply_status == 403
    assert node.stats()["instance_id"]  # admin


def test_the_inventory_lists_what_l1_holds_for_salt_unbound_tokens_only(node: Node) -> None:
    """``GET /engine/inventory`` (the soak's ground truth) reads the L1 itself: a store shows
    up with its tier and backend; a salt-bound engine token may not list every tenant's keys."""
    tokens = prompt(41)
    with node.engine(ENGINE_A) as a:
        assert a.store(tokens, kv(2, 1.0), cache_salt="tenant-a") == 2
        with pytest.raises(EngineCallError) as refused:
            a.inventory()
    assert refused.value.reply_status == 403
    rank = pack_kv_rank(1, 0, 1, 0)
    stored = {ObjectKey(h, "toy", rank, 0, "tenant-a") for h in chunk_hashes(tokens, C)}
    with node.engine(ADMIN) as admin:
        listed = admin.inventory()
    held = {ObjectKey.from_wire(p.key.as_dict()): (p.tier, p.backend) for p in listed}
    assert {k: held.get(k) for k in stored} == dict.fromkeys(stored, ("l1", "dram"))


def test_engine_token_is_bound_to_its_salts(node: Node) -> None:
    with node.engine(ENGINE_B) as b:
        with pytest.raises(EngineCallError) as refused:
            b.store(prompt(1), kv(2, 1.0), cache_salt="tenant-a", request_id="s")
        assert refused.value.reply_status == 403
        assert b.store(prompt(1), kv(2, 1.0), cache_salt="tenant-b") == 2
        with pytest.raises(EngineCallError) as refused:
            b.retrieve(prompt(1), cache_salt="")  # the empty salt is a namespace too
        assert refused.value.reply_status == 403


@pytest.mark.parametrize("token", [None, ENGINE_A])
def test_peer_api_needs_a_peer_token(node: Node, token: str | None) -> None:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(node.peer_url + PEER_KV_PATH, json={"keys": []}, headers=headers)
    assert r.status_code == (401 if token is None else 403)
    assert r.json()["detail"]


def test_each_api_is_served_only_on_its_own_listener(node: Node) -> None:
    r = post(node.peer_url, "/engine/lookup", ADMIN, tokens=prompt(0).tobytes())
    assert r.status_code == 404
    r = httpx.post(
        node.engine_url + PEER_KV_PATH,
        json={"keys": []},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 404
    assert httpx.get(node.engine_url + "/healthz").status_code == 200


def test_peer_reply_carries_a_token_digest_not_token_ids(node: Node) -> None:
    p = prompt(2)
    with node.engine(ENGINE_A) as a:
        assert a.store(p, kv(2, 2.0), cache_salt="tenant-a") == 2
    key = ObjectKey(chunk_hashes(p, C)[0], "toy", pack_kv_rank(1, 0, 1, 0), 0, "tenant-a")
    r = httpx.post(
        node.peer_url + PEER_KV_PATH,
        json={"keys": [key.to_wire()]},
        headers={"authorization": f"Bearer {PEER}"},
    )
    assert r.status_code == 200
    [record] = msgspec.msgpack.decode(r.content)
    chunk = decode_chunk(record["chunk"])
    assert chunk.key == key and chunk.tokens is None and chunk.token_offset == 0
    assert record["tokens_digest"] == tokens_digest(p[:C])
    assert p[:C].astype("<u4").tobytes() not in r.content  # no token ids anywhere in it


# ---------------------------------------------------------------------------- item 3


def test_retrieve_with_a_victims_in_flight_id_returns_nothing_of_theirs(node: Node) -> None:
    """Attack 1: A's request "victim-1" is in flight (looked up, KV stored under tenant-a);
    B retrieves with that id under any salt: refused for A's salt, nothing for its own, and
    A's tracker is untouched (not replaced, A's request goes on)."""
    p = prompt(3)
    replaced = node.stats()["trackers"]["replaced"]
    with node.engine(ENGINE_A) as a, node.engine(ENGINE_B) as b:
        assert a.store(p, kv(2, 3.0), cache_salt="tenant-a") == 2
        assert a.lookup(p, cache_salt="tenant-a") == 2 * C  # no id: nothing held
        a.lookup(p, cache_salt="tenant-a", request_id="victim-1")
        with pytest.raises(EngineCallError) as refused:
            b.retrieve([], cache_salt="tenant-a", request_id="victim-1")
        assert refused.value.reply_status == 403
        for toks in ([], p[:C], p, prompt(4)):
            got, sources = b.retrieve(toks, cache_salt="tenant-b", request_id="victim-1")
            assert got == [] and sources == {}
        assert node.stats()["trackers"]["replaced"] == replaced, "B replaced A's tracker"
        got, sources = a.retrieve(p, cache_salt="tenant-a", request_id="victim-1")
        assert len(got) == 2 and all(np.all(k == 3.0) for k in got)


def test_lookup_with_a_victims_future_id_does_not_capture_their_store(node: Node) -> None:
    """Attack 2: B looks up under the id A will use next; A's store under that id files A's
    KV under A's own prompt and salt, never under B's prompt."""
    p_a, p_b = prompt(5), prompt(6)
    replaced = node.stats()["trackers"]["replaced"]
    with node.engine(ENGINE_A) as a, node.engine(ENGINE_B) as b:
        for toks in ([], p_b):
            b.lookup(toks, cache_salt="tenant-b", request_id="victim-2")
        a.lookup(p_a[:C], cache_salt="tenant-a", request_id="victim-2")
        assert a.store(p_a, kv(2, 5.0), cache_salt="tenant-a", request_id="victim-2") == 2
        assert node.stats()["trackers"]["replaced"] == replaced, "A's store replaced B's"
        assert b.lookup(p_b, cache_salt="tenant-b") == 0
        assert b.retrieve(p_a, cache_salt="tenant-b")[0] == []
        got, _ = a.retrieve(p_a, cache_salt="tenant-a", request_id="after")
        assert len(got) == 2 and all(np.all(k == 5.0) for k in got)


# ---------------------------------------------------------------------------- item 6


def test_body_over_the_limit_is_413_and_a_token_is_checked_first(node: Node) -> None:
    big = b"\0" * 200_000  # > what a lookup of --max-query-tokens 4096 can need
    r = httpx.post(
        node.engine_url + "/engine/lookup",
        content=big,
        headers={"content-type": "application/msgpack", "authorization": f"Bearer {ENGINE_A}"},
    )
    assert r.status_code == 413 and msgspec.msgpack.decode(r.content)["detail"]
    r = httpx.post(node.engine_url + "/engine/lookup", content=big)
    assert r.status_code == 401
    toks = np.zeros(4097, dtype="<u4").tobytes()
    r = post(node.engine_url, "/engine/lookup", ENGINE_A, tokens=toks, cache_salt="tenant-a")
    assert r.status_code == 413


def test_held_trackers_stay_within_their_memory_budget(node: Node) -> None:
    with node.engine(ENGINE_A) as a:
        for i in range(40):  # 40 x 2048 tokens x 8 B = 640 KiB of trackers against 64 KiB
            a.lookup(prompt(100 + i, 2048 // C), cache_salt="tenant-a", request_id=f"held-{i}")
    trackers = node.stats()["trackers"]
    assert 0 < trackers["bytes"] <= trackers["memory_budget"] == TRACKER_BUDGET
    assert trackers["evicted"] > 0 and trackers["held"] < 40


# ---------------------------------------------------------------------------- item 13


def parse(argv: list[str], environ: dict[str, str] | None = None) -> NodeConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    layout = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"]  # never guessed
    return config_from_args(parser.parse_args([*layout, *argv]), environ or {})


@pytest.mark.parametrize("name", ["coordinator", "peer"])
def test_token_files_must_be_private_and_long(tmp_path: Path, name: str) -> None:
    flag = f"--{name}-token-file"
    good = write_private(tmp_path / "good", "t" * 32 + "\n")
    assert getattr(parse([flag, str(good)]), f"{name}_bearer")() == "t" * 32
    exposed = write_private(tmp_path / "exposed", "t" * 32)
    exposed.chmod(0o644)
    with pytest.raises(ValueError, match=r"group or others.*chmod 600"):
        parse([flag, str(exposed)])
    short = write_private(tmp_path / "short", "t" * 31)
    with pytest.raises(ValueError, match=">= 32 characters"):
        parse([flag, str(short)])
    env = {f"KVATLAS_{name.upper()}_TOKEN": "e" * 40}
    assert getattr(parse([], env), f"{name}_bearer")() == "e" * 40
    with pytest.raises(ValueError, match=">= 32 characters"):
        parse([], {f"KVATLAS_{name.upper()}_TOKEN": "short"})


def test_auth_token_file_must_be_private(tmp_path: Path) -> None:
    tokens = token_file(tmp_path)
    tokens.chmod(0o640)
    with pytest.raises(ValueError, match="group or others"):
        parse(["--auth-token-file", str(tokens)])


def test_token_on_the_command_line_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    config = parse(["--coordinator-token", "c" * 32])
    assert config.coordinator_bearer() == "c" * 32
    assert "process list" in caplog.text and "--coordinator-token-file" in caplog.text


def test_node_refuses_an_exposed_token_file(tmp_path: Path) -> None:
    exposed = tmp_path / "coordinator.token"
    exposed.write_text("t" * 40)
    exposed.chmod(0o644)
    args = [sys.executable, "-m", "kvatlas.cli", "node", *MODEL, "--port", str(free_port()),
            "--coordinator-token-file", str(exposed)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, timeout=120, env=dict(os.environ))
    assert done.returncode != 0
    assert b"chmod 600" in done.stderr and str(exposed).encode() in done.stderr


@pytest.mark.parametrize(
    ("flags", "exposed"),
    [
        ({"host": "0.0.0.0"}, "peer and engine APIs"),
        ({"engine_host": "10.1.2.3", "engine_port": 9401}, "engine API"),
    ],
)
def test_routable_bind_without_auth_is_warned_about(
    caplog: pytest.LogCaptureFixture, flags: dict[str, Any], exposed: str
) -> None:
    with caplog.at_level(logging.INFO, logger="kvatlas.node"):
        announce_security(NodeConfig(**flags))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and exposed in warnings[0] and "--auth-token-file" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvatlas.node"):
        announce_security(NodeConfig())  # loopback: no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_peer_secret_without_auth_is_warned_about(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """``--peer-token-file`` without ``--auth-token-file``: the node's calls to its peers carry
    its credential, but its own ``/peer`` routes check none (auth is off) — any caller reads
    its KV, also on loopback's neighbours; it logged only "auth disabled" (INFO on loopback),
    as if the peer secret protected it."""
    secret = tmp_path / "peer.secret"
    secret.write_text("s" * 40)
    secret.chmod(0o600)
    with caplog.at_level(logging.INFO, logger="kvatlas.node"):
        announce_security(NodeConfig(peer_token_file=secret))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "--peer-token-file" in warnings[0] and "--auth-token-file" in warnings[0]


# ---------------------------------------------------------------------------- peers


def test_peer_client_sends_its_token(node: Node) -> None:
    p = prompt(7)
    with node.engine(ENGINE_A) as a:
        assert a.store(p, kv(1, 7.0), cache_salt="tenant-a") == 1
    key = ObjectKey(chunk_hashes(p, C)[0], "toy", pack_kv_rank(1, 0, 1, 0), 0, "tenant-a")
    bound = max_chunk_bytes(LAYOUT)
    with PeerClient(node.peer_url, max_chunk_bytes=bound) as anonymous:
        refused = anonymous.fetch([key])  # 401: a miss, never an error
    assert refused.chunks == {} and refused.failure
    with PeerClient(node.peer_url, max_chunk_bytes=bound, token=PEER) as peer:
        got = peer.fetch([key]).chunks[key]
    assert np.all(got.chunk.kv == 7.0) and got.tokens_digest == tokens_digest(p[:C])


def test_fleet_with_auth_on_everywhere_serves_peer_kv(tmp_path: Path) -> None:
    """Two nodes with auth on and a peer token in a private file: B retrieves the chunks A
    holds from A's L1 (prefix and blend), authenticated as a peer; the engine APIs listen
    apart from the peer APIs."""
    coord_port = free_port()
    coord_url = f"http://127.0.0.1:{coord_port}"
    tokens = token_file(tmp_path)
    peer_token = write_private(tmp_path / "peer.token", PEER)
    procs = [
        spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(coord_port), "--chunk-size",
             str(C), "--enable-blend-lookup", "--log-level", "warning"],
            coord_url,
        )
    ]  # fmt: skip
    nodes: dict[str, Node] = {}
    try:
        for name in ("node-a", "node-b"):
            peer_port, engine_port = free_port(), free_port()
            args = [
                "-m", "kvatlas.cli", "node", *MODEL, "--port", str(peer_port),
                "--engine-port", str(engine_port), "--auth-token-file", str(tokens),
                "--peer-token-file", str(peer_token), "--instance-id", name,
                "--coordinator-url", coord_url, "--coordinator-event-reporting",
                "--coordinator-blend-timeout", "20", "--log-level", "warning",
            ]  # fmt: skip
            procs.append(spawn_service(args, f"http://127.0.0.1:{peer_port}"))
            nodes[name] = Node(procs[-1], peer_port, engine_port)
        p = prompt(8, 3)
        with nodes["node-a"].engine(ENGINE_A) as a, nodes["node-b"].engine(ENGINE_A) as b:
            assert a.store(p, kv(3, 8.0), cache_salt="tenant-a") == 3
            assert wait_for(lambda: b.lookup(p, cache_salt="tenant-a") == 3 * C, timeout=30)
            got, sources = b.retrieve(p, cache_salt="tenant-a")
            assert sources == {"peer_l1": 3} and all(np.all(k == 8.0) for k in got)
            answers: list[Any] = []
            assert wait_for(
                lambda: (
                    answers.append(b.blend_lookup(p, "blend", cache_salt="tenant-a"))
                    or answers[-1] is not None
                ),
                timeout=30,
            )
            segments = answers[-1]
            assert len(segments) == 3 and {s.source for s in segments} == {"fleet"}
            reply = b.blend_retrieve(p, "blend", segments, cache_salt="tenant-a")
            assert reply["misses"] == [] and reply["sources"] == {"peer_l1": 3}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
