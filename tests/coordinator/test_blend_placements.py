"""``POST /directory/blend-lookup?with_placements=true``: each match names the instances that
hold its chunk in the query's namespace (every rank, both tiers); without the parameter (or
with ``false``) the reply is byte-identical to the plain one (golden replies pin its bytes)."""

from __future__ import annotations

import httpx

from tests.coordinator.helpers import Emitter, b64, fresh, fresh_tokens, post_batches

PATH = "/directory/blend-lookup"


def test_matches_carry_their_holders_only_on_request(client: httpx.Client) -> None:
    model = fresh("model")
    doc = fresh_tokens(2)
    a, b = Emitter(), Emitter()
    stores = [
        a.store_chunks(doc, model=model, ws=2),  # both ranks, L1 of a
        b.store_chunks(doc, model=model, ws=2, ranks=[1], n_chunks=1, tier="l2", backend="fs"),
        Emitter().store_chunks(doc, model=model, ws=1),  # another namespace (world size 1)
    ]
    assert post_batches(client, *stores).status_code == 200
    body = {"tokens_b64": b64([7, 7, *doc]), "model_name": model, "world_size": 2}
    plain = client.post(PATH, json=body)
    for query in ("", "?with_placements=false", "?with_placements=0"):
        assert client.post(PATH + query, json=body).content == plain.content
    assert all("placements" not in m for m in plain.json()["matches"])

    rich = client.post(PATH + "?with_placements=true", json=body).json()["matches"]
    assert [(m["chunk_hash"], m["cur_st"]) for m in rich] == [
        (m["chunk_hash"], m["cur_st"]) for m in plain.json()["matches"]
    ]
    held = [
        sorted((p["instance_id"], p["tier"], p["kv_rank"] >> 16 & 0xFF) for p in m["placements"])
        for m in rich
    ]
    assert held == [
        sorted([(a.instance_id, "l1", 0), (a.instance_id, "l1", 1), (b.instance_id, "l2", 1)]),
        sorted([(a.instance_id, "l1", 0), (a.instance_id, "l1", 1)]),
    ]
