"""Inventory digests: what a node holds per tier, summarised so that two sides can find where
they differ without listing everything (docs/coordinator.md, "Resync").

A placement ``(key, tier, backend)`` contributes one 64-bit *element*: the first 8 bytes of its
chunk hash (itself a blake3 hash) times an odd multiplier, the first 8 bytes of ``blake3`` of
everything else of the placement (model, rank, group, salt, tier, backend), modulo 2^64. For one
tag the map is a bijection; different tags mix differently (no XOR-linear cancellation). The
directory's ingest path computes them vectorised, once per batch (:func:`xor_elements`); a
blake3 call per placement cost ten times as much. A *bucket* is the XOR of the elements of the
placements whose chunk hash starts with the bucket's *prefix*. The digest of a prefix is the
256 buckets of its children (prefix + one byte): the root digest (prefix ``b""``) has one bucket
per first byte of the chunk hash, the digest of a one-byte prefix one per second byte. XOR makes
upkeep incremental (adding and removing a placement is the same XOR) and order-free.

Node and coordinator both compute elements here, so they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any, Final

import numpy as np
from blake3 import blake3

from kvatlas.keys import ObjectKey

BUCKETS: Final = 256
MAX_PREFIX_BYTES: Final = 2
"""Prefixes are one byte (a root bucket) or two (a bucket of a one-byte prefix's digest)."""
DIGEST_BYTES: Final = BUCKETS * 8
MASK: Final = (1 << 64) - 1
Digest = list[int]  # BUCKETS unsigned 64-bit buckets


def shape_tag(
    model_name: str, kv_rank: int, object_group_id: int, cache_salt: str, tier: str, backend: str
) -> bytes:
    """Everything of a placement besides its chunk hash, as bytes (unambiguous: lengths and
    fixed-width integers, no separators that a name could contain)."""
    parts = [s.encode() for s in (model_name, cache_salt, tier, backend)]
    out = bytearray(kv_rank.to_bytes(8, "little") + object_group_id.to_bytes(8, "little"))
    for p in parts:
        out += len(p).to_bytes(4, "little") + p
    return bytes(out)


def tag_multiplier(tag: bytes) -> int:
    """The odd 64-bit multiplier of a :func:`shape_tag`."""
    return int.from_bytes(blake3(tag).digest(8), "little") | 1


@lru_cache(maxsize=4096)
def _multiplier(
    model_name: str, kv_rank: int, object_group_id: int, cache_salt: str, tier: str, backend: str
) -> int:
    return tag_multiplier(
        shape_tag(model_name, kv_rank, object_group_id, cache_salt, tier, backend)
    )


def element(chunk_hash: bytes, multiplier: int) -> int:
    """The 64-bit element of the placement of ``chunk_hash`` whose tag has ``multiplier``."""
    return (int.from_bytes(chunk_hash[:8], "little") * multiplier) & MASK


def placement_element(key: ObjectKey, tier: str, backend: str) -> int:
    """:func:`element` of ``(key, tier, backend)``."""
    m = _multiplier(key.model_name, key.kv_rank, key.object_group_id, key.cache_salt, tier, backend)
    return element(key.chunk_hash, m)


def xor_elements(
    digest: np.ndarray[Any, Any],
    chunk_hashes: list[bytes],
    multiplier: int,
    buckets_kept: np.ndarray[Any, Any] | None = None,
) -> None:
    """XOR the elements of ``chunk_hashes`` (one tag, ``multiplier``) into ``digest`` (256
    ``uint64``) in one compiled step that holds the GIL — the directory's ingest path calls
    this once per batch instead of computing an element per entry in Python. With
    ``buckets_kept`` (256 flags), only hashes whose bucket is flagged count."""
    raw = np.frombuffer(b"".join(chunk_hashes), dtype=np.uint8)
    kept = _EVERY if buckets_kept is None else buckets_kept.view(np.uint8)
    _xor_into(digest, raw, np.uint64(multiplier), kept)


_EVERY: Final = np.ones(1, np.uint8)


def _xor_into(digest: Any, raw: Any, multiplier: Any, kept: Any) -> None:
    """Stand-in for the compiled step until its first use: imports it (so ``import
    kvatlas.events`` loads no numba: a node or a router may never digest), rebinds this
    module's name to it and calls it."""
    global _xor_into
    from kvatlas.events._digest_kernel import xor_into

    _xor_into = xor_into
    xor_into(digest, raw, multiplier, kept)


def empty_digest() -> Digest:
    return [0] * BUCKETS


def digest_of(prefix: bytes, elements: Iterable[tuple[bytes, int]]) -> Digest:
    """The digest of ``prefix`` from ``(chunk_hash, element)`` pairs (those outside the prefix
    are ignored)."""
    out = empty_digest()
    n = len(prefix)
    for h, e in elements:
        if h[:n] == prefix:
            out[h[n]] ^= e
    return out


def digest_to_hex(digest: Digest) -> str:
    """The wire form: 256 little-endian u64, concatenated, hex (4096 characters)."""
    return b"".join(b.to_bytes(8, "little") for b in digest).hex()


def digest_from_hex(text: str) -> Digest:
    """Inverse of :func:`digest_to_hex`; ``ValueError`` on a wrong length or bad hex."""
    raw = bytes.fromhex(text)
    if len(raw) != DIGEST_BYTES:
        raise ValueError(f"a digest is {DIGEST_BYTES} bytes, got {len(raw)}")
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, DIGEST_BYTES, 8)]


def differing(prefix: bytes, mine: Digest, theirs: Digest) -> list[bytes]:
    """The child prefixes of ``prefix`` whose buckets differ."""
    return [prefix + bytes([b]) for b in range(BUCKETS) if mine[b] != theirs[b]]


def check_prefix(text: str) -> bytes:
    """A wire prefix (hex of one or two bytes) as bytes; ``ValueError`` otherwise."""
    if not isinstance(text, str) or len(text) not in (2, 2 * MAX_PREFIX_BYTES):
        raise ValueError(f"a prefix is the hex of 1 or {MAX_PREFIX_BYTES} bytes, got {text!r:.40}")
    return bytes.fromhex(text)


__all__ = [
    "BUCKETS",
    "DIGEST_BYTES",
    "MAX_PREFIX_BYTES",
    "Digest",
    "check_prefix",
    "differing",
    "digest_from_hex",
    "digest_of",
    "digest_to_hex",
    "element",
    "empty_digest",
    "placement_element",
    "shape_tag",
    "tag_multiplier",
    "xor_elements",
]
