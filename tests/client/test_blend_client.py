"""BlendCoordinatorClient: real matches from a real coordinator; every failure mode → [] within
the budget, never an exception; aborted requests do not grow memory."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import numpy as np
import pytest

from kvatlas.client import BlendCoordinatorClient
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer, free_port
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hashes, pack_kv_rank
from tests.conftest import wait_for

CHUNK = 16
NS = BlendNamespace("m")


def poll_until_done(
    client: BlendCoordinatorClient, request_id: str, budget: float
) -> tuple[Any, float]:
    start = time.monotonic()
    while True:
        result = client.poll_match(request_id)
        if result is not None:
            return result, time.monotonic() - start
        assert time.monotonic() - start < budget, "poll_match stayed pending past its budget"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def coordinator() -> Iterator[BackgroundServer]:
    config = CoordinatorConfig(port=free_port(), chunk_size=CHUNK, enable_blend_lookup=True)
    with BackgroundServer(config) as server:
        doc = list(range(1000, 1000 + 2 * CHUNK))
        entries = tuple(
            CacheEntry(
                ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0)),
                size_bytes=1,
                token_ids=np.asarray(doc[i * CHUNK : (i + 1) * CHUNK]),
                token_offset=i * CHUNK,
            )
            for i, h in enumerate(chunk_hashes(doc, CHUNK))
        )
        server.service.ingest([EventBatch("a", 1, 1, "store", "l1", "dram", entries=entries)])
        yield server


def test_matches_from_real_coordinator(coordinator: BackgroundServer) -> None:
    query = [7, 7, 7, *range(1000, 1000 + 2 * CHUNK), 9]
    with BlendCoordinatorClient(coordinator.url, request_timeout=20) as client:
        client.submit_match("r1", query, NS)
        result, _ = poll_until_done(client, "r1", budget=25)
        assert [(m.old_st, m.cur_st) for m in result] == [(0, 3), (CHUNK, 3 + CHUNK)]
        assert client.take_match("r1") == result
        assert client.pending_count() == 0
        client.submit_match("r2", query, BlendNamespace("other-model"))
        assert poll_until_done(client, "r2", budget=25)[0] == []


def test_maybe_create_empty_url() -> None:
    assert BlendCoordinatorClient.maybe_create("") is None
    assert BlendCoordinatorClient.maybe_create(None) is None
    client = BlendCoordinatorClient.maybe_create("http://127.0.0.1:1")
    assert client is not None
    client.close()


class _Misbehaving(BaseHTTPRequestHandler):
    mode = "garbage"
    release: ClassVar[threading.Event]  # a "slow" reply stalls until teardown sets it

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = type(self).mode
        if mode == "slow":
            type(self).release.wait(timeout=60)
        status, body = {
            "garbage": (200, b"\x00not json"),
            "wrong-shape": (
                200,
                json.dumps({"matches": [{"chunk_hash": "zz", "old_st": -1}]}).encode(),
            ),
            "out-of-range": (
                200,
                json.dumps(
                    {"matches": [{"chunk_hash": "ab" * 32, "old_st": 0, "cur_st": 10**9}]}
                ).encode(),
            ),
            "error": (500, b"boom"),
            "slow": (200, b'{"matches": []}'),
        }[mode]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client may have given up already
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def misbehaving() -> Iterator[tuple[str, type[_Misbehaving]]]:
    handler = type("Handler", (_Misbehaving,), {"release": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    handler.release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode", ["garbage", "wrong-shape", "out-of-range", "error", "slow"])
def test_failures_become_empty_within_budget(
    misbehaving: tuple[str, type[_Misbehaving]], mode: str
) -> None:
    url, handler = misbehaving
    handler.mode = mode
    with BlendCoordinatorClient(url, request_timeout=0.3) as client:
        client.submit_match("r", list(range(64)), NS)
        # the stall lasts until teardown: an answer within the budget came from the
        # request_timeout, however loaded the machine
        result, _ = poll_until_done(client, "r", budget=30.0)
        assert result == []


def test_server_down_is_empty() -> None:
    with BlendCoordinatorClient(f"http://127.0.0.1:{free_port()}", request_timeout=0.5) as client:
        client.submit_match("r", list(range(64)), NS)
        assert poll_until_done(client, "r", budget=30.0)[0] == []  # refused at once
        assert client.failures == 1


def test_unknown_request_is_empty_not_an_error() -> None:
    with BlendCoordinatorClient(f"http://127.0.0.1:{free_port()}") as client:
        assert client.poll_match("never-submitted") == []
        assert client.take_match("never-submitted") == []


def test_aborted_requests_keep_memory_flat(coordinator: BackgroundServer) -> None:
    """Requests submitted and never taken expire after the TTL; the bound caps the rest."""
    with BlendCoordinatorClient(coordinator.url, result_ttl=0.2, max_pending=50) as client:
        for i in range(200):
            client.submit_match(f"aborted-{i}", list(range(40)), NS)
        assert client.pending_count() <= 50
        assert client.dropped >= 150
        assert wait_for(lambda: client.pending_count() == 0)
        assert client.expired >= 1
