"""Every retrieval, prefix as well as blend, uses a fetched chunk only if it is the requested
key with the request's tokens at that position (issue 16, item 1): a chunk planted in a shared
L2 pool (a real directory every node mounts) under a victim's key is a counted miss, logged at
most once a minute per source. The digest rule itself: ``kvatlas.node.chunk_digest``."""

from __future__ import annotations

import logging
from pathlib import Path

import blake3
import numpy as np
import pytest

from kvatlas.keys import ObjectKey
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.chunk_digest import (
    REJECTED_FOREIGN_KEY,
    REJECTED_NO_TOKENS,
    REJECTED_TOKEN_MISMATCH,
    rejection,
    tokens_digest,
)
from kvatlas.node.l2 import FsL2
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.toy_model import ToyRopeModel
from tests.helpers import node_config

C = 16
CONFIG = node_config(l1_bytes=1 << 22)


def test_tokens_digest_is_blake3_of_little_endian_uint32() -> None:
    tokens = np.array([1, 2, 0xFFFFFFFF], dtype=np.uint32)
    want = blake3.blake3(b"\x01\0\0\0\x02\0\0\0\xff\xff\xff\xff").digest()
    assert tokens_digest(tokens) == want and len(want) == 32
    assert tokens_digest(np.arange(8, dtype=np.uint32)[::2]) == tokens_digest(
        np.array([0, 2, 4, 6], dtype=np.uint32)
    )


def test_rejection_causes() -> None:
    key = ObjectKey(b"\1" * 32, "toy", 1 << 24 | 1 << 8)
    other = ObjectKey(b"\2" * 32, "toy", 1 << 24 | 1 << 8)
    window = np.arange(C, dtype=np.uint32)
    kv = np.zeros(4, np.float32)
    assert rejection(key, StoredChunk(key, kv, window, 0), None, window) is None
    assert rejection(key, StoredChunk(key, kv), tokens_digest(window), window) is None
    assert rejection(other, StoredChunk(key, kv, window, 0), None, window) == REJECTED_FOREIGN_KEY
    assert rejection(key, StoredChunk(key, kv, window + 1, 0), None, window) == (
        REJECTED_TOKEN_MISMATCH
    )
    assert rejection(key, StoredChunk(key, kv, window[:-1], 0), None, window) == (
        REJECTED_TOKEN_MISMATCH
    )
    assert rejection(key, StoredChunk(key, kv), tokens_digest(window + 1), window) == (
        REJECTED_TOKEN_MISMATCH
    )
    assert rejection(key, StoredChunk(key, kv), None, window) == REJECTED_NO_TOKENS
    # the chunk's own tokens take precedence over a digest sent beside it
    assert rejection(key, StoredChunk(key, kv, window + 1, 0), tokens_digest(window), window) == (
        REJECTED_TOKEN_MISMATCH
    )


@pytest.fixture
def pool(tmp_path: Path) -> FsL2:
    return FsL2(tmp_path / "pool", "fs-shared", shared=True)


def test_a_chunk_planted_in_a_shared_pool_is_never_served(
    pool: FsL2, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever can write the pool can put bytes under the victim's keys; the victim's prefix
    retrieval serves the honest leading chunk and stops at the planted ones."""
    victim = CacheNode(CONFIG, instance_id="victim", l2=pool)
    model = ToyRopeModel(CONFIG.layout)
    prompt = np.random.default_rng(0).integers(0, 500, 4 * C).astype(np.uint32)
    tracker = victim.tracker(token_ids=prompt)
    keys = [victim.key(h, "") for h in tracker.chunk_hashes()]
    forged = np.full(CONFIG.layout.shape, 7.0, dtype=np.float32)
    pool.put(StoredChunk(keys[0], model.kv_chunk(prompt[:C], 0), prompt[:C], 0))
    pool.put(StoredChunk(keys[1], forged, prompt[:C], C))  # someone else's tokens
    pool.put(StoredChunk(keys[2], forged))  # no tokens at all
    assert victim.lookup(tracker) == 3 * C  # the pool claims three chunks

    with caplog.at_level(logging.WARNING, logger="kvatlas.node.cache_node"):
        got = victim.retrieve(tracker)
        assert got.hit_tokens == C and got.sources == {"l2": 1}
        np.testing.assert_array_equal(got.kv[0], model.kv_chunk(prompt[:C], 0))
        assert victim.stats().counters[REJECTED_TOKEN_MISMATCH] == 1

        pool.delete(keys[1])
        assert victim.retrieve(tracker).hit_tokens == C  # chunk 1 gone: a plain miss
        pool.put(StoredChunk(keys[1], model.kv_chunk(prompt[C : 2 * C], C), prompt[C : 2 * C], C))
        assert victim.retrieve(tracker).hit_tokens == 2 * C  # stops at the token-less one
        assert victim.stats().counters[REJECTED_NO_TOKENS] == 1
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1  # two refusals from the pool, one warning a minute
    assert "fs-shared" in refusals[0].getMessage()
    victim.close()
