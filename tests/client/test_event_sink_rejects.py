"""EventSink facing refusals: one bad batch is quarantined (counted, its seq a gap at the
coordinator) while the rest of the send is delivered; 401/403 are retried with backoff and
counted; 413 halves the send (a single batch still too large is quarantined)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import EventBatch, decode_json, encode_json
from tests.client.test_event_sink import CHUNK, entry


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


# ---------------------------------------------------------------- scripted receiver


class Scripted:
    """A loopback HTTP server answering ``POST /events`` from a script of statuses; after the
    script runs out, a body with more than ``max_batches`` batches gets 413, a body holding a
    seq in ``bad_seqs`` gets 422 without a field, anything else 200 (and is recorded)."""

    def __init__(self, script: list[int], max_batches: int = 1_000, bad_seqs: Iterable[int] = ()):
        self.script = list(script)
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
                reply = json.dumps({"detail": f"status {status}"}).encode()
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
