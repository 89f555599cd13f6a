"""The snapshot file format, shared by the writer and the reader.

``MAGIC | u64 header length | msgpack header | token arena``. ``MAGIC`` names the format and
``Header.version`` its revision: a reader refuses any it does not know (:data:`READABLE`).
The header is columnar: string, shape and placement tables, then one column per field of the
chunks, keys and placements, each the raw little-endian bytes of the dtype :data:`COLUMNS`
gives it. The token arena follows: the token ids of every chunk with known content, in the
header's chunk order, little-endian, each chunk in the form the directory stores it
(``chunk_token_widths``, the form codes of ``blend/kernels/planes.py``: 2 for uint16, 4 for
uint32, 16 + h for the planes form with h high bits, its bytes as they are in memory; version
2 has only 2 and 4, version 1 no widths: all 4). Version 4 may add each chunk's content
fingerprint (``chunk_fingerprints``, 0 for a chunk without ``chunk_size`` ids) under the key
``fingerprint_key`` (function, bits, base) with its digest (``blend/fingerprints.py``): a
restore takes it instead of hashing every id again, if the key is its own. Version 5 may add
each chunk's content anchor (``chunk_anchors``: spread hash << 32 | offset) under
``anchor_key`` (scheme, the hash's secret) with its digest (``blend/anchors.py``): a restore
adopts them instead of anchoring every content on its first lookup. Version 6 adds a
trailer of checksums after the token arena (:mod:`~kvatlas.directory.snapshot.integrity`):
one per piece of the arena and one of the prefix, the header and those, so that a file
damaged on disk is refused, never restored as another directory. Version 7 adds the bindings
of the chunks held under keys of several salts, one per salt (``tenant_bindings``,
:mod:`~kvatlas.directory.tenant_bindings`: the records of such chunks carry none). See
docs/directory.md.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from kvatlas.directory.gate import EmitterCursor
from kvatlas.directory.tenant_bindings import Bindings
from kvatlas.directory.token_store import widened
from kvatlas.errors import InvalidInput

MAGIC = b"KVATSNP1"
VERSION = 7
"""What the writer writes. 7: version 6 and the per-salt bindings. 6: version 5 and the
checksums' trailer. 5: version 4 and the
content anchors (when the directory has a blend index). 4: version 3 and the content
fingerprints (the same). 3: tokens in their stored form (``chunk_token_widths``: 2, 4 or
16 + h, the planes form)."""
READABLE = (1, 2, 3, 4, 5, 6, 7)
"""What the reader reads. 1-6: one binding for all the salts of a chunk held under keys of
several (restored without it: nobody can tell whose it was); 5: no checksums (a damaged file may restore another directory); 4:
no anchors (the first lookup anchors every content); 3: no fingerprints either (computed on
restore); 2: tokens as uint16 or uint32 (each chunk's uint32 ids are put in the form they need
on load); 1: every token as uint32 (the same)."""
PREFIX = struct.Struct("<8sQ")  # magic, header length
TIERS = ("l1", "l2", "gpu", "engine-cpu")  # pl_tier codes (append only)
HASH_BYTES = 32  # chunk_hashes: the chunks' hashes, concatenated

COLUMNS: dict[str, str] = {
    # placements, each referenced by index from key_pls
    "pl_instance": "<u4",  # string refs
    "pl_incarnation": "<u8",
    "pl_tier": "u1",  # index into TIERS
    "pl_backend": "<u4",  # string refs
    "pl_size": "<i8",
    "pl_shared": "u1",
    "pl_access": "<f8",
    # chunks, in file order
    "chunk_offsets": "<i8",
    "chunk_token_lens": "<u4",  # 0 = content unknown
    "chunk_key_counts": "<u4",
    "chunk_token_widths": "u1",  # form code: 2, 4 (version >= 2), 16 + h (version >= 3)
    "chunk_fingerprints": "<u8",  # version >= 4, optional: under fingerprint_key
    "chunk_anchors": "<u8",  # version >= 5, optional: under anchor_key
    # keys, chunk-major
    "key_shapes": "<u4",  # shape refs
    "key_pl_counts": "<u4",
    "key_pls": "<u4",  # placement refs, key-major
}


class SnapshotError(InvalidInput):
    """The snapshot file is not a valid kvatlas snapshot (truncated, corrupt, foreign)."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    path: str
    chunks: int
    keys: int
    bytes: int
    seconds: float
    max_pause_s: float  # longest single hold of the directory lock (0 for restore)
    stream_position: str | None
    instances: list[InstanceRow] | None = None
    """The coordinator's instance registry as saved (``None``: a snapshot from before it was
    saved, or saved without one)."""
    sections: Sections | None = None
    """State of layers above the directory saved with it, by name, opaque here (the
    coordinator's cache control: ``kvatlas.coordinator.cache_control.snapshot``)."""


CursorRow = tuple[str, int, int, int, int, tuple[int, int, int] | None]
CapacityRow = tuple[str, int, int, list[tuple[str, str, int]]]
Sections = dict[str, bytes]
"""Named opaque state of the layers above the directory, saved with its snapshot."""


def cursor_row(name: str, c: EmitterCursor) -> CursorRow:
    gap = c.last_gap
    last = None if gap is None else (gap.incarnation, gap.after_seq, gap.seq)
    return (name, c.incarnation, c.last_seq, c.gaps, c.missing_batches, last)


InstanceRow = tuple[str, float, float, bytes]
"""A registered instance: id, registered at, last heard of (both wall clock), and its
registration as the coordinator encoded it (opaque here)."""


TenantRow = tuple[bytes, str, bytes, int]
"""One salt's binding of a chunk held under keys of several salts: chunk hash, salt, the
ids as little-endian uint32, offset."""


def tenant_rows(tenants: dict[bytes, Bindings]) -> list[TenantRow]:
    """The rows of ``tenants`` (:attr:`~kvatlas.directory.capture.DirectoryState.tenants`)."""
    return [
        (h, salt, widened(tokens).astype("<u4").tobytes(), offset)
        for h, bindings in tenants.items()
        for salt, (tokens, offset) in bindings.items()
    ]


Buf = TypeVar("Buf", bytes, memoryview)
"""What a header's columns are: ``bytes`` as the writer builds them, ``memoryview`` as the
reader decodes them (``Header[memoryview]``: msgspec hands each column out as a view of the
bytes read, no copy; ≈60 MB at 10^6 keys, and their page faults)."""


class Header(msgspec.Struct, Generic[Buf], omit_defaults=True):
    """The msgpack header; field order is part of the format. Decoded only as
    ``Header[bytes]`` or ``Header[memoryview]`` (:data:`Buf`)."""

    version: int
    chunk_size: int
    stream_position: str | None
    strings: list[str]
    shapes: list[tuple[int, int, int, int]]  # model string, kv_rank, group id, salt string
    pl_instance: Buf
    pl_incarnation: Buf
    pl_tier: Buf
    pl_backend: Buf
    pl_size: Buf
    pl_shared: Buf
    pl_access: Buf
    chunk_hashes: Buf
    chunk_offsets: Buf
    chunk_token_lens: Buf
    chunk_key_counts: Buf
    key_shapes: Buf
    key_pl_counts: Buf
    key_pls: Buf
    cursors: list[CursorRow]  # instance, incarnation, last seq, gaps, missing, last gap
    capacities: list[CapacityRow]  # instance, incarnation, revision, (tier, backend, bytes)
    arena_tokens: int
    instances: list[InstanceRow] | None = None  # absent in snapshots written before it existed
    chunk_token_widths: bytes = b""  # version >= 2 (empty: every width is 4); form codes
    sections: dict[str, bytes] | None = None  # absent in snapshots written before it existed
    chunk_fingerprints: bytes = b""  # version >= 4 (empty: none saved, computed on restore)
    fingerprint_key: tuple[str, int, int] | None = None  # scheme, bits, base
    fingerprint_digest: bytes = b""  # FingerprintKey.digest of the key and the column
    chunk_anchors: bytes = b""  # version >= 5 (empty: none saved, the first lookup anchors)
    anchor_key: tuple[str, list[int]] | None = None  # scheme, the hash's secret multipliers
    anchor_digest: bytes = b""  # AnchorKey.digest of the key and the column
    checksum_piece: int = 0  # version >= 6: chunks per checksummed piece of the token arena
    tenant_bindings: list[TenantRow] = []  # version >= 7 (empty: no chunk of several salts bound)


@dataclass(frozen=True, slots=True)
class Columns:
    """The chunk and key columns of a header, checked for consistency (``reader._columns``)."""

    offsets: np.ndarray[Any, Any]
    lens: np.ndarray[Any, Any]
    widths: np.ndarray[Any, Any]  # form codes (int64: 2, 4 or 16 + h, the planes form)
    counts: np.ndarray[Any, Any]  # keys per chunk (int64)
    first_key: np.ndarray[Any, Any]  # each chunk's first key (int64)
    key_shapes: np.ndarray[Any, Any]
    key_pl_counts: np.ndarray[Any, Any]
    key_pls: np.ndarray[Any, Any]


def encode_column(name: str, values: Sequence[Any] | np.ndarray[Any, Any]) -> bytes:
    return np.array(values, dtype=COLUMNS[name]).tobytes()


def decode_column(header: Header[Any], name: str) -> np.ndarray[Any, Any]:
    """Column ``name`` of ``header`` as a read-only array (no copy)."""
    dtype = np.dtype(COLUMNS[name])
    raw: bytes | memoryview = getattr(header, name)
    if len(raw) % dtype.itemsize:
        raise SnapshotError(
            f"column {name} has a length that is not a multiple of {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)
