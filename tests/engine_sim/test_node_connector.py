"""``--node-url``: engine-sim reuses KV through a real kvatlas node (real processes on loopback).
A node that is not up yet is a miss and the engine serves on; once it is up, one engine's
computed chunks serve another engine's prefix (``cached_tokens``) and, at another offset, its
fragments (counted apart, partly recomputed); an unrelated prompt finds nothing."""

from __future__ import annotations

from typing import Any

import httpx

from kvatlas.asgi_thread import free_port
from kvatlas.processes import spawn_service, stop
from tests.conftest import wait_for
from tests.engine_sim.harness import MODEL, EngineProcess

CHUNK = 32


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_engines_share_prefixes_and_fragments_through_a_node() -> None:
    node_port = free_port()
    node_url = f"http://127.0.0.1:{node_port}"
    flags = ("--node-url", node_url, "--node-timeout-s", "60")
    a, b = EngineProcess(*flags), EngineProcess(*flags)
    node = None
    try:
        doc = list(
            range(120_000, 120_100)
        )  # 100 tokens (ids beyond 16 bits): 3 chunks of 32, 6 blocks of 16
        assert cached(a.complete(doc, 2)) == 0  # no node yet: served, the miss counted
        assert a.healthz()["connector"]["layout_failures"] >= 1
        node = spawn_service(
            ["-m", "kvatlas.cli", "node", "--port", str(node_port), "--model-name", MODEL,
             "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "2",
             "--chunk-size", str(CHUNK), "--dtype", "float16", "--l2", "none"],
            node_url,
        )  # fmt: skip
        assert cached(a.complete(doc, 2)) == 96  # its own GPU; its chunks go to the node now
        assert wait_for(lambda: a.healthz()["connector"].get("stored_chunks", 0) >= 3, 60)

        assert cached(b.complete(doc, 2)) == 96  # a cold engine: the prefix from the node
        health = b.healthz()
        assert health["scheduler"]["node_hit_tokens"] == 96
        assert (
            health["scheduler"]["prefix_hits"] == 0 and health["connector"]["chunks_local_l1"] == 3
        )

        before = health["scheduler"]["fragment_tokens"]
        rag = (
            list(range(100_000, 100_040)) + doc[:64] + list(range(110_000, 110_040))
        )  # the doc at offset 40
        assert cached(b.complete(rag, 2)) == 0  # not a prefix: no cached tokens...
        assert b.healthz()["scheduler"]["fragment_tokens"] - before == 64  # ...but a fragment

        stats = httpx.get(f"{node_url}/engine/stats", headers={"Accept": "application/json"})
        assert stats.status_code == 200
        unrelated = list(range(125_000, 125_100))
        assert cached(b.complete(unrelated, 1)) == 0  # the negative control
        assert b.healthz()["scheduler"]["node_hit_tokens"] == 96
    finally:
        if node is not None:
            stop([node])
        a.close()
        b.close()


def node_chunks(node_url: str) -> tuple[int, int]:
    """The chunks a node was given to store, and the chunks its L1 holds."""
    stats = httpx.get(f"{node_url}/engine/stats", headers={"Accept": "application/json"})
    assert stats.status_code == 200, stats.text
    body = stats.json()
    return int(body.get("chunks_stored", 0)), int(body["l1_chunks"])


def test_a_node_of_another_model_is_refused() -> None:
    """The node holds KV of model ``llama-3-8b`` (its --model-name), the simulator serves
    ``sim``: its KV is zeros, so using that node would write zeros under the real model's keys
    (the old code checked only the chunk size, and stored 3 chunks there). The connector stays
    off, counted (``/healthz`` → ``connector.node_refused``) and logged naming both models;
    requests are served without it."""
    node_port = free_port()
    node_url = f"http://127.0.0.1:{node_port}"
    node = spawn_service(
        ["-m", "kvatlas.cli", "node", "--port", str(node_port), "--model-name", "llama-3-8b",
         "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "2",
         "--chunk-size", str(CHUNK), "--dtype", "float16", "--l2", "none"],
        node_url,
    )  # fmt: skip
    engine = EngineProcess("--node-url", node_url, "--node-timeout-s", "60")
    try:
        doc = list(range(120_000, 120_100))  # 3 chunks of 32
        assert cached(engine.complete(doc, 2)) == 0
        assert cached(engine.complete(doc, 2)) == 96  # served: its own GPU cache
        connector = engine.healthz()["connector"]
        assert connector.get("node_refused") == 1, connector
        assert connector.get("stored_chunks", 0) == 0 and connector.get("lookups", 0) == 0
        assert node_chunks(node_url) == (0, 0)
    finally:
        engine.close()
        stop([node])
