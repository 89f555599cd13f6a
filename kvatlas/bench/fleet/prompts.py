"""A workload's prompts in the forms the virtual fleet needs, computed once per prompt.

Every stack of a run replays the same requests: their vLLM block hashes (what an engine
computes on admission), their chunk hashes (what the node and the scorer compute) and their
token arrays are the same for each, so they are made once and shared. Keyed by the prompt's
content (a blake3 digest of its token ids), so a cache never serves another prompt's hashes.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np

from kvatlas.engine_sim.block_hash import block_hashes
from kvatlas.keys import KeyScheme

HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: np.ndarray
    """uint32, read-only."""
    packed_block_hashes: bytes
    """vLLM's hashes of its full blocks (unsalted, 32 bytes each), packed: a list of bytes
    objects per prompt would hold the whole trace's hashes at twice the memory."""
    chunk_hashes: tuple[bytes, ...]
    """kvatlas's chain hashes of its full chunks."""

    def block_hashes(self) -> list[bytes]:
        packed = self.packed_block_hashes
        return [packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


class PromptCache:
    """Bounded: past ``max_prompts`` the oldest half is dropped (recomputed if asked again)."""

    def __init__(self, block_size: int, scheme: KeyScheme, max_prompts: int = 20_000) -> None:
        self.block_size = block_size
        self.scheme = scheme
        self.max_prompts = max_prompts
        self._prompts: dict[bytes, Prompt] = {}

    def get(self, prompt: np.ndarray) -> Prompt:
        tokens = np.ascontiguousarray(prompt, dtype=np.uint32)
        if tokens.shape[0] and int(np.asarray(prompt).max()) >= 1 << 32:
            raise ValueError("token ids beyond 32 bits")
        digest = blake3.blake3(tokens.tobytes()).digest()
        found = self._prompts.get(digest)
        if found is not None:
            return found
        tokens.flags.writeable = False
        hashes = block_hashes(tokens.tolist(), self.block_size)
        if any(len(h) != HASH_BYTES for h in hashes):
            raise ValueError("block hashes are not SHA-256 digests")
        made = Prompt(tokens, b"".join(hashes), tuple(self.scheme.chunk_hashes(tokens)))
        if len(self._prompts) >= self.max_prompts:
            for key in list(self._prompts)[: self.max_prompts // 2]:
                del self._prompts[key]
        self._prompts[digest] = made
        return made


_CACHES: dict[tuple[int, int], PromptCache] = {}


def prompt_cache(block_size: int, chunk_size: int) -> PromptCache:
    """The process's cache for these sizes (shared by the stacks of a run)."""
    key = (block_size, chunk_size)
    cache = _CACHES.get(key)
    if cache is None:
        cache = _CACHES[key] = PromptCache(block_size, KeyScheme("blake3", chunk_size))
    return cache
