"""vLLM's prefix-cache block hashes (its default ``sha256`` algorithm), so a simulated engine
names its blocks exactly as a vLLM engine does for the same tokens.

A block's hash covers its parent's hash, its own token ids and its extra keys, so equal hashes
mean equal prefixes, never equal blocks at different positions. Only full blocks are hashed.
The chain starts from vLLM's ``NONE_HASH``: the SHA-256 of the pickled seed ``vllm-none-hash``
(its fixed seed for cryptographic algorithms when ``PYTHONHASHSEED`` is unset); the hashed value
is the pickled tuple ``(parent, tokens, extra_keys)``, as vLLM's ``hash_block_tokens`` builds it.
``tests/engine_sim/test_block_hash.py`` checks both against vLLM 0.33.0's own functions.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any, Final

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"


def sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent of every first block (``PYTHONHASHSEED`` overrides the seed, as in vLLM)."""
    return sha256_pickle(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def hash_block(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None
               ) -> bytes:  # fmt: skip
    return sha256_pickle((parent or none_hash(), tuple(tokens), extra_keys))


def salt_keys(cache_salt: str | None) -> tuple[Any, ...] | None:
    """The extra keys of a request's first block: ``("cache_salt", salt)`` when salted (vLLM
    salts only the first block; the chain carries it on)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None,
                 start: int = 0, parent: bytes | None = None) -> list[bytes]:  # fmt: skip
    """The hashes of the full blocks of ``tokens`` from block ``start`` on (``parent``: the hash
    of block ``start - 1``)."""
    out: list[bytes] = []
    root = none_hash()
    for i in range(start, len(tokens) // block_size):
        extra = salt_keys(cache_salt) if i == 0 else None
        parent = hash_block(parent or root, tokens[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
