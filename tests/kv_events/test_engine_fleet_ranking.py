"""Route scoring across a real fleet with a vLLM engine in it (issue 12 item 4): a fake engine
``pod-a`` (plain pyzmq PUB, golden-shaped ``KVEventBatch`` frames), two ``kvatlas node``
processes and a ``kvatlas coordinator`` with auth on, subscribed to the engine. The engine
holds the document in GPU memory and ranks first, the node holding only a fragment second,
the node whose copies sit under another tenant's salt last; after ``AllBlocksCleared`` on
``pod-a`` the engine falls behind the fragment holders (no node serves it: it reuses no
fragment, not even a peer's L1). Engines' chunks carry cache salt ""
(vLLM has no kvatlas salt), so salt A here is "": a token bound to it gets no score from salt
B's chunks, and a salt-B token none from the engine's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.api import RouteScoresReply
from kvatlas.client import RouteClient
from kvatlas.client.coordinator_client import CoordinatorError
from kvatlas.events.vllm_wire import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch
from kvatlas.node.toy_model import ToyRopeModel
from tests.conftest import wait_for
from tests.coordinator.security_support import bearer, token
from tests.coordinator.test_route_score_fleet import ranking
from tests.helpers import process_fleet, write_tokens
from tests.kv_events.helpers import HASHES, FakeEngine

C = 16  # the fleet's chunk size
BLOCK = 8  # the engine's vLLM block size: two blocks per chunk
SALT_A, SALT_B = "", "tenant-b"
TOPIC = "kv@pod-a@toy"
NODES = ("node-a", "node-b")
TOKENS = {name: token(name) for name in (*NODES, "router-a", "router-b")}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    path = write_tokens(
        tmp_path / "tokens.json",
        *(
            {
                "token": TOKENS[name],
                "roles": ["emit", "lookup"],
                "instance_ids": [name],
                "cache_salts": [SALT_A, SALT_B],
            }
            for name in NODES
        ),
        {"token": TOKENS["router-a"], "roles": ["lookup"], "cache_salts": [SALT_A]},
        {"token": TOKENS["router-b"], "roles": ["lookup"], "cache_salts": [SALT_B]},
    )
    engine = FakeEngine()
    flags = ["--auth-token-file", str(path), "--chunk-size", str(C), "--enable-blend-lookup",
             "--instance-timeout", "600", "--kv-events-subscribe", engine.endpoint,
             "--kv-events-replay", engine.replay_endpoint]  # fmt: skip
    try:
        nodes = {name: ["--coordinator-token", TOKENS[name]] for name in NODES}
        with process_fleet(flags, nodes) as fleet:
            yield {**fleet, "engine": engine}
    finally:
        engine.close()


def engine_stored(tokens: list[int]) -> bytes:
    """vLLM's current (map) encoding of one ``BlockStored`` on GPU: ``tokens`` as blocks of
    ``BLOCK`` with golden-shaped 32-byte hashes, no parent (the start of a sequence)."""
    blocks = len(tokens) // BLOCK
    hashes = [bytes([i]) + HASHES[0][1:] for i in range(blocks)]
    stored = BlockStored(hashes, None, tokens, BLOCK, medium="GPU")
    return encode_batch(KVEventBatch(1.0, [stored], 0), "map")


def subscriber_counts(coord: str) -> dict[str, int]:
    return dict(httpx.get(f"{coord}/healthz").json().get("kv_events", {}).get("subscriber", {}))


def engine_batches(coord: str) -> int:
    return int(subscriber_counts(coord).get("batches", 0))


def test_engine_prefix_first_fragment_node_second_other_salt_last(fleet: dict[str, Any]) -> None:
    coord, engine = fleet["coordinator"], fleet["engine"]
    a, b = fleet["node-a"], fleet["node-b"]
    model = ToyRopeModel(fleet["layout"])
    rng = np.random.default_rng(12)
    doc = rng.integers(0, 500, 4 * C).astype(np.uint32)  # the document, 4 chunks
    context = rng.integers(0, 500, 4 * C).astype(np.uint32)  # a text whose chunks 2, 3
    fragment = context[2 * C :]  # are quoted by the query
    query = np.concatenate([doc, [1, 2, 3, 4, 5], fragment, [6, 7, 8]]).astype(np.uint32)

    engine.send_until(0, engine_stored(doc.tolist()), lambda: engine_batches(coord) == 1,
                      topic=TOPIC)  # fmt: skip
    assert a.store(context, model.kv_chunks(context), cache_salt=SALT_A, request_id="a1") == 4
    # under salt B, node B holds the query's whole prefix: invisible to salt A
    head = query[: 6 * C]
    assert b.store(head, model.kv_chunks(head), cache_salt=SALT_B, request_id="b1") == 6

    expected = [
        # its GPU prefix; no fragment: no node serves pod-a (no connector), and vLLM reuses
        # only a prefix of its own blocks, never a peer's L1 at another offset
        ("pod-a", 4 * C, 0, round(1.0 * 64, 3)),
        ("node-a", 0, 2 * C, round(0.85 * 0.8 * 32, 3)),  # its own L1 (not the engine's GPU)
        ("node-b", 0, 2 * C, round(0.85 * 0.6 * 32, 3)),  # A's L1 as peer, nothing of salt B
    ]
    seen: list[Any] = []

    def settles(router: RouteClient, salt: str, want: list[Any]) -> bool:
        return wait_for(
            lambda: (
                seen.append(ranking(router.score(query, "toy", cache_salt=salt)))
                or seen[-1] == want
            ),
            timeout=30,
        )

    with RouteClient(coord, token=TOKENS["router-a"]) as router:
        assert settles(router, SALT_A, expected), f"{seen[-1]} {subscriber_counts(coord)}"
        assert subscriber_counts(coord)["errors"] == 0  # auth on: engines need no registration
        with pytest.raises(CoordinatorError) as refused:
            router.score(query, "toy", cache_salt=SALT_B)
        assert refused.value.reply_status == 403

        # salt B: node B's copies count (once its node reported them: the wait above was for
        # salt A), the engine's (salt "") do not
        with RouteClient(coord, token=TOKENS["router-b"]) as router_b:
            scores: list[RouteScoresReply] = []

            def node_b_reported() -> bool:
                scores.append(router_b.score(query, "toy", cache_salt=SALT_B))
                rows = {s.instance_id: s for s in scores[-1].instances}
                return (scores[-1].best, rows["node-b"].prefix_tokens) == ("node-b", 6 * C)

            assert wait_for(node_b_reported, timeout=30), scores[-1]
        rows = {s.instance_id: s for s in scores[-1].instances}
        assert (rows["pod-a"].prefix_tokens, rows["pod-a"].by_tier["gpu"]) == (0, 0)

        engine.send_until(1, encode_batch(KVEventBatch(2.0, [AllBlocksCleared()], 0), "map"),
                          lambda: engine_batches(coord) == 2, topic=TOPIC)  # fmt: skip
        after = [
            ("node-a", 0, 2 * C, round(0.85 * 0.8 * 32, 3)),
            ("node-b", 0, 2 * C, round(0.85 * 0.6 * 32, 3)),
            ("pod-a", 0, 0, 0.0),  # nothing left it can reuse
        ]
        assert settles(router, SALT_A, after), f"{seen[-1]} {subscriber_counts(coord)}"
        # the node's copies under salt B survive the engine's clear
        found = httpx.post(
            f"{coord}/directory/lookup",
            json={"token_ids": head.tolist(), "model_name": "toy", "cache_salt": SALT_B},
            headers=bearer(TOKENS["router-b"]),
        ).json()
        assert [(h["instance_id"], h["chunks"]) for h in found["prefix"]] == [("node-b", 6)]
