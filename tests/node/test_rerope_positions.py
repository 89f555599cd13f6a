"""Where retrieved KV lands: re-RoPE from the fetched chunk's own ``token_offset`` (not the
index's ``old_st``), and trimmed segments (``allow_trim``) at the right request positions.

Checked end to end in an embedded fleet against the toy RoPE model, whose KV has an exact
ground truth at every position (``docs/node.md``, "Safety beyond the hash")."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from kvatlas.keys import segment_hashes
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.embedded import EmbeddedFleet
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.toy_model import ToyRopeModel
from tests.helpers import node_config

C = 16
ATOL = 1e-4


config = partial(node_config, l1_bytes=1 << 22, coordinator_blend_timeout=1.0)


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 500, n).astype(np.uint32)


def store_segment_chunk(
    node: CacheNode, model: ToyRopeModel, chunk_tokens: np.ndarray, offset: int
) -> bytes:
    """Store one chunk under its segment hash (``segment_hashes``: the same hash wherever the
    document appears) with KV computed at ``offset``, as a blend-style data plane would."""
    (chunk_hash,) = segment_hashes([chunk_tokens], C)[0]
    frozen = chunk_tokens.copy()
    frozen.flags.writeable = False
    chunk = StoredChunk(node.key(chunk_hash, ""), model.kv_chunk(frozen, offset), frozen, offset)
    node._put_l1(chunk)
    return chunk_hash


@pytest.mark.parametrize("last_writer", ["node-0", "node-1"])
def test_one_segment_hash_at_two_offsets_reropes_from_the_served_copy(
    tmp_path: Path, last_writer: str
) -> None:
    """node-0 holds hash H computed at 0, node-1 the same H computed at 3C; the fleet index
    keeps one offset for H (the last writer's). node-2 is served node-0's copy (the first L1
    holder) whatever the index says: its K must be rotated from 0, the copy's own offset."""
    with EmbeddedFleet([config(), config(), config()], l2_root=tmp_path) as fleet:
        n0, n1, n2 = (fleet.nodes[f"node-{i}"] for i in range(3))
        model = ToyRopeModel(n0.layout)
        rng = np.random.default_rng(10)
        doc = tokens(rng, C)
        offsets = {"node-0": 0, "node-1": 3 * C}
        order = ["node-1", "node-0"] if last_writer == "node-0" else ["node-0", "node-1"]
        hashes = set()
        for name in order:
            hashes.add(store_segment_chunk(fleet.nodes[name], model, doc, offsets[name]))
            assert fleet.settle()
        assert len(hashes) == 1
        q = 5
        query = np.concatenate([tokens(rng, q), doc, tokens(rng, 3)])
        tq = n2.tracker(token_ids=query, request_id="rq")
        result = n2.blend_lookup(tq)
        assert result is not None and result.fleet_used
        (seg,) = result.segments
        assert (seg.cur_st, seg.old_st) == (q, offsets[last_writer])
        retrieval = n2.blend_retrieve(tq, result.segments)
        assert not retrieval.misses and retrieval.sources == {"peer_l1": 1}
        ((got_seg, kv),) = retrieval.parts
        assert got_seg == seg
        np.testing.assert_allclose(kv, model.kv_chunk(doc, q), atol=ATOL)

        # Each holder querying itself: its local copy, rotated from its own offset.
        for node in (n0, n1):
            t = node.tracker(token_ids=query, request_id=f"own-{node.instance_id}")
            res = node.blend_lookup(t)
            assert res is not None
            (own,) = res.segments
            assert own.old_st == offsets[node.instance_id]
            r = node.blend_retrieve(t, res.segments)
            assert r.sources == {"local_l1": 1}
            np.testing.assert_allclose(r.parts[0][1], model.kv_chunk(doc, q), atol=ATOL)


@pytest.mark.parametrize("trim", [1, 5, C - 1])
@pytest.mark.parametrize("reader", ["node-0", "node-1"])
def test_trimmed_segments_land_at_their_request_positions(
    tmp_path: Path, trim: int, reader: str
) -> None:
    """A document stored by node-0 at 2C, found at q in a query whose prefix covers its first
    ``trim`` tokens: the first chunk is trimmed, the rest whole; every part equals the toy
    model's KV computed fresh at exactly the request positions it is placed at."""
    cfg = config(allow_trim=True)
    with EmbeddedFleet([cfg, cfg], l2_root=tmp_path) as fleet:
        writer, node = fleet.nodes["node-0"], fleet.nodes[reader]
        model = ToyRopeModel(writer.layout)
        rng = np.random.default_rng(11)
        doc = tokens(rng, 2 * C)
        first = np.concatenate([tokens(rng, 2 * C), doc])
        writer.store(writer.tracker(token_ids=first), model.kv_chunks(first))
        assert fleet.settle()
        q = 7
        query = np.concatenate([tokens(rng, q), doc, tokens(rng, 4)])
        prefix_len = q + trim
        tq = node.tracker(token_ids=query, request_id="rq")
        result = node.blend_lookup(tq, prefix_len=prefix_len)
        assert result is not None
        assert [(s.old_st, s.cur_st, s.length, s.trim) for s in result.segments] == [
            (2 * C, prefix_len, C - trim, trim),
            (3 * C, q + C, C, 0),
        ]
        retrieval = node.blend_retrieve(tq, result.segments)
        assert not retrieval.misses and retrieval.reused_tokens == 2 * C - trim
        covered = []
        for seg, kv in retrieval.parts:
            assert kv.shape[2] == seg.length
            fresh = model.kv_chunk(query[seg.cur_st : seg.end], seg.cur_st)
            np.testing.assert_allclose(kv, fresh, atol=ATOL)
            covered.extend(range(seg.cur_st, seg.end))
        assert covered == list(range(prefix_len, q + 2 * C))


@pytest.mark.parametrize(("trim", "length"), [(5, C), (0, C + 1), (C, 1)])
def test_segment_reaching_past_its_chunk_is_a_miss(tmp_path: Path, trim: int, length: int) -> None:
    """Segments also arrive over the engine API: one whose used part ``[trim, trim + length)``
    does not lie inside the chunk cannot be served at the positions it claims (slicing would
    return fewer tokens than it covers) — a counted miss, never a short part."""
    with EmbeddedFleet([config(allow_trim=True)], l2_root=tmp_path) as fleet:
        node = fleet.nodes["node-0"]
        model = ToyRopeModel(node.layout)
        rng = np.random.default_rng(12)
        doc = tokens(rng, C)
        node.store(node.tracker(token_ids=doc), model.kv_chunks(doc))
        q = 6
        query = np.concatenate([tokens(rng, q), doc, tokens(rng, 2 * C)])
        tq = node.tracker(token_ids=query, request_id="rq")
        result = node.blend_lookup(tq)
        assert result is not None
        (good,) = result.segments
        bad = replace(good, cur_st=q + trim, length=length, trim=trim)
        retrieval = node.blend_retrieve(tq, [bad, good])
        assert retrieval.misses == [bad]
        assert [seg for seg, _ in retrieval.parts] == [good]
        assert retrieval.reused_tokens == C
        assert node.counters["segment_misses"] == 1
