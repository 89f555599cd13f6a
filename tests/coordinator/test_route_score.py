"""``POST /route/score`` over real loopback HTTP: the worked example of docs/route-scoring.md
(read through :class:`RouteClient` and ``kvatlas route``), weights, fencing, engine tiers
arriving through the ordinary consume path, and bad input answered exactly like the blend
lookup answers it."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.auth import ANONYMOUS_ADMIN
from kvatlas.cli import main
from kvatlas.client import RouteClient
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.instances import Registration
from kvatlas.coordinator.query import BlendQuery
from kvatlas.coordinator.route_score import RouteScoring, score_routes
from kvatlas.coordinator.scoring import MAX_WEIGHT, TIER_CLASSES, Weights, instance_score
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import BlendNamespace, KeyScheme, ObjectKey, chunk_hashes
from tests.coordinator.helpers import (
    CS,
    RANK1,
    Emitter,
    assert_error,
    fresh,
    fresh_tokens,
    post_batches,
    running,
)
from tests.coordinator.security_support import bearer, token, write_tokens

ZERO = {"gpu": 0, "l1": 0, "l2": 0, "peer": 0}


def rows(reply: dict[str, Any]) -> list[tuple[str, int, int, float, dict[str, int]]]:
    return [
        (r["instance_id"], r["prefix_tokens"], r["fragment_tokens"], r["score"], r["by_tier"])
        for r in reply["instances"]
    ]


@pytest.fixture
def example(client: httpx.Client) -> dict[str, Any]:
    """docs/route-scoring.md's worked example: A holds the document's first two chunks in L1
    and the third in its own L2, B holds another text in L1 (its second chunk also in a
    shared pool), C is registered and empty. The query is the document's three chunks, two
    new tokens, B's text, one new token."""
    a, b, c = (fresh(n) for n in "abc")
    for inst in (a, b, c):
        assert client.post("/instances", json={"instance_id": inst}).status_code == 200
    model = fresh("model")
    doc, other = fresh_tokens(3), fresh_tokens(2)
    ea, eb = Emitter(a), Emitter(b)
    r = post_batches(
        client,
        ea.store_chunks(doc, model=model, n_chunks=2),
        eb.store_chunks(other, model=model),
        ea.batch("store", tier="l2", backend="disk", entries=_chunk(doc, 2, model)),
        ea.batch("store", tier="l2", backend="pool", shared=True, entries=_chunk(other, 1, model)),
    )
    assert r.status_code == 200, r.text
    query = [*doc, 7, 7, *other, 7]
    return {"a": a, "b": b, "c": c, "model": model, "query": query}


def _chunk(tokens: list[int], j: int, model: str) -> list[dict[str, Any]]:
    h = chunk_hashes(tokens, CS)[j]
    key = {"chunk_hash_hex": h.hex(), "model_name": model, "kv_rank": RANK1}
    part = tokens[j * CS : (j + 1) * CS]
    return [{"key": key, "size_bytes": 10, "token_ids": part, "token_offset": j * CS}]


def test_worked_example_ranks_prefix_holder_then_fragment_holder_then_empty(
    client: httpx.Client, example: dict[str, Any]
) -> None:
    a, b, c = example["a"], example["b"], example["c"]
    body = {"token_ids": example["query"], "model_name": example["model"], "instances": [c, b, a]}
    reply = client.post("/route/score", json=body).json()
    assert reply["query_tokens"] == 23
    assert rows(reply) == [
        # prefix: 2 chunks l1 + 1 chunk own l2; fragments: B's text from B's L1 (peer)
        (a, 12, 8, 0.8 * 8 + 0.5 * 4 + 0.85 * 0.6 * 8, {**ZERO, "l1": 8, "l2": 4, "peer": 8}),
        # no prefix; A's L1 chunks as peer fragments (A's own L2 is out of reach), own text
        (b, 0, 16, 0.85 * (0.6 * 8 + 0.8 * 8), {**ZERO, "l1": 8, "peer": 8}),
        # everything it can reach is a peer's L1 (the pool's copy is worth less than a peer's)
        (c, 0, 16, 0.85 * 0.6 * 16, {**ZERO, "peer": 16}),
    ]
    without_peers = {**body, "weights": {"peer": 0}}
    reply = client.post("/route/score", json=without_peers).json()
    assert [(r[0], r[3]) for r in rows(reply)] == [
        # now the pool's copy of B's second chunk is worth more than a peer's
        (a, 0.8 * 8 + 0.5 * 4 + 0.85 * 0.5 * 4),
        (b, 0.85 * 0.8 * 8),
        (c, 0.85 * 0.5 * 4),
    ]


def test_client_and_cli_read_the_same_ranking(
    server: BackgroundServer,
    client: httpx.Client,
    example: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b, c = example["a"], example["b"], example["c"]
    with RouteClient(server.url) as route:
        scores = route.score(example["query"], example["model"], instances=[a, b, c])
    assert scores.best == a and [s.instance_id for s in scores.instances] == [a, b, c]
    assert scores.instances[1].by_tier == {**ZERO, "l1": 8, "peer": 8}
    tokens = tmp_path / "query.json"
    tokens.write_text(json.dumps(example["query"]))
    argv = ["route", "--url", server.url, "--tokens-file", str(tokens)]
    argv += ["--model-name", example["model"], "--instances", f"{c},{b},{a}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index(a) < out.index(b) < out.index(c)
    assert main(["route", "--url", server.url, "--tokens-file", str(tokens)]) == 1  # no model
    assert "model_name is required" in capsys.readouterr().err


def test_fenced_instance_drops_out_and_its_l1_with_it(
    client: httpx.Client, example: dict[str, Any]
) -> None:
    a, b, c = example["a"], example["b"], example["c"]
    assert client.delete(f"/instances/{a}").status_code == 204  # LMCache: no body
    body = {"token_ids": example["query"], "model_name": example["model"]}
    reply = client.post("/route/score", json=body).json()
    mine = [r for r in rows(reply) if r[0] in (a, b, c)]  # default: every live instance
    assert mine == [
        (b, 0, 8, 0.85 * 0.8 * 8, {**ZERO, "l1": 8}),
        (c, 0, 8, 0.85 * 0.6 * 8, {**ZERO, "peer": 8}),
    ]


def test_scoring_latency_is_a_metric(client: httpx.Client) -> None:
    def count() -> float:
        families = text_string_to_metric_families(client.get("/metrics").text)
        return sum(
            s.value
            for f in families
            for s in f.samples
            if s.name == "kvatlas_route_score_seconds_count"
        )

    before = count()
    assert client.post("/route/score", json={"token_ids": [1], "model_name": "m"}).is_success
    assert count() == before + 1


def test_empty_query_scores_zero(client: httpx.Client) -> None:
    reply = client.post("/route/score", json={"token_ids": [], "instances": ["x"]}).json()
    assert reply == {
        "instances": [
            {
                "instance_id": "x",
                "prefix_tokens": 0,
                "fragment_tokens": 0,
                "score": 0.0,
                "by_tier": ZERO,
            }
        ],
        "query_tokens": 0,
    }


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": [1]},
        {"token_ids": [1], "tokens_b64": "AQAAAA==", "model_name": "m"},
        {"token_ids": [1], "model_name": "m", "world_size": 0},
        {"token_ids": [-1], "model_name": "m"},
        {"tokens_b64": "AQAAA", "model_name": "m"},
        {"tokens_b64": "AQAAAAE=", "model_name": "m"},
        {"token_ids": [1], "model_name": "m", "cache_salt": 5},
        {"token_ids": [1], "model_name": ""},
        [1],
        "",
    ],
)
def test_bad_bodies_answered_like_blend_lookup(client: httpx.Client, body: object) -> None:
    blend = client.post("/directory/blend-lookup", json=body)
    route = client.post("/route/score", json=body)
    assert_error(route, 422)
    assert (route.status_code, route.json()) == (blend.status_code, blend.json())


@pytest.mark.parametrize(
    ("extra", "status", "words"),
    [
        ({"weights": {"nvme": 1.0}}, 422, "unknown tier"),
        ({"weights": {"l1": -1}}, 422, "weights.l1"),
        ({"weights": {"l1": "x"}}, 422, "weights"),
        ({"weights": {"l1": 1e306}}, 422, "weights.l1"),  # x 256 tokens: inf, sent as null
        ({"weights": {"gpu": 1.0000001e12}}, 422, "weights.gpu"),
        ({"instances": ["../etc"]}, 422, "instances[0]"),
        ({"instances": "a"}, 422, "instances"),
        ({"instances": [f"i{k}" for k in range(10_001)]}, 413, "--max-instances"),
    ],
)
def test_bad_instances_and_weights(
    client: httpx.Client, extra: dict[str, Any], status: int, words: str
) -> None:
    r = client.post("/route/score", json={"token_ids": [1, 2], "model_name": "m", **extra})
    assert words in assert_error(r, status)["detail"]


def test_the_largest_weights_give_finite_scores_the_client_reads(client: httpx.Client) -> None:
    """Weights were any finite number: 1e306 made a 512-token query's score overflow to inf,
    which the reply carries as ``null`` and ``RouteClient`` refuses. The largest weight allowed
    scores the longest query finitely."""
    tokens, em = fresh_tokens(2), Emitter()
    assert post_batches(client, em.store_chunks(tokens)).status_code == 200  # on its L1
    body = {"token_ids": tokens, "model_name": "m", "instances": [em.instance_id]}
    weights = dict.fromkeys(("gpu", "l1", "l2", "peer"), MAX_WEIGHT)
    r = client.post("/route/score", json={**body, "weights": weights})
    assert r.status_code == 200, r.text
    (row,) = r.json()["instances"]
    assert row["prefix_tokens"] == 2 * CS and math.isfinite(row["score"]) and row["score"] > 0
    assert math.isfinite(MAX_WEIGHT * CoordinatorConfig().max_query_tokens * 4)


def test_the_fragment_weight_is_bounded_as_the_tier_weights_are() -> None:
    """``--fragment-weight`` multiplies a fragment score: any finite one was taken, and 1e308
    times one fragment chunk is inf (a ``null`` score). At the bounds every score is finite."""
    for bad in (1e308, MAX_WEIGHT * 1.0000001, -1.0, math.nan):
        with pytest.raises(ValueError, match="fragment"):
            Weights.of(None, bad)
        with pytest.raises(ValueError, match="--fragment-weight"):
            CoordinatorConfig(fragment_weight=bad)
    chunks = CoordinatorConfig().max_query_tokens // CS
    weights = Weights.of(dict.fromkeys(TIER_CLASSES, MAX_WEIGHT), MAX_WEIGHT)
    classes = [c for c in range(len(TIER_CLASSES)) for _ in range(chunks // len(TIER_CLASSES))]
    score = instance_score("i", classes, classes, CS, weights).score
    assert math.isfinite(score) and score > 0


@pytest.mark.parametrize(("tier", "score_class"), [("gpu", "gpu"), ("engine-cpu", "l1")])
def test_engine_tiers_through_the_consume_path(tier: str, score_class: str) -> None:
    """Engines' placements (issue 12 item 1: tier ``gpu``, ``engine-cpu`` for medium CPU) go
    through the same ``consume`` as nodes'; they score by the tier mapping, nothing else."""
    service = CoordinatorService(CoordinatorConfig(chunk_size=CS, enable_blend_lookup=True))
    tokens = list(range(10, 10 + 2 * CS))
    entries = tuple(
        CacheEntry(ObjectKey(h, "m", RANK1), 1, tokens[j * CS : (j + 1) * CS], j * CS)
        for j, h in enumerate(chunk_hashes(tokens, CS))
    )
    service.ingest([EventBatch("pod-a", 1, 1, "store", tier, "vllm", entries=entries)])
    service.instances.register("node-b", Registration())
    body = {"token_ids": tokens, "model_name": "m", "instances": ["pod-a", "node-b"]}
    raw = RouteScoring(service, ThreadPoolExecutor(1)).answer(
        json.dumps(body).encode(), ANONYMOUS_ADMIN
    )
    weight = {"gpu": 1.0, "l1": 0.8}[score_class]
    assert rows(json.loads(raw)) == [
        ("pod-a", 2 * CS, 0, weight * 2 * CS, {**ZERO, score_class: 2 * CS}),
        ("node-b", 0, 0, 0.0, ZERO),  # an engine's memory is not a peer's L1
    ]


def test_auth_role_and_salt(tmp_path: Path) -> None:
    """Role ``lookup`` is checked from the headers (asgi.ROUTES); a salt-bound token scores
    only its salts."""
    emit, lookup_a = token("emit"), token("lookup-a")
    tokens = write_tokens(
        tmp_path / "tokens.json",
        {"token": emit, "roles": ["emit"]},
        {"token": lookup_a, "roles": ["lookup"], "cache_salts": ["a"]},
    )
    body = {"token_ids": [1, 2, 3, 4], "model_name": "m", "instances": ["x"]}
    with running(auth_token_file=tokens) as (_, c):
        assert_error(c.post("/route/score", json=body), 401)
        assert (
            "lookup"
            in assert_error(c.post("/route/score", json=body, headers=bearer(emit)), 403)["detail"]
        )
        foreign = {**body, "cache_salt": "b"}
        assert (
            "b"
            in assert_error(c.post("/route/score", json=foreign, headers=bearer(lookup_a)), 403)[
                "detail"
            ]
        )
        own = c.post("/route/score", json={**body, "cache_salt": "a"}, headers=bearer(lookup_a))
        assert own.status_code == 200 and own.json()["query_tokens"] == 4


@pytest.mark.parametrize("plain", [True, False])
def test_an_engine_no_node_serves_reuses_no_fragment(plain: bool) -> None:
    """A plain vLLM engine (KV events, no kvatlas connector: no node serves it) reuses a prefix
    of its own blocks and nothing else: a document it holds at another offset is no reuse for
    it. Scored as fragments, it drew a request from the engine that holds the request's prefix
    (which reused it) to one that reused nothing. ``plain=False``: an engine a node serves
    (the connector blends), as before — the negative control."""
    directory = KeyDirectory(CS, enable_blend_lookup=True)
    system = list(range(1000, 1000 + 2 * CS))  # pod-b's prompt: the query's prefix
    doc = list(range(2000, 2000 + 4 * CS))  # pod-a's prompt, after one other chunk
    for engine, prompt in (("pod-b", system), ("pod-a", [7] * CS + doc)):
        entries = tuple(
            CacheEntry(ObjectKey(h, "m", RANK1), 1, prompt[j * CS : (j + 1) * CS], j * CS)
            for j, h in enumerate(chunk_hashes(prompt, CS))
        )
        directory.consume(EventBatch(engine, 1, 1, "store", "gpu", "vllm", entries=entries))
    query = np.array([*system, *doc, 9], np.uint32)
    scores = score_routes(
        directory,
        KeyScheme(chunk_size=CS),
        BlendQuery(query, BlendNamespace("m", "", 1)),
        ["pod-a", "pod-b"],
        frozenset(),
        Weights.of(None, 0.85),
        plain=frozenset({"pod-a", "pod-b"}) if plain else frozenset(),
    )
    got = {s.instance_id: (s.prefix_tokens, s.fragment_tokens) for s in scores}
    assert got == {"pod-b": (2 * CS, 0), "pod-a": (0, 0 if plain else 4 * CS)}
    assert scores[0].instance_id == ("pod-b" if plain else "pod-a")
