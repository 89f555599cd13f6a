"""Issue 25 item 2, against real processes on loopback (a coordinator, two ``kvatlas node``
processes, an attacker's HTTP server): a peer credential must not be harvestable, and one
captured by one peer must be useless against every other.

The attack: an emit token (for its own instance, its tenant's salt: what a node holds)
registers an instance whose ``p2p_advertised_url`` is the attacker's server and lists keys as
held in its L1; a node that wants those keys calls that URL with its peer credential. Before
the fix the credential was the fleet's one peer token, accepted by every node's ``/peer/kv``:
the attacker then read any tenant's KV from any node.

Now (``kvatlas/node/peer_credentials.py``): a node sends a credential derived for the target
instance, and only to a URL that a holder of the fleet's peer secret signed at registration.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.client import CoordinatorClient, HttpTransport
from kvatlas.coordinator.server import free_port
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import KeyScheme, ObjectKey, RequestTracker, pack_kv_rank
from kvatlas.node.config import NodeConfig
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.peer import PEER_KV_PATH
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.coordinator.security_support import spawn_coordinator, token, write_tokens

C = 16
MODEL = "toy"
RANK = pack_kv_rank(1, 0, 1, 0)
SALT = "tenant-t"
VICTIM_SALT = "tenant-victim"  # a tenant the attacker's token is not bound to
LAYOUT = NodeConfig(
    model_name=MODEL, num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C, dtype="float32"
).layout
MODEL_FLAGS = [
    "--model-name", MODEL, "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
    "--chunk-size", str(C), "--dtype", "float32", "--l2", "none", "--log-level", "warning",
]  # fmt: skip
PEER_SECRET = "fleet-peer-secret-" + "s" * 32
ENGINE = "ops-engine-token-" + "e" * 32  # salt-unbound: every call and /engine/stats
COORD_TOKENS = {name: token(name) for name in ("node-a", "node-b", "node-c", "evil")}


class CapturingPeer:
    """The attacker's 'peer': records every request's path and ``Authorization`` header and
    answers an empty reply (no chunks), as a peer that holds nothing would."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None]] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                peer.requests.append((self.path, self.headers.get("authorization")))
                body = b"\x90"  # msgpack: an empty array
                self.send_response(200)
                self.send_header("content-type", "application/octet-stream")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def credentials(self) -> list[str]:
        return [auth for _, auth in self.requests if auth]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Fleet:
    tmp: Path
    coordinator: str
    legacy: bool
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)

    def start_node(self, name: str) -> NodeEngineClient:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        coord_token = self.tmp / f"{name}.coordinator-token"
        coord_token.write_text(COORD_TOKENS[name])
        coord_token.chmod(0o600)
        args = [
            "-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", name,
            *MODEL_FLAGS, "--coordinator-url", self.coordinator,
            "--coordinator-event-reporting", "--coordinator-token-file", str(coord_token),
            "--auth-token-file", str(self.tmp / "node-tokens.json"),
            "--peer-token-file", str(self.tmp / "peer-secret"),
            "--fleet-refresh-interval-s", "0", "--peer-fetch-deadline-s", "5",
        ]  # fmt: skip
        self.procs[name] = spawn_service(args, url)
        self.urls[name] = url
        return self.engine(name)

    def stop_node(self, name: str) -> None:
        stop([self.procs.pop(name)])

    def engine(self, name: str) -> NodeEngineClient:
        return NodeEngineClient(self.urls[name], LAYOUT, token=ENGINE, timeout=60)

    def claim(
        self, instance_id: str, url: str, keys: list[ObjectKey], signature: str | None = None
    ) -> None:
        """Register ``instance_id`` (its own emit token) at ``url`` and list ``keys`` as held
        in its L1; returns once the coordinator lists them."""
        tok = COORD_TOKENS[instance_id]
        with CoordinatorClient(self.coordinator, token=tok) as client:
            body: dict[str, Any] = {"instance_id": instance_id, "p2p_advertised_url": url}
            if signature is not None:
                body["p2p_url_signature"] = signature
            r = HTTP.post(
                f"{self.coordinator}/instances",
                json=body,
                headers={"authorization": f"Bearer {tok}"},
            )
            assert r.status_code == 200, r.text
            transport = HttpTransport(self.coordinator, token=tok)
            entries = tuple(CacheEntry(k, LAYOUT.chunk_bytes) for k in keys)
            transport.send([EventBatch(instance_id, 1, 1, "store", "l1", "dram", entries=entries)])
            transport.close()

            def listed() -> bool:
                found = [r.placements for r in client.lookup_keys(keys).results]
                return all(any(p.instance_id == instance_id for p in pls) for pls in found)

            assert wait_for(listed, timeout=30)


def prompt(seed: int, chunks: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * C).astype(np.uint32)


def keys_of(tokens: np.ndarray, salt: str = SALT) -> list[ObjectKey]:
    tracker = RequestTracker(tokens, (), scheme=KeyScheme("blake3", C), cache_salt=salt)
    return [ObjectKey(h, MODEL, RANK, 0, salt) for h in tracker.chunk_hashes()]


def store(client: NodeEngineClient, tokens: np.ndarray, salt: str = SALT) -> None:
    kv = ToyRopeModel(LAYOUT).kv_chunks(tokens)
    assert client.store(tokens, kv, cache_salt=salt) == len(tokens) // C


def peer_kv(url: str, authorization: str, keys: list[ObjectKey]) -> httpx.Response:
    return httpx.post(
        url + PEER_KV_PATH,
        json={"keys": [k.to_wire() for k in keys]},
        headers={"authorization": authorization},
    )


def _fleet(tmp: Path, *, legacy: bool) -> Iterator[Fleet]:
    coord_tokens = write_tokens(
        tmp / "coordinator-tokens.json",
        *(
            {"token": tok, "roles": ["emit", "lookup"], "instance_ids": [name],
             "cache_salts": [SALT] if name == "evil" else [SALT, VICTIM_SALT]}
            for name, tok in COORD_TOKENS.items()
        ),
    )  # fmt: skip
    node_tokens: list[dict[str, Any]] = [{"token": ENGINE, "roles": ["engine"]}]
    if legacy:  # the setup docs/security.md described: the peer token listed at every node
        node_tokens.append({"token": PEER_SECRET, "roles": ["peer"]})
    write_tokens(tmp / "node-tokens.json", *node_tokens)
    (tmp / "peer-secret").write_text(PEER_SECRET)
    (tmp / "peer-secret").chmod(0o600)
    port = free_port()
    fleet = Fleet(tmp, f"http://127.0.0.1:{port}", legacy)
    coordinator = spawn_coordinator(
        port, "--auth-token-file", str(coord_tokens), "--chunk-size", str(C)
    )
    try:
        yield fleet
    finally:
        stop([coordinator, *fleet.procs.values()])


@pytest.fixture
def legacy_fleet(tmp_path: Path) -> Iterator[Fleet]:
    yield from _fleet(tmp_path, legacy=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from _fleet(tmp_path_factory.mktemp("peer-credentials"), legacy=False)


@pytest.fixture
def capture() -> Iterator[CapturingPeer]:
    peer = CapturingPeer()
    yield peer
    peer.close()


def test_an_emit_token_cannot_harvest_a_peer_credential(
    legacy_fleet: Fleet, capture: CapturingPeer
) -> None:
    """The issue's attack, on the fleet set up as the docs described before (every node's
    auth file lists the peer token): nothing the attacker's server receives opens another
    node's ``/peer/kv``, and it receives no credential at all."""
    fleet = legacy_fleet
    a, b = fleet.start_node("node-a"), fleet.start_node("node-b")
    victim = prompt(1)  # another tenant's prompt, in A's L1
    store(a, victim, salt=VICTIM_SALT)
    bait = prompt(2)
    fleet.claim("evil", capture.url, keys_of(bait))  # no node signed this URL

    kv, _ = b.retrieve(bait, cache_salt=SALT)  # B wants the keys only "evil" claims

    assert kv == []
    for credential in capture.credentials:  # what the attacker got: useless at A
        r = peer_kv(fleet.urls["node-a"], credential, keys_of(victim, VICTIM_SALT))
        assert r.status_code == 401, (r.status_code, credential)
    assert capture.credentials == []  # and it got nothing to try
    assert capture.requests == []  # not even a request: the URL is not a node's
    assert b.stats()["peer_url_unverified"] >= 1  # B did want that copy, and refused the URL
    # the control: a legitimate fetch in the same (compatible) setup still works
    mine = prompt(3)
    store(a, mine)
    assert wait_for(lambda: b.lookup(mine, cache_salt=SALT) == 3 * C, timeout=30)
    assert b.retrieve(mine, cache_salt=SALT)[1] == {"peer_l1": 3}


def test_a_credential_captured_by_one_peer_is_useless_against_another(
    fleet: Fleet, capture: CapturingPeer
) -> None:
    """A node presents each peer a credential derived for that peer: one that a peer (here a
    server standing in for node C, whose URL is properly signed) captures opens neither A
    nor B, while A's and B's own credentials work."""
    from kvatlas.node.peer_credentials import PeerSecret

    a = fleet.engine("node-a") if "node-a" in fleet.procs else fleet.start_node("node-a")
    b = fleet.engine("node-b") if "node-b" in fleet.procs else fleet.start_node("node-b")
    secret = PeerSecret(PEER_SECRET)
    bait = prompt(4)
    fleet.claim("node-c", capture.url, keys_of(bait), secret.sign_url("node-c", capture.url))
    theirs = prompt(5)
    store(a, theirs)
    store(b, theirs)

    b.retrieve(bait, cache_salt=SALT)

    assert capture.credentials, "B never called the signed peer: the test proves nothing"
    for credential in set(capture.credentials):
        assert PEER_SECRET not in credential  # the shared secret never leaves a node
        for name in ("node-a", "node-b"):
            r = peer_kv(fleet.urls[name], credential, keys_of(theirs))
            assert r.status_code == 401, (name, r.status_code)
    for name in ("node-a", "node-b"):  # each node's own credential opens it
        r = peer_kv(fleet.urls[name], f"Bearer {secret.credential(name)}", keys_of(theirs))
        assert r.status_code == 200 and r.content != b"\x90", (name, r.status_code)
        # the bare secret opens nothing where the auth file does not list it (the new setup)
        assert (
            peer_kv(fleet.urls[name], f"Bearer {PEER_SECRET}", keys_of(theirs)).status_code == 401
        )


def test_a_legitimate_peer_fetch_works_across_a_node_restart(fleet: Fleet) -> None:
    """The negative control: B fetches from A; A restarts (same id, another port); B fetches
    from the restarted A (its new URL, signed anew) with no refused call."""
    a = fleet.engine("node-a") if "node-a" in fleet.procs else fleet.start_node("node-a")
    b = fleet.engine("node-b") if "node-b" in fleet.procs else fleet.start_node("node-b")
    first, second = prompt(6), prompt(7)
    store(a, first)
    assert wait_for(lambda: b.lookup(first, cache_salt=SALT) == 3 * C, timeout=30)
    assert b.retrieve(first, cache_salt=SALT)[1] == {"peer_l1": 3}

    fleet.stop_node("node-a")
    a = fleet.start_node("node-a")
    store(a, second)
    assert wait_for(lambda: b.lookup(second, cache_salt=SALT) == 3 * C, timeout=30)
    assert b.retrieve(second, cache_salt=SALT)[1] == {"peer_l1": 3}
    counters = b.stats()
    assert not {k: v for k, v in counters.items() if k.startswith("peer_fetch_")}, counters


# ---------------------------------------------------------------- the pieces, in one process


def test_credentials_and_url_signatures_are_bound_to_their_instance() -> None:
    from kvatlas.node.peer_credentials import PeerSecret

    secret, other = PeerSecret(PEER_SECRET), PeerSecret("another-fleet-" + "o" * 32)
    assert secret.accepts(secret.credential("node-a"), "node-a")
    assert not secret.accepts(secret.credential("node-a"), "node-b")
    assert not secret.accepts(other.credential("node-a"), "node-a")
    assert not secret.accepts(PEER_SECRET, "node-a")  # the secret itself is no credential
    url = "http://10.0.0.1:9400"
    signature = secret.sign_url("node-a", url)
    assert secret.url_signed("node-a", url + "/", signature)
    assert not secret.url_signed("node-b", url, signature)  # another instance's URL
    assert not secret.url_signed("node-a", "http://10.0.0.2:9400", signature)
    assert not secret.url_signed("node-a", url, other.sign_url("node-a", url))
    assert not secret.url_signed("node-a", url, None)
    # the signature is shown to salt-bound tokens: it must open nothing
    assert not secret.accepts(signature, "node-a")


def test_the_coordinator_lists_a_signature_and_the_view_checks_it() -> None:
    """Over a real coordinator (loopback HTTP): a node registered with an assigned id gets a
    signed URL too; a URL signed for another instance, unsigned, or signed with another
    secret is no peer (counted); a malformed signature is refused at registration (422)."""
    from kvatlas.coordinator.config import CoordinatorConfig
    from kvatlas.coordinator.server import BackgroundServer
    from kvatlas.node.fleet_view import HttpFleetView
    from kvatlas.node.peer_credentials import PeerSecret
    from kvatlas.node.server import register

    secret = PeerSecret(PEER_SECRET)
    config = NodeConfig(
        model_name=MODEL, num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=C,
        dtype="float32", port=9401, peer_token=PEER_SECRET,
    )  # fmt: skip
    with (
        BackgroundServer(CoordinatorConfig(port=free_port(), chunk_size=C)) as server,
        CoordinatorClient(server.url) as node,
        CoordinatorClient(server.url) as others,
    ):
        assigned = register(node, config, None)  # the coordinator names it, then it signs
        url = "http://127.0.0.1:9"
        others.register("other-id", p2p_advertised_url=url,
                        p2p_url_signature=secret.sign_url("node-x", url))  # fmt: skip
        others.register("unsigned", p2p_advertised_url=url)
        others.register("foreign", p2p_advertised_url=url,
                        p2p_url_signature=PeerSecret("x" * 40).sign_url("foreign", url))  # fmt: skip
        r = httpx.post(
            f"{server.url}/instances",
            json={"instance_id": "bad", "p2p_advertised_url": url, "p2p_url_signature": "zz"},
        )
        assert r.status_code == 422 and "p2p_url_signature" in r.text
        view = HttpFleetView(others, layout=LAYOUT, peer_secret=secret, refresh_interval=0.0)
        peer = view.peer(assigned)
        assert peer is not None and peer.url == "http://127.0.0.1:9401"
        assert [view.peer(i) for i in ("other-id", "unsigned", "foreign")] == [None] * 3
        assert view.counters["peer_url_unverified"] == 3
        # without a secret a node sends no credential, so any listed URL will do (as before)
        plain = HttpFleetView(others, layout=LAYOUT, refresh_interval=0.0)
        assert plain.peer("unsigned") is not None


def test_a_signature_survives_a_coordinator_snapshot() -> None:
    from kvatlas.coordinator.instances import InstanceRegistry, Registration

    signed = Registration(p2p_advertised_url="http://10.0.0.1:9400", p2p_url_signature="ab" * 32)
    registry = InstanceRegistry(30.0, on_fence=lambda _: None)
    registry.register("node-a", signed)
    restored = InstanceRegistry(30.0, on_fence=lambda _: None)
    restored.restore(registry.rows())
    [record] = restored.snapshot()[1]
    assert record.registration == signed


def test_a_node_warns_while_its_auth_file_accepts_the_bare_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvatlas.node.server import warn_if_shared_peer_token

    secret = tmp_path / "peer-secret"
    secret.write_text(PEER_SECRET)
    secret.chmod(0o600)
    for legacy in (True, False):
        entries: list[dict[str, Any]] = [{"token": ENGINE, "roles": ["engine"]}]
        if legacy:
            entries.append({"token": PEER_SECRET, "roles": ["peer"]})
        auth = write_tokens(tmp_path / f"auth-{legacy}.json", *entries)
        config = NodeConfig(auth_token_file=auth, peer_token_file=secret)
        caplog.clear()
        warn_if_shared_peer_token(config)
        assert ("lists the peer secret" in caplog.text) is legacy
