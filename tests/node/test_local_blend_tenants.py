"""The node's local blend matcher across tenants: two cache salts holding equal ids under one
chunk hash at two offsets (the second put in L1 as a move, a prefetch or a shared pool hands a
chunk over, carrying its own offset). Each salt's blend lookup on the node returns its own
``old_st`` and the real chunk hash (its retrieval then serves its own copy), and what one salt
stores or drops never changes the other's matches (the local index keeps one occupant, with one
offset, per content and chunk hash: a second salt's claim shares nothing with the first's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvatlas.node.cache_node import CacheNode
from kvatlas.node.embedded import EmbeddedFleet
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.toy_model import ToyRopeModel
from tests.helpers import node_config

C = 16
A_AT, B_AT, Q_AT = 2 * C, 5 * C, 7  # where A and B stored the chunk, where the query has it


@pytest.fixture
def node(tmp_path: Path) -> Iterator[CacheNode]:
    config = node_config(l1_bytes=1 << 22, chunk_size=C)
    with EmbeddedFleet([config], l2_root=tmp_path, fleet_blend=False) as solo:
        yield solo.nodes["node-0"]


def doc_and_query() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 500, 12 * C).astype(np.uint32)
    lead, doc, pad = ids[: 2 * C], ids[2 * C : 3 * C], ids[3 * C :]
    return np.concatenate([lead, doc]), doc, np.concatenate([pad[:Q_AT], doc, pad[Q_AT:]])


def store_as_a(node: CacheNode, model: ToyRopeModel, stored: np.ndarray) -> bytes:
    """Salt ``a`` stores its sequence the engine's way; the doc chunk's hash (at ``A_AT``)."""
    tracker = node.tracker(token_ids=stored, cache_salt="a")
    assert node.store(tracker, model.kv_chunks(stored)) == 3
    return tracker.chunk_hashes()[2]


def put_as_b(node: CacheNode, model: ToyRopeModel, h: bytes, doc: np.ndarray) -> None:
    """Salt ``b`` gets the same ids under the same chunk hash, computed at ``B_AT``."""
    chunk = StoredChunk(node.key(h, "b"), model.kv_chunk(doc, B_AT), doc.copy(), B_AT)
    assert node.writes.put_l1(chunk)


def lookup(node: CacheNode, query: np.ndarray, salt: str, rid: str) -> list[tuple[bytes, int]]:
    tracker = node.tracker(token_ids=query, cache_salt=salt, request_id=rid)
    result = node.blend_lookup(tracker)
    assert result is not None and not result.fleet_used
    assert all(s.cur_st == Q_AT for s in result.segments)
    return [(s.chunk_hash, s.old_st) for s in result.segments]


def retrieve_exact(node: CacheNode, model: ToyRopeModel, query: np.ndarray, salt: str) -> None:
    """The salt's retrieval of its segment serves its own copy, re-RoPE'd exactly."""
    tracker = node.tracker(token_ids=query, cache_salt=salt, request_id=f"r-{salt}")
    result = node.blend_lookup(tracker)
    assert result is not None and len(result.segments) == 1
    got = node.blend_retrieve(tracker, result.segments)
    assert not got.misses and got.sources == {"local_l1": 1}
    ((seg, kv),) = got.parts
    assert seg.cur_st == Q_AT
    fresh = model.kv_chunk(query[Q_AT : Q_AT + C], Q_AT)
    np.testing.assert_allclose(kv, fresh, atol=1e-4)


@pytest.mark.parametrize("a_first", [True, False], ids=["a-first", "b-first"])
def test_each_salt_matches_its_own_offset(node: CacheNode, a_first: bool) -> None:
    model = ToyRopeModel(node.layout)
    stored, doc, query = doc_and_query()
    if a_first:
        h = store_as_a(node, model, stored)
        put_as_b(node, model, h, doc)
    else:
        h = node.tracker(token_ids=stored, cache_salt="a").chunk_hashes()[2]
        put_as_b(node, model, h, doc)
        assert store_as_a(node, model, stored) == h
    assert lookup(node, query, "a", "qa") == [(h, A_AT)]
    assert lookup(node, query, "b", "qb") == [(h, B_AT)]
    assert lookup(node, query, "c", "qc") == []
    retrieve_exact(node, model, query, "a")
    retrieve_exact(node, model, query, "b")


def test_dropping_one_salts_copy_leaves_the_others_match(node: CacheNode) -> None:
    model = ToyRopeModel(node.layout)
    stored, doc, query = doc_and_query()
    h = store_as_a(node, model, stored)
    put_as_b(node, model, h, doc)
    assert node.writes.drop_l1(node.key(h, "b"))
    assert lookup(node, query, "a", "q1") == [(h, A_AT)]
    assert lookup(node, query, "b", "q2") == []
    put_as_b(node, model, h, doc)
    assert node.writes.drop_l1(node.key(h, "a"))
    assert lookup(node, query, "a", "q3") == []
    assert lookup(node, query, "b", "q4") == [(h, B_AT)]
    retrieve_exact(node, model, query, "b")
    store_as_a(node, model, stored)  # back, with B's copy still held
    assert lookup(node, query, "a", "q5") == [(h, A_AT)]
    assert lookup(node, query, "b", "q6") == [(h, B_AT)]
    retrieve_exact(node, model, query, "a")
