"""A bounded per-node cache of chunk contents, so that later events (an L2 write on eviction,
a re-store) can still carry token ids and token_offset for the coordinator's index.

A chunk whose tokens fell out is reported without them: the coordinator then cannot index it
until a later stamped store. Those misses are counted (a fleet blend index that is blind to a
node's chunks shows up here first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvatlas.keys import TokenArray


@dataclass(frozen=True, slots=True)
class TokenCacheStats:
    chunks: int
    misses: int


class TokenCache:
    def __init__(self, max_chunks: int = 100_000) -> None:
        self.max_chunks = max_chunks
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[TokenArray, int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def remember(self, chunk_hash: bytes, tokens: TokenArray, token_offset: int) -> None:
        with self._lock:
            self._entries[chunk_hash] = (tokens, token_offset)
            self._entries.move_to_end(chunk_hash)
            while len(self._entries) > self.max_chunks:
                self._entries.popitem(last=False)

    def peek(self, chunk_hash: bytes) -> tuple[TokenArray, int] | None:
        """Like :meth:`lookup`, without counting or refreshing (for resync listings)."""
        with self._lock:
            return self._entries.get(chunk_hash)

    def lookup(self, chunk_hash: bytes) -> tuple[TokenArray, int] | None:
        with self._lock:
            found = self._entries.get(chunk_hash)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(chunk_hash)
            self.hits += 1
            return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> TokenCacheStats:
        with self._lock:
            return TokenCacheStats(len(self._entries), self.misses)
