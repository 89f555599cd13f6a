"""EventSink facing refusals: one bad batch is quarantined (counted, its seq a gap at the
coordinator) while the rest of the send is delivered; entries of salts the token may not
store for (a 403 naming them) are left out and their batches delivered; other 401/403 are
retried with backoff and counted; 413 halves the send (a single batch still too large is
quarantined)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch, decode_json, encode_json
from tests.client.test_event_sink import CHUNK, entry
from tests.helpers import write_tokens


class PoisoningTransport(HttpTransport):
    """Real HTTP to a real coordinator; the batches whose seq is in ``poisoned`` go out with
    an invalid ``ts`` (what a buggy or version-skewed encoder would send)."""

    def __init__(self, url: str, poisoned: set[int]) -> None:
        super().__init__(url, fmt="json")
        self.poisoned = poisoned
        self.posts = 0

    def encode(self, batches: Sequence[EventBatch]) -> tuple[bytes, str]:
        self.posts += 1
        body = json.loads(encode_json(list(batches)))
        for wire in body["batches"]:
            if wire["seq"] in self.poisoned:
                wire["ts"] = "not a number"
        return json.dumps(body).encode(), "application/json"


def _hold(sink: EventSink) -> threading.Event:
    """Emit everything while the sender thread is held, so it all goes out in one send."""
    gate = threading.Event()
    real_send = sink.transport.send

    def send(batches: Sequence[EventBatch]) -> None:
        gate.wait(10)
        real_send(batches)

    sink.transport.send = send  # type: ignore[method-assign]
    return gate


def test_one_bad_batch_in_a_send_is_quarantined_the_rest_delivered() -> None:
    port = free_port()
    transport = PoisoningTransport(f"http://127.0.0.1:{port}", poisoned={4})
    with BackgroundServer(CoordinatorConfig(port=port, chunk_size=CHUNK)) as server:
        sink = EventSink("node-q", transport, incarnation=1, backoff_max=0.2)
        gate = _hold(sink)
        for i in range(10):
            assert sink.emit("store", "l1", "dram", [entry(i)])
        gate.set()
        assert sink.flush(timeout=20)
        directory = server.service.directory
        assert directory.stats().keys == 9  # the other nine of the send were delivered
        stats = sink.stats()
        assert stats.sent_batches == 9 and stats.quarantined_batches == 1
        cursor = directory.gap_state("node-q")
        assert cursor is not None and cursor.gaps == 1 and cursor.missing_batches == 1
    sink.close(timeout=0.5)


def salted(i: int, salt: str) -> CacheEntry:
    e = entry(i)
    return CacheEntry(dataclasses.replace(e.key, cache_salt=salt), e.size_bytes, e.token_ids, 0)


def test_entries_of_refused_salts_are_left_out_and_later_batches_delivered(
    tmp_path: Path,
) -> None:
    """A real coordinator whose token for ``node-s`` holds salt ``a`` only: one send holds a
    batch mixing ``a`` with ``b`` and ``c``, a batch of ``b`` alone and later batches of ``a``.
    The 403 names both refused salts; everything else arrives, every seq with it (no gap)."""
    token = "node-s-" + "x" * 32
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": token, "roles": ["emit"], "instance_ids": ["node-s"], "cache_salts": ["a"]},
    )
    port = free_port()
    config = CoordinatorConfig(port=port, chunk_size=CHUNK, auth_token_file=tokens)
    with BackgroundServer(config) as server:
        r = httpx.post(f"{server.url}/instances", json={"instance_id": "node-s"},
                       headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        assert r.status_code == 200, r.text
        transport = HttpTransport(f"http://127.0.0.1:{port}", fmt="json", token=token)
        sink = EventSink("node-s", transport, incarnation=1, backoff_max=0.2)
        gate = _hold(sink)
        sink.emit("store", "l1", "dram", [salted(1, "a"), salted(2, "b"), salted(3, "c")])
        sink.emit("store", "l1", "dram", [salted(4, "b")])
        for i in range(5, 8):
            sink.emit("store", "l1", "dram", [salted(i, "a")])
        gate.set()
        assert sink.flush(timeout=20)
        directory = server.service.directory
        held = directory.lookup([salted(i, s).key for i, s in [(1, "a"), (5, "a"), (7, "a")]])
        assert all(row.placements for row in held)
        assert all(not row.placements for row in directory.lookup([salted(2, "b").key]))
        assert directory.stats().keys == 4
        stats = sink.stats()
        assert stats.salt_refused_entries == 3 and stats.sent_batches == 5
        assert stats.quarantined_batches == stats.auth_failures == 0
        cursor = directory.gap_state("node-s")
        assert cursor is not None and cursor.gaps == 0 and cursor.last_seq == 5
    sink.close(timeout=0.5)


# ---------------------------------------------------------------- scripted receiver


class Scripted:
    """A loopback HTTP server answering ``POST /events`` from a script of statuses; after the
    script runs out, a body with more than ``max_batches`` batches gets 413, a body holding a
    seq in ``bad_seqs`` gets 422 without a field, anything else 200 (and is recorded)."""

    def __init__(
        self,
        script: list[int],
        max_batches: int = 1_000,
        bad_seqs: Iterable[int] = (),
        reply: dict[str, object] | None = None,
    ):
        self.script = list(script)
        self.reply = reply or {}  # more fields of a scripted refusal's body
        self.max_batches = max_batches
        self.bad_seqs = set(bad_seqs)
        self.delivered: list[int] = []
        self.statuses: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                seqs = [b.seq for b in decode_json(body)]
                if outer.script:
                    status = outer.script.pop(0)
                elif len(seqs) > outer.max_batches:
                    status = 413
                elif outer.bad_seqs & set(seqs):
                    status = 422
                else:
                    status = 200
                    outer.delivered.extend(seqs)
                outer.statuses.append(status)
                extra = outer.reply if status >= 400 else {}
                reply = json.dumps({"detail": f"status {status}", **extra}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[list[Scripted]]:
    servers: list[Scripted] = []
    yield servers
    for server in servers:
        server.close()


def _sink(server: Scripted, name: str) -> tuple[EventSink, threading.Event]:
    sink = EventSink(
        name,
        HttpTransport(server.url, fmt="json"),
        incarnation=1,
        backoff_initial=0.01,
        backoff_max=0.05,
    )
    return sink, _hold(sink)


@pytest.mark.parametrize("status", [401, 403])
def test_auth_refusals_are_retried_and_counted(status: int, scripted: list[Scripted]) -> None:
    server = Scripted([status, status, status])
    scripted.append(server)
    sink, gate = _sink(server, "node-auth")
    for i in range(5):
        sink.emit("store", "l1", "dram", [entry(i)])
    gate.set()
    assert sink.flush(timeout=20)
    assert server.delivered == [1, 2, 3, 4, 5]
    stats = sink.stats()
    assert stats.auth_failures == 3 and stats.retries >= 3
    assert stats.sent_batches == 5
    assert stats.quarantined_batches == 0
    sink.close(timeout=0.5)


def test_a_403_naming_salts_the_send_does_not_hold_is_retried(
    scripted: list[Scripted],
) -> None:
    """Nothing to leave out: the refusal is the sender's own (retried, never a hot loop)."""
    server = Scripted([403, 403], reply={"cache_salts": ["elsewhere"]})
    scripted.append(server)
    sink, gate = _sink(server, "node-elsewhere")
    for i in range(3):
        sink.emit("store", "l1", "dram", [entry(i)])
    gate.set()
    assert sink.flush(timeout=20)
    assert server.delivered == [1, 2, 3]
    stats = sink.stats()
    assert stats.auth_failures == 2 and stats.salt_refused_entries == 0
    sink.close(timeout=0.5)


def test_payload_too_large_halves_the_send(scripted: list[Scripted]) -> None:
    server = Scripted([], max_batches=3)
    scripted.append(server)
    sink, gate = _sink(server, "node-413")
    for i in range(10):
        sink.emit("store", "l1", "dram", [entry(i)])
    gate.set()
    assert sink.flush(timeout=20)
    assert server.delivered == list(range(1, 11))  # all of it, in order
    stats = sink.stats()
    assert stats.splits >= 2 and stats.quarantined_batches == 0
    assert stats.sent_batches == 10
    sink.close(timeout=0.5)


def test_a_single_batch_still_too_large_is_quarantined(scripted: list[Scripted]) -> None:
    server = Scripted([], max_batches=0)
    scripted.append(server)
    sink, gate = _sink(server, "node-413-one")
    for i in range(4):
        sink.emit("store", "l1", "dram", [entry(i)])
    gate.set()
    assert sink.flush(timeout=20)
    assert server.delivered == []
    stats = sink.stats()
    assert stats.quarantined_batches == 4 and stats.sent_batches == 0
    sink.close(timeout=0.5)


def test_422_without_a_field_is_bisected_to_the_bad_batch(scripted: list[Scripted]) -> None:
    server = Scripted([], bad_seqs={3, 7})
    scripted.append(server)
    sink, gate = _sink(server, "node-bisect")
    for i in range(8):
        sink.emit("store", "l1", "dram", [entry(i)])
    gate.set()
    assert sink.flush(timeout=20)
    assert server.delivered == [1, 2, 4, 5, 6, 8]
    stats = sink.stats()
    assert stats.quarantined_batches == 2 and stats.sent_batches == 6
    sink.close(timeout=0.5)


def test_node_stats_show_the_sinks_counters(scripted: list[Scripted]) -> None:
    """What the sink counted (auth refusals included) shows in the node's ``/engine/stats``."""
    from kvatlas.node import CacheNode, NodeConfig

    server = Scripted([401])
    scripted.append(server)
    sink, gate = _sink(server, "node-stats")
    config = NodeConfig(
        model_name="toy", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=CHUNK,
        dtype="float32", l1_bytes=1 << 20, l2="none",
    )  # fmt: skip
    node = CacheNode(config, instance_id="node-stats", sink=sink)
    try:
        sink.emit("store", "l1", "dram", [entry(1)])
        gate.set()
        assert sink.flush(timeout=20)
        wire = node.stats().to_wire()["event_sink"]
        # sent: the node's config batch (its incarnation's first event) and the store
        assert wire["auth_failures"] == 1 and wire["sent_batches"] == 2
        assert wire["quarantined_batches"] == 0 and wire["splits"] == 0
    finally:
        node.close()
