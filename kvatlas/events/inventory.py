"""Inventory digests: what a node holds per tier, summarised so that two sides can find where
they differ without listing everything (docs/coordinator.md, "Resync").

A placement ``(key, tier, backend)`` contributes one 64-bit *element*, the first 8 bytes of
``blake3(chunk_hash | shape and place tag)``; a *bucket* is the XOR of the elements of the
placements whose chunk hash starts with the bucket's *prefix*. The digest of a prefix is the
256 buckets of its children (prefix + one byte): the root digest (prefix ``b""``) has one bucket
per first byte of the chunk hash, the digest of a one-byte prefix one per second byte. XOR makes
upkeep incremental (adding and removing a placement is the same XOR) and order-free.

Node and coordinator both compute elements here, so they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from blake3 import blake3

from kvatlas.keys import ObjectKey

BUCKETS: Final = 256
MAX_PREFIX_BYTES: Final = 2
"""Prefixes are one byte (a root bucket) or two (a bucket of a one-byte prefix's digest)."""
DIGEST_BYTES: Final = BUCKETS * 8
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


def element(chunk_hash: bytes, tag: bytes) -> int:
    """The 64-bit element of the placement ``chunk_hash`` + :func:`shape_tag`."""
    return int.from_bytes(blake3(chunk_hash + tag).digest(8), "little")


def placement_element(key: ObjectKey, tier: str, backend: str) -> int:
    """:func:`element` of ``(key, tier, backend)``."""
    tag = shape_tag(key.model_name, key.kv_rank, key.object_group_id, key.cache_salt, tier, backend)
    return element(key.chunk_hash, tag)


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


def covers(prefixes: Iterable[bytes], chunk_hash: bytes) -> bool:
    """Whether ``chunk_hash`` starts with one of ``prefixes``."""
    return any(chunk_hash.startswith(p) for p in prefixes)


__all__ = [
    "BUCKETS",
    "DIGEST_BYTES",
    "MAX_PREFIX_BYTES",
    "Digest",
    "check_prefix",
    "covers",
    "differing",
    "digest_from_hex",
    "digest_of",
    "digest_to_hex",
    "element",
    "empty_digest",
    "placement_element",
    "shape_tag",
]
