"""Success paths of every endpoint of coordinator.md §2, over real loopback HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.events import TIERS, CacheEntry, EventBatch, encode_msgpack
from kvatlas.keys import ObjectKey
from tests.coordinator.helpers import (
    CS,
    RANK1,
    Emitter,
    b64,
    fresh,
    fresh_tokens,
    hashes,
    holders,
    lookup_tokens,
    metric_value,
    placements_by_key,
    post_batches,
    running,
    stats,
    wire_batch,
    wire_entry,
    wire_key,
)

# ---------------------------------------------------------------------------------------- events


def test_post_events_json_applies_and_lookup_sees_it(client: httpx.Client) -> None:
    em = Emitter()
    tokens = fresh_tokens(2)
    before = stats(client)
    r = post_batches(client, em.store_chunks(tokens))
    assert r.status_code == 200, r.text
    assert r.json() == {"applied": 1, "duplicates": 0, "stale": 0}
    after = stats(client)
    assert after["keys"] == before["keys"] + 2
    assert after["placements"] == before["placements"] + 2
    assert after["l1_placements_by_instance"][em.instance_id] == 2
    reply = lookup_tokens(client, tokens)
    assert reply["chunks"] == 2
    assert placements_by_key(reply) == [{(em.instance_id, "l1", "dram")}] * 2


def _msgpack_batch(instance_id: str, tokens: list[int], seq: int = 1) -> EventBatch:
    arr = np.asarray(tokens, dtype=np.uint32)
    entries = tuple(
        CacheEntry(ObjectKey(h, "m", RANK1), 64, arr[i * CS : (i + 1) * CS], i * CS)
        for i, h in enumerate(hashes(tokens))
    )
    return EventBatch(instance_id, 7, seq, "store", "l2", "fs", entries=entries)


@pytest.mark.parametrize(
    "content_type",
    ["application/msgpack", "application/x-msgpack", "application/msgpack; charset=binary"],
)
def test_post_events_msgpack(client: httpx.Client, content_type: str) -> None:
    inst, tokens = fresh("mp"), fresh_tokens(3)
    body = encode_msgpack([_msgpack_batch(inst, tokens)])
    r = client.post("/events", content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    assert r.json() == {"applied": 1, "duplicates": 0, "stale": 0}
    reply = lookup_tokens(client, tokens)
    assert placements_by_key(reply) == [{(inst, "l2", "fs")}] * 3
    assert {p["size_bytes"] for r in reply["results"] for p in r["placements"]} == {64}
    # the same body again is a duplicate, not a second apply
    r = client.post("/events", content=body, headers={"content-type": content_type})
    assert r.json() == {"applied": 0, "duplicates": 1, "stale": 0}


def test_msgpack_tokens_are_bound_like_json(client: httpx.Client) -> None:
    """msgpack content reaches the blend index: a fragment query finds it."""
    inst, tokens = fresh("mpb"), fresh_tokens(1)
    body = encode_msgpack([_msgpack_batch(inst, tokens)])
    r = client.post("/events", content=body, headers={"content-type": "application/msgpack"})
    assert r.status_code == 200, r.text
    query = [1, 2, *tokens, 3]
    r = client.post("/directory/blend-lookup", json={"tokens_b64": b64(query), "model_name": "m"})
    assert r.status_code == 200, r.text
    assert r.json()["matches"] == [
        {"chunk_hash": hashes(tokens)[0].hex(), "old_st": 0, "cur_st": 2}
    ]


def test_duplicate_and_stale_batches_counted(client: httpx.Client) -> None:
    inst = fresh("gate")
    k1, k2, k3 = (wire_key(bytes([n]) * 32, model=fresh("gm")) for n in (1, 2, 3))
    first = wire_batch(inst, 5, 1, entries=[wire_entry(k1)])
    assert post_batches(client, first).json() == {"applied": 1, "duplicates": 0, "stale": 0}
    # same (incarnation, seq) with a different payload: duplicate, dropped
    dup = wire_batch(inst, 5, 1, entries=[wire_entry(k2)])
    stale = wire_batch(inst, 4, 9, entries=[wire_entry(k3)])
    nxt = wire_batch(inst, 5, 2, entries=[wire_entry(k3)])
    r = post_batches(client, dup, stale, nxt)
    assert r.status_code == 200, r.text
    assert r.json() == {"applied": 1, "duplicates": 1, "stale": 1}
    found = client.post("/directory/lookup", json={"keys": [k1, k2, k3]}).json()
    assert [len(x["placements"]) for x in found["results"]] == [1, 0, 1]


def test_higher_incarnation_fences_l1_keeps_l2(client: httpx.Client) -> None:
    em = Emitter()
    tokens = fresh_tokens(2)
    assert post_batches(client, em.store_chunks(tokens)).status_code == 200
    assert post_batches(client, em.store_chunks(tokens, tier="l2", backend="fs")).status_code == 200
    em.incarnation, em.seq = em.incarnation + 1, 0
    r = post_batches(client, em.batch("access", backend=""))
    assert r.json() == {"applied": 1, "duplicates": 0, "stale": 0}
    assert placements_by_key(lookup_tokens(client, tokens)) == [{(em.instance_id, "l2", "fs")}] * 2


def test_config_event_accepted_and_reported(client: httpx.Client) -> None:
    em = Emitter()
    cfg = em.batch("config", backend="", capacity_bytes=12345, capacity_revision=1)
    r = post_batches(client, cfg)
    assert r.status_code == 200, r.text
    assert r.json() == {"applied": 1, "duplicates": 0, "stale": 0}
    assert stats(client)["capacity_bytes_by_instance"][em.instance_id] == 12345


def test_delete_event_removes_placement(client: httpx.Client) -> None:
    em = Emitter()
    tokens = fresh_tokens(2)
    post_batches(client, em.store_chunks(tokens))
    key0 = wire_key(hashes(tokens)[0])
    r = post_batches(client, em.batch("delete", entries=[wire_entry(key0)]))
    assert r.json()["applied"] == 1
    assert [len(x) for x in placements_by_key(lookup_tokens(client, tokens))] == [0, 1]


# ---------------------------------------------------------------------------------------- lookup


def test_lookup_keys_form(client: httpx.Client) -> None:
    em_a, em_b = Emitter(fresh("a")), Emitter(fresh("b"))
    tokens = fresh_tokens(3)
    post_batches(client, em_b.store_chunks(tokens, n_chunks=2, tier="l2", backend="fs"))
    post_batches(client, em_a.store_chunks(tokens, n_chunks=3))
    keys = [wire_key(h) for h in hashes(tokens)]
    absent = wire_key(b"\x07" * 32, model=fresh("nobody"))
    r = client.post("/directory/lookup", json={"keys": [*keys, absent]})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["chunks"] == 4
    assert [x["key"] for x in reply["results"]] == [*keys, absent]
    pls = [[(p["instance_id"], p["tier"]) for p in x["placements"]] for x in reply["results"]]
    # sorted by (instance, tier, backend): a < b
    assert pls == [
        [(em_a.instance_id, "l1"), (em_b.instance_id, "l2")],
        [(em_a.instance_id, "l1"), (em_b.instance_id, "l2")],
        [(em_a.instance_id, "l1")],
        [],
    ]
    assert holders(reply) == {
        (em_a.instance_id, "l1", "dram", False): 3,
        (em_b.instance_id, "l2", "fs", False): 2,
    }


def test_lookup_keys_form_refuses_a_group_id_no_event_can_carry(client: httpx.Client) -> None:
    """An object group id is a u64 on every wire (``POST /events`` refuses 2^64): a key that
    names one above it is a 422 naming the field (as a negative one), not a lookup of a key no copy can have."""
    key = wire_key(b"\x07" * 32) | {"object_group_id": 1 << 64}
    r = client.post("/directory/lookup", json={"keys": [key]})
    assert r.status_code == 422, r.text
    assert "object_group_id" in r.json()["detail"]
    ok = client.post("/directory/lookup", json={"keys": [key | {"object_group_id": (1 << 64) - 1}]})
    assert ok.status_code == 200, ok.text
    tokens = {"token_ids": list(range(256)), "model_name": "m", "object_group_id": 1 << 64}
    r = client.post("/directory/lookup", json=tokens)
    assert r.status_code == 422 and "object_group_id" in r.json()["detail"], r.text


def test_lookup_keys_form_counts_the_keys_asked(client: httpx.Client) -> None:
    """``chunks`` of the keys form is how many keys were asked, repeats and other ranks of
    one chunk included, as LMCache 0.5.6's coordinator answers (``len(obj_keys)``; measured
    against it: 3 keys of 2 hashes → 3, one key 5 times → 5). It counted distinct hashes."""
    em = Emitter()
    tokens = fresh_tokens(2)
    post_batches(client, em.store_chunks(tokens, ws=2))
    h0, h1 = hashes(tokens)
    rank0, rank1 = wire_key(h0, ws=2, rank=0), wire_key(h0, ws=2, rank=1)
    for keys, n in (([rank0, rank0, wire_key(h1, ws=2)], 3), ([rank0] * 5, 5), ([rank0, rank1], 2)):
        r = client.post("/directory/lookup", json={"keys": keys})
        assert r.status_code == 200, r.text
        assert (r.json()["chunks"], len(r.json()["results"])) == (n, n)


def test_lookup_tokens_form_reaches_every_object_group(client: httpx.Client) -> None:
    """As LMCache 0.5.6's coordinator answers (``get_keys_across_object_groups``): each key of
    a token lookup (object group 0) is followed by the keys its chunk is stored under in other
    groups (same model, rank and salt), in ascending group order; ``chunks`` and the prefix
    summary stay those of the query's own keys. A copy stored in group 1 only was missing."""
    em, tokens = Emitter(), fresh_tokens(2)
    h0, h1 = hashes(tokens)
    entries = [
        wire_entry(wire_key(h0, group=3), size=100, tokens=tokens[:CS], offset=0),
        wire_entry(wire_key(h0, group=1), size=100, tokens=tokens[:CS], offset=0),
        wire_entry(wire_key(h1), size=100, tokens=tokens[CS:], offset=CS),
        wire_entry(wire_key(h1, salt="other", group=2), size=100, tokens=tokens[CS:], offset=CS),
    ]
    assert post_batches(client, em.batch("store", entries=entries)).status_code == 200
    reply = lookup_tokens(client, tokens)
    assert reply["chunks"] == 2
    got = [(r["key"]["chunk_hash_hex"], r["key"]["object_group_id"], len(r["placements"]))
           for r in reply["results"]]  # fmt: skip
    assert got == [(h0.hex(), 0, 0), (h0.hex(), 1, 1), (h0.hex(), 3, 1), (h1.hex(), 0, 1)]
    assert all(r["token_ids"] for r in reply["results"][1:])
    assert holders(reply) == {}  # chunk 0 is not held in the query's group: no prefix


def test_a_token_lookup_finds_copies_when_no_key_is_in_group_0() -> None:
    """The other groups were looked for only once the directory's keys spanned two groups:
    with every key in group 1 (none in the query's group 0) a token lookup missed them all."""
    with running() as (_, client):
        em, tokens = Emitter(), fresh_tokens(1)
        (h,) = hashes(tokens)
        entry = wire_entry(wire_key(h, group=1), size=100, tokens=tokens, offset=0)
        assert post_batches(client, em.batch("store", entries=[entry])).status_code == 200
        results = lookup_tokens(client, tokens)["results"]
        assert [(r["key"]["object_group_id"], len(r["placements"])) for r in results] == [
            (0, 0),
            (1, 1),
        ]


def test_lookup_tokens_form_prefix_summary(client: httpx.Client) -> None:
    """Prefix summary per instance, per tier and per shared pool (one row for the pool)."""
    a, b, c = Emitter(fresh("a")), Emitter(fresh("b")), Emitter(fresh("c"))
    pool = fresh("pool")
    tokens = fresh_tokens(4)
    post_batches(client, a.store_chunks(tokens, n_chunks=3))
    post_batches(client, a.store_chunks(tokens, n_chunks=1, tier="l2", backend="fs"))
    post_batches(client, b.store_chunks(tokens, n_chunks=4))
    post_batches(client, c.store_chunks(tokens, n_chunks=2, tier="l2", backend=pool, shared=True))
    reply = lookup_tokens(client, [*tokens, 1, 2])  # trailing partial chunk: not a chunk
    assert reply["chunks"] == 4
    assert len(reply["results"]) == 4
    assert holders(reply) == {
        (b.instance_id, "l1", "dram", False): 4,
        (a.instance_id, "l1", "dram", False): 3,
        (None, "l2", pool, True): 2,
        (a.instance_id, "l2", "fs", False): 1,
    }
    assert [p["chunks"] for p in reply["prefix"]] == [4, 3, 2, 1]  # longest first
    # a prefix stops at the first missing chunk: drop chunk 0 from b
    post_batches(client, b.batch("delete", entries=[wire_entry(wire_key(hashes(tokens)[0]))]))
    assert (b.instance_id, "l1", "dram", False) not in holders(lookup_tokens(client, tokens))


def test_lookup_tokens_b64_equals_token_ids(client: httpx.Client) -> None:
    em, tokens = Emitter(), fresh_tokens(2)
    post_batches(client, em.store_chunks(tokens))
    by_list = lookup_tokens(client, tokens)
    r = client.post("/directory/lookup", json={"tokens_b64": b64(tokens), "model_name": "m"})
    assert r.status_code == 200, r.text
    assert r.json() == by_list
    assert holders(by_list) == {(em.instance_id, "l1", "dram", False): 2}


def test_lookup_world_size_expansion(client: httpx.Client) -> None:
    em, tokens = Emitter(), fresh_tokens(3)
    # chunks 0,1 on both ranks, chunk 2 only on rank 0
    post_batches(client, em.store_chunks(tokens, ws=2, n_chunks=2))
    h2 = hashes(tokens)[2]
    post_batches(client, em.batch(entries=[wire_entry(wire_key(h2, ws=2, rank=0))]))
    reply = lookup_tokens(client, tokens, world_size=2)
    assert reply["chunks"] == 3
    ranks = [x["key"]["kv_rank"] for x in reply["results"]]
    assert ranks == [wire_key(h2, ws=2, rank=r)["kv_rank"] for r in (0, 1)] * 3
    assert [len(x["placements"]) for x in reply["results"]] == [1, 1, 1, 1, 1, 0]
    assert holders(reply) == {(em.instance_id, "l1", "dram", False): 2}
    # world size 1 is another key space: nothing
    assert lookup_tokens(client, tokens)["prefix"] == []


def test_lookup_salt_and_group_scoping(client: httpx.Client) -> None:
    em, tokens, salt = Emitter(), fresh_tokens(1), fresh("salt")
    post_batches(client, em.store_chunks(tokens, salt=salt))
    assert lookup_tokens(client, tokens)["prefix"] == []
    assert holders(lookup_tokens(client, tokens, cache_salt=salt)) == {
        (em.instance_id, "l1", "dram", False): 1
    }
    assert lookup_tokens(client, tokens, cache_salt=salt, object_group_id=1)["prefix"] == []


# ---------------------------------------------------------------------------------- blend lookup


def _blend(client: httpx.Client, tokens: list[int], **body: Any) -> httpx.Response:
    return client.post(
        "/directory/blend-lookup", json={"tokens_b64": b64(tokens), "model_name": "m", **body}
    )


def test_blend_lookup_finds_chunk_at_unaligned_offset(client: httpx.Client) -> None:
    em, tokens = Emitter(), fresh_tokens(2)
    post_batches(client, em.store_chunks(tokens, first_offset=40))
    h0, h1 = hashes(tokens)
    # chunk 1 at query position 3, chunk 0 at position 3 + CS + 2
    query = [9, 9, 9, *tokens[CS:], 5, 5, *tokens[:CS], 7]
    r = _blend(client, query)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvatlas-blend"] == "enabled"
    body = r.json()
    assert body["enable_blend_lookup"] is True
    assert body["matches"] == [
        {"chunk_hash": h1.hex(), "old_st": 40 + CS, "cur_st": 3},
        {"chunk_hash": h0.hex(), "old_st": 40, "cur_st": 3 + CS + 2},
    ]
    # token_ids form answers the same
    r2 = client.post("/directory/blend-lookup", json={"token_ids": query, "model_name": "m"})
    assert r2.json()["matches"] == body["matches"]


def test_blend_lookup_namespace_isolation(client: httpx.Client) -> None:
    em, tokens = Emitter(), fresh_tokens(1)
    model, salt = fresh("bm"), fresh("bs")
    post_batches(client, em.store_chunks(tokens, model=model, salt=salt, ws=2))
    query = [1, *tokens, 1]
    hit = {"chunk_hash": hashes(tokens)[0].hex(), "old_st": 0, "cur_st": 1}
    assert _blend(client, query, model_name=model, cache_salt=salt, world_size=2).json()[
        "matches"
    ] == [hit]
    for other in (
        {"model_name": fresh("other"), "cache_salt": salt, "world_size": 2},
        {"model_name": model, "cache_salt": fresh("other"), "world_size": 2},
        {"model_name": model, "cache_salt": "", "world_size": 2},
        {"model_name": model, "cache_salt": salt, "world_size": 1},
    ):
        r = _blend(client, query, **other)
        assert r.status_code == 200, r.text
        assert r.json()["matches"] == [], other


def test_blend_lookup_disabled_says_so() -> None:
    with running(enable_blend_lookup=False) as (_, client):  # LMCache's default; ours is on
        em, tokens = Emitter(), fresh_tokens(1)
        post_batches(client, em.store_chunks(tokens))
        r = _blend(client, [1, *tokens])
        assert r.status_code == 200, r.text
        assert r.json()["matches"] == []
        assert r.json()["enable_blend_lookup"] is False
        assert r.headers["x-kvatlas-blend"] == "disabled"
        assert stats(client)["blend"]["enabled"] is False
        # prefix lookup still works without blend
        assert lookup_tokens(client, tokens)["chunks"] == 1


def test_blend_lookup_empty_query(client: httpx.Client) -> None:
    r = client.post("/directory/blend-lookup", json={"tokens_b64": "", "model_name": "m"})
    assert r.status_code == 200, r.text
    assert r.json()["matches"] == []


# ------------------------------------------------------------------------------- stats and keys


def test_stats_reports_tiers_instances_and_blend(client: httpx.Client) -> None:
    em, tokens = Emitter(), fresh_tokens(2)
    before = stats(client)
    post_batches(client, em.store_chunks(tokens))
    post_batches(client, em.store_chunks(tokens, n_chunks=1, tier="l2", backend="fs"))
    after = stats(client)
    assert after["keys"] == before["keys"] + 2
    assert after["placements"] == before["placements"] + 3
    assert after["bytes_by_tier"]["l1"] == before["bytes_by_tier"].get("l1", 0) + 200
    assert after["bytes_by_tier"]["l2"] == before["bytes_by_tier"].get("l2", 0) + 100
    assert after["l1_placements_by_instance"][em.instance_id] == 2
    assert after["blend"]["enabled"] is True
    assert after["blend"]["contents"] >= before["blend"]["contents"] + 2
    assert after["hash_scheme"] == "blake3"


def _page_all(client: httpx.Client, mode: str, limit: int, **filters: str) -> list[str]:
    seen: list[str] = []
    params: dict[str, Any] = {"limit": limit, **filters}
    for _ in range(1000):
        r = client.get("/directory/keys", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["keys"]) <= limit
        seen += [
            f"{k['key']['chunk_hash_hex']}/{k['key']['model_name']}/{k['key']['kv_rank']}"
            for k in page["keys"]
        ]
        nxt = page["next_cursor"] if mode == "cursor" else page["next_offset"]
        if nxt is None:
            return seen
        params = {"limit": limit, **filters, mode: nxt}
    raise AssertionError("pagination did not end")


def test_keys_listing_pagination_and_filters() -> None:
    with running() as (_, client):
        a, b = Emitter("node-a"), Emitter("node-b")
        ta, tb = fresh_tokens(9), fresh_tokens(8)
        post_batches(client, a.store_chunks(ta))  # 9 l1/dram keys on a
        post_batches(client, a.store_chunks(ta, n_chunks=4, tier="l2", backend="fs"))  # same keys
        post_batches(client, b.store_chunks(tb, ws=2))  # 16 l1/dram keys on b
        post_batches(client, b.store_chunks(tb, n_chunks=3, tier="l2", backend="s3"))  # 3 more
        expected_all = 9 + 16 + 3
        for mode in ("cursor", "offset"):
            for limit in (1, 4, 7, 100):
                keys = _page_all(client, mode, limit)
                assert len(keys) == expected_all, (mode, limit)
                assert len(set(keys)) == expected_all, (mode, limit)
            assert len(_page_all(client, mode, 5, tier="l2")) == 4 + 3
            assert len(_page_all(client, mode, 5, instance_id="node-a")) == 9
            assert len(_page_all(client, mode, 5, instance_id="node-b", tier="l1")) == 16
            assert len(_page_all(client, mode, 2, backend="s3")) == 3
            assert len(_page_all(client, mode, 2, backend="fs", instance_id="node-b")) == 0
        page = client.get("/directory/keys", params={"backend": "s3", "limit": 100}).json()
        for item in page["keys"]:
            assert any(p["backend"] == "s3" for p in item["placements"])
        # offset is the same listing as the cursor walk
        assert _page_all(client, "offset", 3) == _page_all(client, "cursor", 3)


def test_keys_listing_filters_as_lmcache_does() -> None:
    """Measured against LMCache 0.5.6's coordinator: a filtered listing's keys carry only the
    placements the filter admits (a key with an L1 and an L2 copy listed under ``tier=l2``
    carried both), and the filters' defaults sent explicitly — ``tier=all``,
    ``instance_id=``, ``backend=`` — take every key (they were a 422 and an empty page)."""
    with running() as (_, client):
        a, b = Emitter("node-a"), Emitter("node-b")
        tokens = fresh_tokens(3)
        post_batches(client, a.store_chunks(tokens))
        post_batches(client, a.store_chunks(tokens, n_chunks=2, tier="l2", backend="fs"))
        post_batches(client, b.store_chunks(tokens, n_chunks=1))

        def listed(**params: str) -> list[set[tuple[str, str, str]]]:
            r = client.get("/directory/keys", params={"limit": 100, **params})
            assert r.status_code == 200, r.text
            return [
                {(p["instance_id"], p["tier"], p["backend"]) for p in k["placements"]}
                for k in r.json()["keys"]
            ]

        everything = listed()
        assert sorted(map(len, everything)) == [1, 2, 3]
        for defaults in ({"tier": "all"}, {"instance_id": "", "backend": ""}):
            assert listed(**defaults) == everything
        assert listed(tier="l2") == [{("node-a", "l2", "fs")}] * 2
        assert listed(instance_id="node-b") == [{("node-b", "l1", "dram")}]
        assert sorted(map(len, listed(instance_id="node-a"))) == [1, 2, 2]
        assert listed(backend="fs", instance_id="node-b") == []


# ------------------------------------------------------------------------- health and metrics


def test_healthz_reports_scheme(client: httpx.Client) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "healthy"  # LMCache's word
    assert body["hash_scheme"] == "blake3"
    assert body["chunk_size"] == CS
    assert body["enable_blend_lookup"] is True


def test_healthz_reports_other_scheme() -> None:
    with running(hash_scheme="blake3-x1", chunk_size=16) as (_, client):
        body = client.get("/healthz").json()
        assert (body["hash_scheme"], body["chunk_size"]) == ("blake3-x1", 16)
        assert stats(client)["hash_scheme"] == "blake3-x1"


def test_readyz(client: httpx.Client) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json()["ready"] is True


def test_metrics_counters_and_histograms(client: httpx.Client) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    em, tokens = Emitter(), fresh_tokens(1)
    post_batches(client, em.store_chunks(tokens))
    post_batches(client, wire_batch(em.instance_id, em.incarnation, 1))  # duplicate
    name = "kvatlas_event_batches_total"
    assert metric_value(client, name, instance_id=em.instance_id, outcome="applied") == 1
    assert metric_value(client, name, instance_id=em.instance_id, outcome="duplicate") == 1
    n_lookup = metric_value(client, "kvatlas_lookup_seconds_count", form="tokens")
    n_blend = metric_value(client, "kvatlas_blend_lookup_seconds_count")
    lookup_tokens(client, tokens)
    _blend(client, tokens)
    assert metric_value(client, "kvatlas_lookup_seconds_count", form="tokens") == n_lookup + 1
    assert metric_value(client, "kvatlas_blend_lookup_seconds_count") == n_blend + 1
    text = client.get("/metrics").text
    for needle in (
        'kvatlas_lookup_seconds_bucket{form="tokens",le="+Inf"}',
        'kvatlas_blend_lookup_seconds_bucket{le="0.001"}',
        "kvatlas_directory_keys ",
        "kvatlas_event_entries_total",
        "kvatlas_instances_alive",
    ):
        assert needle in text, needle


def test_every_tier_has_a_bytes_series_zero_when_empty(client: httpx.Client) -> None:
    """A tier whose last copy went reads 0, not a series that vanishes (a dashboard would
    show its last value); tiers nothing was ever placed in read 0 too."""
    text = client.get("/metrics").text
    tiers = {
        sample.labels["tier"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvatlas_directory_bytes"
    }
    assert set(tiers) == set(TIERS)
    assert tiers["engine-cpu"] == 0


def test_metrics_gap_counter_per_emitter(client: httpx.Client) -> None:
    inst = fresh("gapm")
    post_batches(client, wire_batch(inst, 1, 1), wire_batch(inst, 1, 4))
    assert metric_value(client, "kvatlas_event_gaps_total", instance_id=inst) == 1


def test_openapi_and_docs(client: httpx.Client) -> None:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    expected = {
        "/events": "post",
        "/directory/lookup": "post",
        "/directory/blend-lookup": "post",
        "/directory/stats": "get",
        "/directory/keys": "get",
        "/instances": "post",
        "/instances/{instance_id}/heartbeat": "put",
        "/instances/{instance_id}": "delete",
        "/healthz": "get",
        "/readyz": "get",
        "/metrics": "get",
    }
    for path, method in expected.items():
        assert method in paths.get(path, {}), path
    assert "get" in paths["/instances"]
    events_body = paths["/events"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/msgpack"} <= set(events_body)
    docs = client.get("/docs")
    assert docs.status_code == 200
    assert "swagger" in docs.text.lower()


@pytest.mark.parametrize(
    "body",
    [
        {"token_ids": ["12", 13, 14, 15], "model_name": "m"},
        {"token_ids": [12.0, 13], "model_name": "m"},
        {"token_ids": [12, 13], "model_name": "m", "world_size": "1"},
        {"keys": [{"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": "256"}]},
    ],
    ids=["string-token", "float-token", "string-world-size", "string-kv-rank"],
)
def test_lookup_takes_numbers_as_numbers_like_the_blend_lookup(
    client: httpx.Client, body: dict[str, object]
) -> None:
    """One rule for both lookups: ``"12"`` is not a token id (the blend lookup always refused
    it; the prefix lookup took it)."""
    r = client.post("/directory/lookup", json=body)
    assert r.status_code == 422, r.text
    if "token_ids" in body:
        assert client.post("/directory/blend-lookup", json=body).status_code == 422
