"""Key schemes: which hash function a fleet keys its chunks with, and a refusal to mix them.

A node and a coordinator that disagree on scheme or chunk size compute different keys for the
same tokens: every lookup misses and nobody notices. Components compare ``KeyScheme.describe()``
and refuse to start on a mismatch (:class:`KeySchemeMismatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvatlas.errors import Conflict
from kvatlas.keys.chunk_hash import DEFAULT_CHUNK_SIZE, ChunkHashChain, check_chunk_size
from kvatlas.keys.extra_keys import MMItem, RequestKeys, x1_chunk_suffix_fn

SCHEME_BLAKE3 = "blake3"
SCHEME_BLAKE3_X1 = "blake3-x1"
SCHEMES = (SCHEME_BLAKE3, SCHEME_BLAKE3_X1)


class KeySchemeMismatch(Conflict):
    """Two components would compute different keys for the same tokens (a ``Conflict``, so
    still a ``RuntimeError``)."""


@dataclass(frozen=True, slots=True)
class KeyScheme:
    name: str = SCHEME_BLAKE3
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise ValueError(f"unknown key scheme {self.name!r}; known: {', '.join(SCHEMES)}")
        check_chunk_size(self.chunk_size)

    @property
    def carries_extra_keys(self) -> bool:
        return self.name == SCHEME_BLAKE3_X1

    def describe(self) -> dict[str, Any]:
        """What ``/healthz`` and stats report, and what peers compare."""
        return {"hash_scheme": self.name, "chunk_size": self.chunk_size}

    def check_compatible(self, name: str, chunk_size: int) -> None:
        if (name, chunk_size) != (self.name, self.chunk_size):
            raise KeySchemeMismatch(
                f"key scheme mismatch: this side uses {self.name}/{self.chunk_size}, "
                f"the peer uses {name}/{chunk_size}; keys would never match"
            )

    def new_chain(
        self, items: Sequence[MMItem] = (), request_keys: RequestKeys | None = None
    ) -> ChunkHashChain:
        """An incremental per-request chain under this scheme."""
        if not self.carries_extra_keys:
            if request_keys:
                raise ValueError(
                    f"scheme {self.name} cannot carry request-level keys; use {SCHEME_BLAKE3_X1}"
                )
            return ChunkHashChain(self.chunk_size)
        suffix = x1_chunk_suffix_fn(self.chunk_size, items, request_keys)
        return ChunkHashChain(self.chunk_size, suffix)

    def chunk_hashes(
        self,
        token_ids: Any,
        items: Sequence[MMItem] = (),
        request_keys: RequestKeys | None = None,
    ) -> list[bytes]:
        """One-shot hashing (tokens must already carry substituted multimodal values)."""
        return self.new_chain(items, request_keys).update(token_ids)
