"""The simulated engine names its blocks as vLLM 0.33.0 does (its own functions as the oracle)."""

from __future__ import annotations

import random

import pytest

from kvatlas.engine_sim.block_hash import block_hashes, none_hash
from tests.vllm_support import require_vllm


@pytest.fixture(scope="module")
def vllm_hash() -> tuple[object, object]:
    utils = require_vllm("vllm.v1.core.kv_cache_utils")
    hashing = require_vllm("vllm.utils.hashing")
    utils.init_none_hash(hashing.sha256)  # type: ignore[attr-defined]
    return utils, hashing.sha256  # type: ignore[attr-defined]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_are_vllms(vllm_hash: tuple[object, object], salt: str | None) -> None:
    utils, sha256 = vllm_hash
    rng = random.Random(7)
    tokens = [rng.randrange(128_256) for _ in range(16 * 5 + 7)]  # a partial last block
    ours = block_hashes(tokens, 16, salt)
    assert len(ours) == 5  # only full blocks are hashed
    parent = None
    for i, h in enumerate(ours):
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = utils.hash_block_tokens(sha256, parent, tokens[i * 16 : (i + 1) * 16], extra)  # type: ignore[attr-defined]
        assert h == parent, i
    assert none_hash() == utils.NONE_HASH  # type: ignore[attr-defined]
    # the chain carries position and salt: one token changed changes that block and every later one
    changed = tokens.copy()
    changed[20] += 1
    other = block_hashes(changed, 16, salt)
    assert other[0] == ours[0] and all(a != b for a, b in zip(other[1:], ours[1:], strict=True))
    assert block_hashes(tokens, 16, "other")[0] != block_hashes(tokens, 16, None)[0]


def test_continuing_a_chain_equals_hashing_at_once() -> None:
    tokens = [70_000 + i for i in range(16 * 4)]  # ids beyond 16 bits
    whole = block_hashes(tokens, 16)
    assert block_hashes(tokens, 16, None, start=2, parent=whole[1]) == whole[2:]
