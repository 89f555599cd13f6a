"""Client errors sit in the kvatlas error tree and keep telling retryable from permanent:
a 5xx/408/429 or no answer is Unavailable (retry), any other 4xx is InvalidInput (drop)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.client import (
    AuthSendError,
    CoordinatorClient,
    CoordinatorError,
    EventSink,
    HttpTransport,
    InProcessTransport,
    PermanentSendError,
    SendTooLargeError,
    SinkStats,
    TransientSendError,
)
from kvatlas.errors import InvalidInput, KvatlasError, Unavailable
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank


class _Scripted(BaseHTTPRequestHandler):
    """Answers ``(method, path)`` from ``replies`` (default 200 ``{}``) and records requests."""

    replies: ClassVar[dict[tuple[str, str], tuple[int, dict[str, Any]]]] = {}
    seen: ClassVar[list[tuple[str, str]]] = []

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append((self.command, self.path))
        status, payload = type(self).replies.get((self.command, self.path), (200, {}))
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[tuple[str, type[_Scripted]]]:
    handler = type("Handler", (_Scripted,), {"replies": {}, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def _batch() -> EventBatch:
    key = ObjectKey(bytes(32), "m", pack_kv_rank(1, 0, 1, 0))
    entry = CacheEntry(key, 1, np.arange(4, dtype=np.uint32), 0)
    return EventBatch("node", 1, 1, "store", "l1", "dram", entries=(entry,))


def test_error_classes_in_the_tree() -> None:
    assert issubclass(TransientSendError, Unavailable)
    assert issubclass(TransientSendError, RuntimeError)
    assert issubclass(CoordinatorError, Unavailable)
    assert issubclass(CoordinatorError, RuntimeError)
    assert issubclass(PermanentSendError, InvalidInput)
    assert issubclass(PermanentSendError, ValueError)
    assert issubclass(PermanentSendError, RuntimeError)  # what it was before the tree
    assert (TransientSendError.status, CoordinatorError.status) == (503, 503)
    assert PermanentSendError.status == 400


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (503, TransientSendError),
        (500, TransientSendError),
        (429, TransientSendError),
        (408, TransientSendError),
        (422, PermanentSendError),
        (413, SendTooLargeError),
        (401, AuthSendError),
        (403, AuthSendError),
    ],
)
def test_http_transport_sorts_replies(
    scripted: tuple[str, type[_Scripted]], status: int, error: type[KvatlasError]
) -> None:
    url, handler = scripted
    handler.replies[("POST", "/events")] = (status, {"detail": "no"})
    transport = HttpTransport(url, timeout=5.0)
    try:
        with pytest.raises(error, match=f"status {status}"):
            transport.send([_batch()])
    finally:
        transport.close()


def test_http_transport_unreachable_is_transient() -> None:
    transport = HttpTransport(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    try:
        with pytest.raises(TransientSendError):
            transport.send([_batch()])
    finally:
        transport.close()


def test_permanent_errors_are_dropped_and_counted_not_retried() -> None:
    def refuse(batch: EventBatch) -> None:
        raise PermanentSendError("status 422: bad batch")

    sink = EventSink("node", InProcessTransport(refuse), incarnation=1, backoff_max=0.05)
    assert sink.emit("store", "l1", "dram", [_batch().entries[0]])
    assert sink.flush(timeout=10)
    assert (sink.rejected_batches, sink.retries, sink.sent_batches) == (1, 0, 0)
    assert sink.stats() == SinkStats(
        seq=1,
        pending=0,
        sent_batches=0,
        dropped_batches=0,
        quarantined_batches=1,
        quarantined_entries=1,
        salt_refused_entries=0,
        retries=0,
        auth_failures=0,
        splits=0,
    )
    sink.close(timeout=1)


def test_coordinator_error_keeps_the_reply_status(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    handler.replies[("GET", "/directory/stats")] = (409, {"detail": "busy"})
    client = CoordinatorClient(url, timeout=5.0)
    with client, pytest.raises(CoordinatorError) as info:
        client.stats()
    assert info.value.reply_status == 409
    assert info.value.status == 503  # what the error maps to in kvatlas's own replies
    assert "409 busy" in str(info.value)


def test_coordinator_unreachable_has_no_reply_status() -> None:
    client = CoordinatorClient(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    with client, pytest.raises(CoordinatorError) as info:
        client.health()
    assert info.value.reply_status is None


def test_heartbeat_re_registers_after_404(scripted: tuple[str, type[_Scripted]]) -> None:
    url, handler = scripted
    handler.replies[("POST", "/instances")] = (200, {"instance_id": "node-7"})
    with CoordinatorClient(url, timeout=5.0) as client:
        assert client.register("node-7") == "node-7"
        handler.replies[("PUT", "/instances/node-7/heartbeat")] = (404, {"detail": "unknown"})
        client.heartbeat()  # a forgotten instance registers again, no error
        assert handler.seen[-2:] == [("PUT", "/instances/node-7/heartbeat"), ("POST", "/instances")]
        handler.replies[("PUT", "/instances/node-7/heartbeat")] = (500, {"detail": "down"})
        with pytest.raises(CoordinatorError) as info:
            client.heartbeat()
        assert info.value.reply_status == 500


@pytest.mark.parametrize(
    ("method", "path", "status", "reply", "call"),
    [
        # an error reply that is not an object: its text is the detail (was an AttributeError)
        ("GET", "/healthz", 500, [1], lambda c: c.health()),
        # a listing without its rows (was a KeyError out of instances())
        ("GET", "/instances", 200, {"rows": []}, lambda c: c.instances()),
        ("GET", "/instances", 200, {"instances": [{"instance_id": 7}]}, lambda c: c.instances()),
        # a lookup reply whose placement lacks a field (was returned as is, half-read later)
        (
            "POST",
            "/directory/lookup",
            200,
            {"chunks": 1, "results": [{"key": {}, "placements": []}]},
            lambda c: c.lookup_tokens([1, 2, 3, 4], "m"),
        ),
        ("GET", "/healthz", 200, {"status": "healthy", "chunk_size": "16"}, lambda c: c.health()),
    ],
)
def test_a_reply_not_of_its_wire_type_is_a_coordinator_error(
    scripted: tuple[str, type[_Scripted]],
    method: str,
    path: str,
    status: int,
    reply: Any,
    call: Any,
) -> None:
    """Every reply is decoded as its :mod:`kvatlas.api` type: one that is not is a
    ``CoordinatorError`` naming what is wrong, never another exception or a half-read value."""
    url, handler = scripted
    handler.replies[(method, path)] = (status, reply)
    with CoordinatorClient(url, timeout=5.0) as client, pytest.raises(CoordinatorError) as info:
        call(client)
    assert path in str(info.value)


def test_well_formed_replies_decode_as_their_types(scripted: tuple[str, type[_Scripted]]) -> None:
    """The negative control of the test above: the same routes, well-formed replies."""
    url, handler = scripted
    handler.replies[("GET", "/healthz")] = (200, {"status": "healthy", "chunk_size": 16})
    handler.replies[("GET", "/instances")] = (
        200,
        {"instances": [{"instance_id": "a", "alive": False}]},
    )
    with CoordinatorClient(url, timeout=5.0) as client:
        assert client.health().chunk_size == 16
        assert [r.instance_id for r in client.instances()] == ["a"]
