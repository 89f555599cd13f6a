"""Per-position token values that write a multimodal item's identity into its placeholder span.

Contract (bit-identical to LMCache): ``seed = SHA-256(str(identifier))``; block ``c`` is
``SHA-256(seed || c as u64 big-endian)``, cut into eight big-endian words masked to 31 bits
(values must stay positive when token ids travel as int32). Values differ per position: one
value repeated over a span carries one value's entropy, and a 16-bit variant collides within
a few hundred same-shape images (the birthday bound). See docs/keys.md.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

VALUE_MASK = 0x7FFFFFFF
_VALUES_PER_BLOCK = 8


def _counter_block_words(seed: bytes, first: int, n_blocks: int) -> npt.NDArray[np.uint32]:
    """Stand-in for the numba kernel until its first use: imports it (so ``import kvatlas.keys``
    loads no numba), rebinds this module's name to it and calls it. Later calls go straight to
    the kernel, with no stand-in in between."""
    global _counter_block_words
    from kvatlas.keys._sha256_lanes import counter_block_words

    _counter_block_words = counter_block_words
    return counter_block_words(seed, first, n_blocks)


def identifier_seed(identifier: object) -> bytes:
    """SHA-256 of the identifier's string form (non-strings are stringified, as the contract says)."""
    return hashlib.sha256(str(identifier).encode("utf-8")).digest()


class _ValueCache:
    """LRU of identifier → values, bounded by the total number of cached values.

    Engines resend the same image for many requests (system-prompt images, multi-turn chats);
    recomputing is cheap but not free. Arrays are returned read-only so a caller cannot corrupt
    a cached entry. Longer spans extend the cached prefix (values are prefix stable).
    """

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self._entries: OrderedDict[str, npt.NDArray[np.uint32]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def values(self, identifier: object, length: int) -> npt.NDArray[np.uint32]:
        key = str(identifier)
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                if len(cached) >= length:
                    return cached[:length]
        have = 0 if cached is None else len(cached)
        first_block = have // _VALUES_PER_BLOCK
        n_blocks = -(-length // _VALUES_PER_BLOCK) - first_block
        fresh = _counter_block_words(identifier_seed(key), first_block, n_blocks) & np.uint32(
            VALUE_MASK
        )
        if cached is not None:
            fresh = np.concatenate([cached[: first_block * _VALUES_PER_BLOCK], fresh])
        fresh.setflags(write=False)
        if len(fresh) <= self.max_values:
            self._store(key, fresh)
        return fresh[:length]

    def _store(self, key: str, values: npt.NDArray[np.uint32]) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._entries[key] = values
            self._size += len(values)
            while self._size > self.max_values:
                _, evicted = self._entries.popitem(last=False)
                self._size -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._size = 0


# 4M values = 16 MiB: a few hundred images' worth of spans.
_CACHE = _ValueCache(max_values=4 << 20)


def _as_length(length: object) -> int:
    """Any integer (a numpy or torch one too: engines compute span lengths with them, and
    LMCache takes them), never a bool."""
    if not isinstance(length, (bool, np.bool_)):
        try:
            return operator.index(length)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ValueError(f"length must be an integer, got {length!r:.80}")


def mm_hash_values(identifier: object, length: int) -> npt.NDArray[np.uint32]:
    """The contract's values as a read-only ``uint32`` array (the fast path used internally)."""
    length = _as_length(length)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if length == 0:
        return np.empty(0, dtype=np.uint32)
    return _CACHE.values(identifier, length)


def mm_hash_to_token_values(identifier: object, length: int) -> tuple[int, ...]:
    """``length`` values in ``[0, 2**31)`` derived from ``identifier``, per position.

    ``struct.unpack`` builds the tuple straight from the array's buffer: no intermediate list
    (``tuple(array.tolist())`` allocates every int into a list and then copies it).
    """
    values = mm_hash_values(identifier, length)
    return struct.unpack(f"={len(values)}I", values.data)


def clear_value_cache() -> None:
    """Forget every cached identity's values (tests and benchmarks that measure the cold path)."""
    _CACHE.clear()


def warm_up_mm_values() -> None:
    """Load (or, on a cold numba cache, compile) the values' SHA-256 kernel, leaving the value
    cache as it was: a service that derives keys from multimodal items (a node's engine API)
    calls this before serving, else its first request with an image pays the JIT."""
    _counter_block_words(bytes(32), 0, 1)
