"""Prefix-chained chunk hashes, scheme ``blake3`` (bit-compatible with LMCache MP servers).

``H_i = BLAKE3(H_{i-1} || tokens_i)`` with tokens packed as big-endian uint32 and
``H_{-1} = NONE_HASH``. Only full chunks are hashed. No process state enters the hash: a hash
that differs between processes silently empties the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from blake3 import blake3

from kvatlas.checks import is_plain_int
from kvatlas.keys.tokens import TokenArray, as_token_array, tokens_be_bytes

DEFAULT_CHUNK_SIZE = 256
NONE_HASH: bytes = blake3(bytes(12)).digest()


def check_chunk_size(chunk_size: int) -> int:
    if not is_plain_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return chunk_size


ChunkSuffix = Callable[[int], bytes]
"""Bytes appended to chunk ``i``'s hash input by a versioned scheme (``blake3-x1`` extra keys)."""


def chain_hashes(
    packed: bytes,
    chunk_size: int,
    prev: bytes,
    first_chunk: int = 0,
    suffix: ChunkSuffix | None = None,
) -> list[bytes]:
    """Hash the full chunks of big-endian ``packed`` tokens, numbered from ``first_chunk``.

    ``packed`` starts at chunk ``first_chunk``; ``prev`` is the hash of the chunk before it.
    """
    step = 4 * chunk_size
    view = memoryview(packed)
    out: list[bytes] = []
    for i, start in enumerate(range(0, len(packed) - step + 1, step), first_chunk):
        data = prev + view[start : start + step]
        if suffix is not None:
            data += suffix(i)
        prev = blake3(data).digest()
        out.append(prev)
    return out


def chunk_hashes(token_ids: Any, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
    """Chain hashes of every full chunk of ``token_ids`` (a trailing partial chunk has none)."""
    check_chunk_size(chunk_size)
    tokens = as_token_array(token_ids)
    usable = len(tokens) - len(tokens) % chunk_size
    return chain_hashes(tokens_be_bytes(tokens[:usable]), chunk_size, NONE_HASH)


def segment_hashes(
    segments: Sequence[Any], chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[list[bytes]]:
    """Hash each caller-given segment as its own chain (no chaining across segments).

    For blend-style stores of independent documents: a document gets the same hashes wherever
    it appears. Multimodal values are position dependent, so the first and later segments of
    one image still differ.
    """
    return [chunk_hashes(segment, chunk_size) for segment in segments]


def _immutable(arr: TokenArray) -> bool:
    """No writable array or buffer behind ``arr`` (the tracker's tokens): safe to keep a view
    instead of copying the whole prompt on every update."""
    base: object = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return base is None or isinstance(base, bytes)


class ChunkHashChain:
    """Incremental per-request hasher: extending a sequence extends, never recomputes, its chain.

    ``update(tokens)`` returns the hashes of all full chunks of ``tokens``. The cached prefix is
    compared (one memcmp) rather than trusted, so a caller that edits earlier tokens gets a
    correct chain recomputed from the first changed chunk. ``suffix`` (a scheme's per-chunk
    extra keys) is fixed for the chain's lifetime: one chain per request.
    """

    def __init__(
        self, chunk_size: int = DEFAULT_CHUNK_SIZE, suffix: ChunkSuffix | None = None
    ) -> None:
        self.chunk_size = check_chunk_size(chunk_size)
        self._suffix = suffix
        self._tokens: TokenArray = np.empty(0, dtype=np.uint32)
        self._hashes: list[bytes] = []
        self.chunks_hashed = 0

    @property
    def hashes(self) -> list[bytes]:
        return list(self._hashes)

    def update(self, token_ids: Any) -> list[bytes]:
        tokens = as_token_array(token_ids)
        c = self.chunk_size
        n_full = len(tokens) // c
        keep = self._reusable_chunks(tokens, n_full)
        del self._hashes[keep:]
        if n_full > keep:
            prev = self._hashes[-1] if keep else NONE_HASH
            packed = tokens_be_bytes(tokens[keep * c : n_full * c])
            new = chain_hashes(packed, c, prev, keep, self._suffix)
            self._hashes.extend(new)
            self.chunks_hashed += len(new)
        kept = tokens[: n_full * c]
        self._tokens = kept if _immutable(kept) else kept.copy()
        return list(self._hashes)

    def _reusable_chunks(self, tokens: TokenArray, n_full: int) -> int:
        cached = min(len(self._hashes), n_full)
        if cached == 0:
            return 0
        span = cached * self.chunk_size
        same = self._tokens[:span] == tokens[:span]
        if bool(same.all()):
            return cached
        return int(np.argmin(same)) // self.chunk_size
