"""kvatlas's clients against LMCache's coordinator wire, both directions, so they cannot drift:

- what ``CoordinatorClient``, ``BlendCoordinatorClient``, ``EventSink`` (JSON) and the node's
  fleet view send has only fields LMCache's own clients send, with the same JSON types
  (the goldens' request bodies, tests/coordinator/data);
- what LMCache's coordinator answers (the goldens' replies) is read by those clients.

The far side is a stub on real loopback HTTP that answers as LMCache's coordinator did in the
goldens and records every request.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.client import BlendCoordinatorClient, CoordinatorClient, EventSink, HttpTransport
from kvatlas.coordinator._base64 import b64decode_strict
from kvatlas.events import CacheEntry
from kvatlas.keys import BlendNamespace, ObjectKey
from kvatlas.node.config import NodeConfig
from kvatlas.node.fleet_view import HttpFleetView
from kvatlas.node.server import check_coordinator_compatible
from tests.coordinator.lmcache_goldens import (
    GOLDENS,
    load,
    path_route,
    request_problems,
    request_template,
)

GOLDEN = load(GOLDENS[0])


def _reply(note: str) -> Any:
    (found,) = [e["lmcache_response"] for e in GOLDEN["exchanges"] if e["note"] == note]
    return found


def _request(note: str) -> Any:
    (found,) = [e["body"] for e in GOLDEN["exchanges"] if e["note"] == note]
    return found


@dataclass(frozen=True)
class Recorded:
    method: str
    route: str
    body: Any  # parsed JSON, or None


class LMCacheStub:
    """Answers as LMCache's coordinator did in the goldens; records every request."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        routes = [
            Route("/healthz", self._answer, methods=["GET"]),
            Route("/instances", self._answer, methods=["GET", "POST"]),
            Route("/instances/{id}/heartbeat", self._answer, methods=["PUT"]),
            Route("/instances/{id}", self._answer, methods=["DELETE"]),
            Route("/events", self._answer, methods=["POST"]),
            Route("/directory/lookup", self._answer, methods=["POST"]),
            Route("/directory/blend-lookup", self._answer, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def _answer(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        route = path_route(request.url.path)
        with self._lock:
            self.requests.append(Recorded(request.method, route, body))
        key = (request.method, route)
        if key == ("DELETE", "/instances/{id}"):
            return Response(status_code=204)
        if key == ("POST", "/instances"):
            assigned = body.get("instance_id") or "mp-" + "0" * 32
            return JSONResponse({"instance_id": assigned, "re_registered": False})
        if key == ("PUT", "/instances/{id}/heartbeat"):
            return JSONResponse({"instance_id": request.path_params["id"]})
        if key == ("POST", "/events"):
            return JSONResponse({"applied": len(body["batches"]), "duplicates": 0, "stale": 0})
        note = {
            ("GET", "/healthz"): "liveness",
            ("GET", "/instances"): "instances",
            ("POST", "/directory/lookup"): "lookup by keys",
            ("POST", "/directory/blend-lookup"): "blend lookup (BlendCoordinatorClient body)",
        }[key]
        return JSONResponse(_reply(note))

    def sent(self, method: str, route: str) -> list[Any]:
        with self._lock:
            return [r.body for r in self.requests if (r.method, r.route) == (method, route)]


@pytest.fixture
def stub() -> Iterator[tuple[LMCacheStub, str]]:
    fake = LMCacheStub()
    server = ThreadedServer(fake.app, port=free_port(), name="lmcache-stub")
    server.start()
    try:
        yield fake, server.url
    finally:
        server.stop()


def _golden_keys() -> list[ObjectKey]:
    return [ObjectKey.from_wire(k) for k in _request("lookup by keys")["keys"]]


def _assert_lmcache_sends_it(method: str, route: str, bodies: list[Any]) -> None:
    assert bodies, f"nothing sent to {method} {route}"
    template = request_template(method, route)
    for body in bodies:
        assert request_problems(body, template) == [], (method, route, body)


def test_coordinator_client_and_fleet_view_speak_lmcache(stub: tuple[LMCacheStub, str]) -> None:
    fake, url = stub
    with CoordinatorClient(url) as client:
        health = client.health()
        check_coordinator_compatible(NodeConfig(chunk_size=16), health)  # warns, never refuses
        assigned = client.register(
            None, ip="10.0.0.9", http_port=8000, metadata={"model_name": "m"}, chunk_size=16
        )
        assert assigned == "mp-" + "0" * 32
        client.register("node-a", ip="10.0.0.9", http_port=8000, p2p_advertised_url="10.0.0.9:1")
        client.heartbeat()
        keys = _golden_keys()
        view = HttpFleetView(client, layout=NodeConfig(chunk_size=16).layout)
        holders = view.holders(keys)
        assert [sorted(h.instance_id for h in found) for found in holders] == [
            ["mp-a"],
            ["mp-a", "mp-a"],
            [],
        ]
        tokens = _request("lookup by tokens (prefix form)")["token_ids"]
        assert client.lookup_tokens(tokens, "m").chunks == 3  # the stub's one reply
        rows = client.instances()
        assert [r.instance_id for r in rows][-1] == "mp-a" and all(r.alive for r in rows)
        assert view.peer("mp-a") is None  # no peer URL in LMCache's row: no peer, no error
        client.deregister()  # 204, no body
    _assert_lmcache_sends_it("POST", "/instances", fake.sent("POST", "/instances"))
    _assert_lmcache_sends_it("POST", "/directory/lookup", fake.sent("POST", "/directory/lookup"))
    assert fake.sent("PUT", "/instances/{id}/heartbeat") == [None]
    assert fake.sent("DELETE", "/instances/{id}") == [None]


def test_blend_client_speaks_lmcache(stub: tuple[LMCacheStub, str]) -> None:
    fake, url = stub
    query = _request("blend lookup (BlendCoordinatorClient body)")
    raw = b64decode_strict(query["tokens_b64"])
    assert raw is not None
    tokens = np.frombuffer(raw, dtype="<u4")
    with BlendCoordinatorClient(url, request_timeout=10.0) as client:
        client.submit_match("r1", tokens, BlendNamespace("m", "", 1))
        matches = None
        for _ in range(500):
            matches = client.take_match("r1")
            if matches is not None:
                break
            threading.Event().wait(0.01)
    want = _reply("blend lookup (BlendCoordinatorClient body)")["matches"]
    assert matches is not None and client.failures == 0
    assert [(m.chunk_hash.hex(), m.old_st, m.cur_st) for m in matches] == [
        (m["chunk_hash"], m["old_st"], m["cur_st"]) for m in want
    ]
    sent = fake.sent("POST", "/directory/blend-lookup")
    assert sent == [query]  # byte for byte what LMCache's BlendCoordinatorClient sends
    _assert_lmcache_sends_it("POST", "/directory/blend-lookup", sent)


def test_event_sink_json_speaks_lmcache(stub: tuple[LMCacheStub, str]) -> None:
    fake, url = stub
    keys = _golden_keys()
    tokens = np.arange(16, dtype=np.uint32)
    sink = EventSink("mp-a", HttpTransport(url, fmt="json"), incarnation=1)
    try:
        sink.emit("config", "l1", "dram", capacity_bytes=1 << 30, capacity_revision=1)
        sink.emit("store", "l1", "dram", [CacheEntry(keys[0], 4096, tokens, 512)])
        sink.emit("store", "l2", "fs", [CacheEntry(keys[1], 4096)], shared=True)
        sink.emit("access", "l1", "dram", [CacheEntry(keys[0])])
        sink.emit("delete", "l1", "dram", [CacheEntry(keys[0])])
        assert sink.flush(timeout=30)
    finally:
        sink.close()
    bodies = fake.sent("POST", "/events")
    assert sum(len(b["batches"]) for b in bodies) == 5
    _assert_lmcache_sends_it("POST", "/events", bodies)
