"""The ZMQ surfaces as an attacker sees them (issue 25 items 1, 3, 5; docs/security.md, "KV
events"), against real coordinator processes and real sockets on loopback: the outward stream
shows only the salts the operator chose and, with auth on, leaves this host only with CurveZMQ;
a subscribed endpoint speaks for its own engines only (never a node, never another endpoint's
engine); topics cannot fill the nodes' capacity, and a refused topic is a counter, not a
traceback."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq
import zmq.auth

from kvatlas.client import CoordinatorClient, EventSink, HttpTransport
from kvatlas.coordinator.kv_events import KvEventsPublisher
from kvatlas.coordinator.kv_events.exposure import StreamExposure, is_local
from kvatlas.coordinator.server import free_port
from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    encode_batch,
    pack_seq,
)
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.coordinator.security_support import ADMIN, bearer, token, write_tokens
from tests.kv_events.router_view import RouterView

C = 16
VOCAB = 128_256


def rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, C), dtype=np.uint32)


def entries(block: np.ndarray, salt: str = "") -> list[CacheEntry]:
    keys = [
        ObjectKey(chunk_hashes(r, C)[0], "m", pack_kv_rank(1, 0, 1, 0), cache_salt=salt)
        for r in block
    ]
    return [CacheEntry(k, 64, r, 0) for k, r in zip(keys, block, strict=True)]


class Coordinator:
    def __init__(self, tmp: Path, *flags: str, tokens: Path | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / f"coordinator-{port}.log"
        auth = ["--auth-token-file", str(tokens)] if tokens else []
        self.proc = spawn_service(
            ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(C),
             "--kv-events-model", "llama", *auth, *flags],
            self.url, log=self.log,
        )  # fmt: skip
        self.headers = bearer(ADMIN) if tokens else {}

    def subscriber(self) -> dict[str, int]:
        health = HTTP.get(f"{self.url}/healthz", headers=self.headers).json()
        return dict(health.get("kv_events", {}).get("subscriber", {}))

    def holders(self, block: np.ndarray, salt: str = "") -> dict[str, int]:
        body = {"token_ids": block.ravel().tolist(), "model_name": "m", "cache_salt": salt}
        found = HTTP.post(f"{self.url}/directory/lookup", json=body, headers=self.headers).json()
        return {h["instance_id"]: h["chunks"] for h in found["prefix"]}

    def close(self) -> None:
        stop([self.proc])


class Attacker:
    """Whoever can publish at a subscribed endpoint: a plain PUB socket."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0

    def send(self, topic: str, *events: Any) -> None:
        payload = encode_batch(KVEventBatch(1.0, list(events), None))
        self.pub.send_multipart([topic.encode(), pack_seq(self.seq), payload])
        self.seq += 1

    def until(self, done: Any, topic: str, *events: Any) -> None:
        """Send (a new seq each time) until ``done()``: a PUB drops what it sends before the
        subscription took hold."""
        for _ in range(300):
            self.send(topic, *events)
            if wait_for(done, 0.1):
                return
        raise AssertionError("the coordinator never counted the attack")

    def close(self) -> None:
        self.pub.close(0)
        self.ctx.term()


def stored(tokens: list[int]) -> BlockStored:
    hashes = [bytes([i + 1]) * 32 for i in range(len(tokens) // C)]
    return BlockStored(hashes, None, tokens, C, medium="GPU")


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    yield a
    a.close()


# ---------------------------------------------------------------------------- item 3


def test_a_topic_naming_a_node_or_another_endpoints_engine_is_refused(
    tmp_path: Path, attacker: Attacker
) -> None:
    """``AllBlocksCleared`` on a topic naming a registered node (or another endpoint's engine)
    used to wipe its entries; now it is refused and counted, and nothing changes."""
    victim_engine = Attacker()  # pod-a's own endpoint, named for it
    coordinator = Coordinator(
        tmp_path,
        "--kv-events-subscribe", f"{attacker.endpoint},pod-a={victim_engine.endpoint}",
    )  # fmt: skip
    sink = EventSink("node-1", HttpTransport(coordinator.url), backoff_max=0.2)
    try:
        CoordinatorClient(coordinator.url).register("node-1")
        block = rows(1, 1)
        sink.emit("store", "l1", "dram", entries(block))
        assert sink.flush(30)
        engine_prompt = rows(2, 1).ravel().tolist()
        victim_engine.until(lambda: coordinator.subscriber().get("batches", 0) >= 1,
                            "", stored(engine_prompt))  # fmt: skip
        assert coordinator.holders(block) == {"node-1": 1}

        counted = coordinator.subscriber
        attacker.until(lambda: counted()["rejected_foreign"] >= 1, "kv@node-1@m",
                       AllBlocksCleared())  # fmt: skip
        attacker.until(lambda: counted()["rejected_foreign"] >= 2, "kv@pod-a@llama",
                       AllBlocksCleared())  # fmt: skip
        assert coordinator.holders(block) == {"node-1": 1}
        engine_tokens = np.array(engine_prompt, dtype=np.uint32).reshape(1, C)
        body = {"token_ids": engine_tokens.ravel().tolist(), "model_name": "llama"}
        found = httpx.post(f"{coordinator.url}/directory/lookup", json=body).json()
        assert [h["instance_id"] for h in found["prefix"]] == ["pod-a"]
        assert counted()["clears"] == 0
        # and a node may never take an engine's id
        refused = httpx.post(f"{coordinator.url}/instances", json={"instance_id": "pod-a"})
        assert refused.status_code == 409
    finally:
        sink.close(timeout=1)
        victim_engine.close()
        coordinator.close()


# ---------------------------------------------------------------------------- item 5


def test_topics_cannot_fill_the_nodes_capacity(tmp_path: Path, attacker: Attacker) -> None:
    """Distinct topics on one endpoint used to fill ``--max-instances`` (nodes then got 409 on
    their first batch); engines are capped per endpoint and never count against nodes."""
    coordinator = Coordinator(tmp_path, "--max-instances", "3",
                              "--kv-events-subscribe", attacker.endpoint)  # fmt: skip
    sinks: list[EventSink] = []
    try:
        prompt = rows(3, 1).ravel().tolist()
        attacker.until(lambda: coordinator.subscriber().get("batches", 0) >= 1,
                       "kv@engine-0@llama", stored(prompt))  # fmt: skip
        for i in range(1, 40):
            attacker.send(f"kv@engine-{i}@llama", stored(prompt))
        assert wait_for(lambda: coordinator.subscriber()["rejected_engine_cap"] >= 39)
        assert coordinator.subscriber()["engines"] == 1
        for i in range(3):  # the nodes' capacity is whole
            CoordinatorClient(coordinator.url).register(f"node-{i}")
            sink = EventSink(f"node-{i}", HttpTransport(coordinator.url), backoff_max=0.2)
            sinks.append(sink)
            sink.emit("store", "l1", "dram", entries(rows(10 + i, 1)))
            assert sink.flush(30)
            assert coordinator.holders(rows(10 + i, 1)) == {f"node-{i}": 1}
        metrics = httpx.get(f"{coordinator.url}/metrics").text
        assert "engine-7" not in metrics  # a refused topic leaves no series behind
        assert 'counter="rejected_engine_cap"' in metrics
    finally:
        for sink in sinks:
            sink.close(timeout=1)
        coordinator.close()
    log = coordinator.log.read_text()
    assert "Traceback" not in log
    assert log.count("rejected (engine_cap") < 20  # the first ten, then powers of two


# ---------------------------------------------------------------------------- item 1


def tenant_tokens(tmp_path: Path) -> Path:
    return write_tokens(
        tmp_path / "tokens.json",
        {"token": ADMIN, "roles": ["admin"]},
        {"token": token("node-a"), "roles": ["emit", "lookup"], "instance_ids": ["node-a"],
         "cache_salts": ["tenant-a"]},
        {"token": token("node-b"), "roles": ["emit", "lookup"], "instance_ids": ["node-b"]},
    )  # fmt: skip


def published(coordinator: Coordinator, out: str, replay: str) -> RouterView:
    """What a router that connects sees, once node-a (tenant-a) and node-b (unsalted) stored."""
    for name, salt, seed in (("node-a", "tenant-a", 20), ("node-b", "", 21)):
        client = CoordinatorClient(coordinator.url, token=token(name))
        client.register(name)
        sink = EventSink(name, HttpTransport(coordinator.url, token=token(name)), backoff_max=0.2)
        sink.emit("store", "l1", "dram", entries(rows(seed, 2), salt))
        assert sink.flush(30)
        sink.close(timeout=1)
    router = RouterView(zmq.Context.instance(), out, replay)
    router.replay()
    return router


def test_the_stream_shows_only_the_salts_the_operator_chose(tmp_path: Path) -> None:
    tokens = tenant_tokens(tmp_path)
    salted = {e.key.chunk_hash for e in entries(rows(20, 2), "tenant-a")}
    open_ = {e.key.chunk_hash for e in entries(rows(21, 2))}
    for flags, want in (([], open_), (["--kv-events-publish-salts", ",tenant-a"], open_ | salted)):
        out, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        coordinator = Coordinator(tmp_path, "--kv-events-publish", out,
                                  "--kv-events-replay-bind", replay, *flags, tokens=tokens)  # fmt: skip
        try:
            router = published(coordinator, out, replay)

            def shown(router: RouterView = router) -> set[bytes]:
                return {h for media in router.pump().values() for hs in media.values() for h in hs}

            assert wait_for(lambda want=want: shown() == want)  # (node-a's, if withheld: first)
            prompts = {tuple(t) for t in router.token_ids.values()}
            tenant_prompts = {tuple(r) for r in rows(20, 2).tolist()}
            assert bool(prompts & tenant_prompts) == (want != open_)
            router.close()
        finally:
            coordinator.close()


def test_with_auth_the_stream_leaves_this_host_only_authenticated(tmp_path: Path) -> None:
    tokens = tenant_tokens(tmp_path)
    port = free_port()
    exposed = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli", "coordinator", "--port", str(port),
         "--auth-token-file", str(tokens), "--kv-events-publish", f"tcp://0.0.0.0:{free_port()}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert exposed.returncode != 0
    assert "--kv-events-curve-certificate" in exposed.stderr
    assert all(is_local(e) for e in ("tcp://127.0.0.1:1", "tcp://[::1]:1", "ipc:///x"))
    assert not any(is_local(e) for e in ("tcp://*:1", "tcp://0.0.0.0:1", "tcp://10.0.0.1:1"))


def test_curve_lets_only_known_routers_subscribe_and_replay(tmp_path: Path) -> None:
    """CurveZMQ on the PUB and the replay ROUTER: a router with a known certificate gets the
    placements live and replayed; one without gets nothing, not even a replay's end."""
    certs = tmp_path / "certs"
    clients = tmp_path / "clients"
    certs.mkdir()
    clients.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(certs, "coordinator")
    router_public, router_secret = zmq.auth.create_certificates(certs, "router")
    (clients / "router.key").write_bytes(Path(router_public).read_bytes())
    _, stranger_secret = zmq.auth.create_certificates(certs, "stranger")

    directory = KeyDirectory(C)
    out, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    stop_event = threading.Event()
    exposure = StreamExposure.choose(None, frozenset(), Path(server_secret), clients)
    pub = KvEventsPublisher(out, replay, 100, directory, stop_event, exposure=exposure)
    directory.observer = pub
    pub.open()
    thread = threading.Thread(target=pub.run, daemon=True)
    thread.start()
    ctx: zmq.Context[Any] = zmq.Context()
    server_key = zmq.auth.load_certificate(server_public)[0]

    def client(secret: str, kind: int) -> Any:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        public, private = zmq.auth.load_certificate(secret)
        sock.curve_publickey, sock.curve_secretkey = public, private
        sock.curve_serverkey = server_key
        return sock

    try:
        batch = EventBatch("node-1", 1, 1, "store", "l1", "dram", False, ts=1.0,
                           entries=tuple(entries(rows(30, 1))))  # fmt: skip
        directory.consume(batch)
        friends = [client(router_secret, k) for k in (zmq.SUB, zmq.DEALER)]
        strangers = [client(stranger_secret, k) for k in (zmq.SUB, zmq.DEALER)]
        for sub, dealer in (friends, strangers):
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(out)
            dealer.connect(replay)
            dealer.send_multipart([b"", pack_seq(0)])
        assert friends[1].poll(10_000)  # the replay answers a known router
        assert friends[1].recv_multipart()[1] == b"kv@node-1@m"
        directory.consume(EventBatch("node-1", 1, 2, "delete", "l1", "dram", False, ts=1.0,
                                     entries=tuple(entries(rows(30, 1)))))  # fmt: skip
        assert friends[0].poll(10_000)  # and live messages reach it
        assert not strangers[1].poll(500) and not strangers[0].poll(500)
    finally:
        for sock in (*friends, *strangers):
            sock.close(0)
        stop_event.set()
        thread.join(timeout=5)
        ctx.term()
