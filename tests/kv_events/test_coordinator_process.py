"""A real ``kvatlas coordinator`` process between a vLLM-like engine and a router (loopback):
engine events in (lookups, blend, ``GET /instances``, ``/healthz`` and ``/metrics`` see the
engine like a node), node placements out (a router's plain pyzmq view), docs/kv-events.md."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from kvatlas.client import EventSink, HttpTransport
from kvatlas.coordinator.server import free_port
from kvatlas.events import CacheEntry
from kvatlas.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.coordinator.helpers import running
from tests.kv_events.helpers import TOKENS, FakeEngine, golden
from tests.kv_events.router_view import RouterView

C = 16


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine()
    yield e
    e.close()


def test_engine_in_and_node_placements_out(engine: FakeEngine) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_service(
        ["-m", "kvatlas.cli", "coordinator", "--port", str(port), "--chunk-size", str(C),
         "--enable-blend-lookup",
         "--kv-events-subscribe", engine.endpoint, "--kv-events-replay", engine.replay_endpoint,
         "--kv-events-publish", out, "--kv-events-replay-bind", replay],
        url,
    )  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    sink = EventSink("node-1", HttpTransport(url), backoff_max=0.2)
    router = RouterView(ctx, out, replay)
    try:

        def engine_batches() -> int:
            kv = HTTP.get(f"{url}/healthz").json().get("kv_events", {})
            return int(kv.get("subscriber", {}).get("batches", 0))

        # In: the engine's golden batch, as the coordinator's lookups see it.
        engine.send_until(0, golden("legacy-array-stored"), lambda: engine_batches() == 1)
        found = httpx.post(
            f"{url}/directory/lookup", json={"token_ids": TOKENS, "model_name": "llama"}
        ).json()
        assert [(h["instance_id"], h["tier"], h["chunks"]) for h in found["prefix"]] == [
            ("pod-a", "gpu", 2)
        ]
        blend = httpx.post(
            f"{url}/directory/blend-lookup",
            json={"token_ids": [1, 2, 3, *TOKENS[16:32]], "model_name": "llama"},
        ).json()
        assert [(m["old_st"], m["cur_st"]) for m in blend["matches"]] == [(16, 3)]
        instances = {i["instance_id"]: i for i in httpx.get(f"{url}/instances").json()["instances"]}
        assert "pod-a" in instances
        # an engine is a route candidate by default, like a live node
        scores = httpx.post(
            f"{url}/route/score", json={"token_ids": TOKENS, "model_name": "llama"}
        ).json()
        assert [(s["instance_id"], s["prefix_tokens"]) for s in scores["instances"]] == [
            ("pod-a", 32)
        ]
        engine.send(1, golden("current-cleared"))
        assert wait_for(lambda: engine_batches() == 2)
        found = httpx.post(
            f"{url}/directory/lookup", json={"token_ids": TOKENS, "model_name": "llama"}
        ).json()
        assert found["prefix"] == []
        health = httpx.get(f"{url}/healthz").json()
        assert list(health)[-1] == "kv_events"
        assert health["kv_events"]["subscriber"]["clears"] == 1
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvatlas_kv_events_subscriber_total{counter="clears"} 1.0' in metrics
        # what can go down is a gauge of its own, never a counter (rate() would misread it)
        assert "# TYPE kvatlas_kv_events_subscriber_engines gauge" in metrics
        assert "kvatlas_kv_events_subscriber_engines 1.0" in metrics
        assert 'counter="engines"' not in metrics and 'counter="tracked_blocks"' not in metrics

        # Out: a node's placement, as a router sees it; the engine's never.
        row = np.arange(C, dtype=np.uint32)
        key = ObjectKey(chunk_hashes(row, C)[0], "m", pack_kv_rank(1, 0, 1, 0))
        sink.emit("store", "l1", "dram", [CacheEntry(key, 64, row, 0)])
        assert sink.flush(30)
        want = {"kv@node-1@m": {"kvatlas-l1": {key.chunk_hash}}}
        router.replay()
        assert wait_for(lambda: router.pump() == want, timeout=15)
    finally:
        router.close()
        sink.close(timeout=1)
        stop([proc])
        ctx.term()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_forgotten_engine_is_no_candidate_until_it_publishes_again(engine: FakeEngine) -> None:
    """An engine silent beyond --emitter-retention-s is forgotten like any emitter: no route
    candidate, not listed, until it publishes again."""
    clock = Clock()
    config = {"emitter_retention_s": 60.0, "kv_events_subscribe": engine.endpoint}
    with running(clock, chunk_size=C, **config) as (server, c):

        def engine_batches() -> int:
            return int(c.get("/healthz").json()["kv_events"]["subscriber"]["batches"])

        def candidates() -> list[tuple[str, int]]:
            scores = c.post("/route/score", json={"token_ids": TOKENS, "model_name": "llama"})
            return [(s["instance_id"], s["prefix_tokens"]) for s in scores.json()["instances"]]

        engine.send_until(0, golden("legacy-array-stored"), lambda: engine_batches() == 1)
        assert candidates() == [("pod-a", 32)]
        clock.now += 61
        assert wait_for(lambda: "pod-a" in server.service.forget_departed() or not candidates())
        assert candidates() == []
        assert c.get("/instances").json()["instances"] == []
        engine.send(1, golden("legacy-array-stored"))
        assert wait_for(lambda: candidates() == [("pod-a", 32)])


def test_a_full_block_map_is_counted_shown_and_logged(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Blocks evicted at --kv-events-max-blocks are counted in /metrics beside the bound and
    the blocks tracked, and logged (the first, then at powers of two): never silent."""
    config = {"kv_events_subscribe": engine.endpoint, "kv_events_max_blocks": 4}
    with caplog.at_level("WARNING"), running(chunk_size=C, **config) as (_, c):

        def subscriber() -> dict[str, int]:
            return dict(c.get("/healthz").json()["kv_events"]["subscriber"])

        engine.send_until(0, golden("legacy-array-stored"), lambda: subscriber()["batches"] == 1)
        assert subscriber()["evicted_blocks"] == 0 and subscriber()["tracked_blocks"] == 4
        engine.send(1, golden("legacy-array-int-hashes"))  # other blocks: the oldest go
        assert wait_for(lambda: subscriber()["batches"] == 2)
        evicted = subscriber()["evicted_blocks"]
        metrics = c.get("/metrics").text
    assert evicted > 0
    assert f'kvatlas_kv_events_subscriber_total{{counter="evicted_blocks"}} {evicted}.0' in metrics
    assert "kvatlas_kv_events_subscriber_tracked_blocks 4.0" in metrics
    assert "kvatlas_kv_events_subscriber_max_blocks 4.0" in metrics
    warned = [r.getMessage() for r in caplog.records if "block map is full" in r.getMessage()]
    assert warned and "--kv-events-max-blocks 4" in warned[0]
