"""CacheNode in an embedded fleet: store → events → directory → fleet lookup → peer/L2 fetch →
re-RoPE, checked exactly against a toy RoPE model whose KV has a ground truth at every position."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest

from kvatlas.keys import MMItem
from kvatlas.node.embedded import EmbeddedFleet
from kvatlas.node.segments import FetchCost
from kvatlas.node.toy_model import ToyRopeModel
from tests.helpers import node_config

C = 16


config = partial(node_config, l1_bytes=1 << 22, coordinator_blend_timeout=1.0)


@pytest.fixture
def fleet(tmp_path: Path) -> EmbeddedFleet:
    f = EmbeddedFleet([config(), config()], l2_root=tmp_path)
    yield f  # type: ignore[misc]
    f.close()


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 500, n).astype(np.uint32)


def test_prefix_store_lookup_retrieve_across_nodes(fleet: EmbeddedFleet) -> None:
    a, b = fleet.nodes["node-0"], fleet.nodes["node-1"]
    model = ToyRopeModel(a.layout)
    seq = tokens(np.random.default_rng(0), 4 * C + 5)
    ta = a.tracker(token_ids=seq)
    assert a.store(ta, model.kv_chunks(seq)) == 4
    assert a.lookup(ta) == 4 * C
    fleet.settle()
    tb = b.tracker(token_ids=seq)
    assert b.lookup(tb) == 4 * C  # known to the fleet, held in node-0's L1
    got = b.retrieve(tb)
    assert got.hit_tokens == 4 * C and got.sources == {"peer_l1": 4}
    for i, kv in enumerate(got.kv):
        np.testing.assert_array_equal(kv, model.kv_chunk(seq[i * C : (i + 1) * C], i * C))
    other = b.tracker(token_ids=seq, cache_salt="another-tenant")
    assert b.lookup(other) == 0 and b.retrieve(other).hit_tokens == 0


def test_blend_chunk_found_at_new_offset_and_rerope_exact(fleet: EmbeddedFleet) -> None:
    """Stored by A at position p, found by B at q, fetched from A's L1, re-RoPE'd to q."""
    a, b = fleet.nodes["node-0"], fleet.nodes["node-1"]
    model = ToyRopeModel(a.layout)
    rng = np.random.default_rng(1)
    doc = tokens(rng, 3 * C)
    first = np.concatenate([tokens(rng, 2 * C), doc])  # doc stored at p = 2C (chunk aligned)
    a.store(a.tracker(token_ids=first), model.kv_chunks(first))
    fleet.settle()
    q = 7
    query = np.concatenate([tokens(rng, q), doc, tokens(rng, 9)])
    tb = b.tracker(token_ids=query, request_id="rq")
    result = b.blend_lookup(tb)
    assert result is not None and result.fleet_used
    assert [(s.old_st, s.cur_st) for s in result.segments] == [
        (2 * C, q),
        (3 * C, q + C),
        (4 * C, q + 2 * C),
    ]
    retrieval = b.blend_retrieve(tb, result.segments)
    assert not retrieval.misses and retrieval.sources == {"peer_l1": 3}
    for seg, kv in retrieval.parts:
        window = query[seg.cur_st : seg.cur_st + C]
        fresh = model.kv_chunk(window, seg.cur_st)
        np.testing.assert_allclose(kv, fresh, atol=1e-4)
        stale = model.kv_chunk(window, seg.old_st)  # negative control: without re-RoPE it differs
        assert np.abs(stale - fresh).max() > 1e-2


def test_local_matcher_works_without_a_fleet(tmp_path: Path) -> None:
    with EmbeddedFleet([config()], l2_root=tmp_path, fleet_blend=False) as solo:
        node = solo.nodes["node-0"]
        model = ToyRopeModel(node.layout)
        rng = np.random.default_rng(2)
        doc = tokens(rng, 2 * C)
        node.store(node.tracker(token_ids=doc), model.kv_chunks(doc))
        query = np.concatenate([tokens(rng, 3), doc])
        tq = node.tracker(token_ids=query)
        result = node.blend_lookup(tq)
        assert result is not None and not result.fleet_used
        retrieval = node.blend_retrieve(tq, result.segments)
        assert retrieval.sources == {"local_l1": 2} and retrieval.reused_tokens == 2 * C


def test_l2_serves_after_l1_eviction_and_events_follow(tmp_path: Path) -> None:
    chunk_bytes = config().layout.chunk_bytes
    small = config(l1_bytes=2 * chunk_bytes, l2="fs", l2_write="evict")
    with EmbeddedFleet([small], l2_root=tmp_path) as solo:
        node = solo.nodes["node-0"]
        model = ToyRopeModel(node.layout)
        seq = tokens(np.random.default_rng(3), 5 * C)
        tr = node.tracker(token_ids=seq)
        node.store(tr, model.kv_chunks(seq))
        assert len(node.l1) == 2
        solo.settle()
        stats = solo.directory.stats()
        assert stats.l1_placements_by_instance == {"node-0": 2}
        assert stats.bytes_by_tier["l2"] == 3 * chunk_bytes  # the three evicted chunks
        got = node.retrieve(tr)
        assert got.hit_tokens == 5 * C and got.sources["l2"] == 3
        for i, kv in enumerate(got.kv):
            np.testing.assert_array_equal(kv, model.kv_chunk(seq[i * C : (i + 1) * C], i * C))


def test_peer_gone_during_retrieval_is_a_miss_not_a_failure(fleet: EmbeddedFleet) -> None:
    a, b = fleet.nodes["node-0"], fleet.nodes["node-1"]
    model = ToyRopeModel(a.layout)
    rng = np.random.default_rng(4)
    doc = tokens(rng, 2 * C)
    a.store(a.tracker(token_ids=doc), model.kv_chunks(doc))
    fleet.settle()
    query = np.concatenate([tokens(rng, 5), doc])
    tb = b.tracker(token_ids=query)
    result = b.blend_lookup(tb)
    assert result is not None and len(result.segments) == 2
    del fleet.nodes["node-0"]  # the peer dies between lookup and retrieval
    retrieval = b.blend_retrieve(tb, result.segments)
    assert retrieval.parts == [] and len(retrieval.misses) == 2
    assert b.counters["segment_misses"] == 2
    fleet.nodes["node-0"] = a


def test_token_verification_turns_foreign_content_into_a_miss(fleet: EmbeddedFleet) -> None:
    """A segment whose fetched chunk does not carry the request's tokens is never used."""
    a = fleet.nodes["node-0"]
    model = ToyRopeModel(a.layout)
    rng = np.random.default_rng(5)
    doc = tokens(rng, 2 * C)
    a.store(a.tracker(token_ids=doc), model.kv_chunks(doc))
    query = np.concatenate([tokens(rng, 4), doc])
    tq = a.tracker(token_ids=query)
    result = a.blend_lookup(tq)
    assert result is not None and len(result.segments) == 2
    other = a.tracker(token_ids=np.concatenate([tokens(rng, 4), tokens(rng, 2 * C)]))
    retrieval = a.blend_retrieve(other, result.segments)  # same segments, different tokens
    assert retrieval.parts == [] and len(retrieval.misses) == 2


def test_uncacheable_request_is_never_stored_or_looked_up(fleet: EmbeddedFleet) -> None:
    a = fleet.nodes["node-0"]
    model = ToyRopeModel(a.layout)
    seq = np.full(3 * C, 7, dtype=np.uint32)
    broken = a.tracker(
        token_ids=seq, mm_items=[MMItem.of("img", 2 * C, 5 * C)]
    )  # span past the end
    assert not broken.cacheable
    assert a.store(broken, model.kv_chunks(seq)) == 0
    assert a.lookup(broken) == 0 and a.retrieve(broken).hit_tokens == 0
    result = a.blend_lookup(broken)
    assert result is not None and result.segments == ()
    fleet.settle()
    assert fleet.directory.stats().keys == 0


def test_multimodal_requests_keyed_by_image(fleet: EmbeddedFleet) -> None:
    """Same text, different image: never the other image's KV, on any path."""
    a, b = fleet.nodes["node-0"], fleet.nodes["node-1"]
    model = ToyRopeModel(a.layout)
    seq = np.full(4 * C, 9, dtype=np.uint32)
    cat = a.tracker(token_ids=seq, mm_items=[MMItem.of("cat", C, 2 * C)])
    a.store(cat, model.kv_chunks(cat.get_token_ids()))
    fleet.settle()
    dog = b.tracker(token_ids=seq, mm_items=[MMItem.of("dog", C, 2 * C)])
    assert b.lookup(dog) == C  # only the text chunk before the image is shared
    cat_again = b.tracker(token_ids=seq, mm_items=[MMItem.of("cat", C, 2 * C)])
    assert b.lookup(cat_again) == 4 * C


def test_local_l1_ranks_cheapest_with_many_chunks_held(tmp_path: Path) -> None:
    """With 1,000 chunks held, a chunk in this node's own L1 still ranks as local L1.

    The query's first window is held by node-1 itself (local L1) and its overlapping shifted
    window only by node-0 (a peer L1). Placement-aware overlap resolution must keep the local
    copy: the peer copy costs a transfer."""
    big = config(l1_bytes=1 << 24)
    with EmbeddedFleet([big, big], l2_root=tmp_path) as fleet:
        a, b = fleet.nodes["node-0"], fleet.nodes["node-1"]
        model = ToyRopeModel(b.layout)
        rng = np.random.default_rng(6)
        filler = tokens(rng, 1000 * C)
        zeros = np.zeros(b.layout.shape, dtype=b.layout.numpy_dtype())
        assert b.store(b.tracker(token_ids=filler), [zeros] * 1000) == 1000
        shift = 5
        text = tokens(rng, C + shift)
        mine, theirs = text[:C], text[shift : shift + C]
        b.store(b.tracker(token_ids=mine), model.kv_chunks(mine))
        a.store(a.tracker(token_ids=theirs), model.kv_chunks(theirs))
        fleet.settle()
        query = np.concatenate([tokens(rng, 3), text])
        tq = b.tracker(token_ids=query, request_id="many")
        result = b.blend_lookup(tq)
        assert result is not None and result.fleet_used
        assert [(s.cur_st, s.cost) for s in result.segments] == [(3, FetchCost.LOCAL_L1)]
        retrieval = b.blend_retrieve(tq, result.segments)
        assert retrieval.sources == {"local_l1": 1}
