"""A snapshot's saved content fingerprints (version 4) and anchors (version 5), checked before
a restore takes them.

A restore with blend on takes the saved columns instead of reading and hashing every content's
ids again (``BlendIndex.build``): the fingerprints while it builds the index, the anchors
instead of the first lookup's anchoring of every content. A fingerprint or anchor that does
not belong to its content could not cause a wrong match (each candidate's ids are compared
first) but would hide the content from every lookup, so each column is checked before it is
taken: a key this build cannot compute or would never draw (another function, invalid bits, a
weak base or secret) and the column is ignored and recomputed; a column whose digest does not
match its key and bytes, or whose sample recomputed from the token section differs, and the
file is refused (:class:`SnapshotError`), as any corrupt one. The digest is not a MAC and the
sample is a sample: this catches a damaged file, not one a writer of the file forged (whoever
can write the snapshot decides the directory it restores anyway). See docs/directory.md,
"Snapshots".
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.anchors import AnchorKey, SavedAnchors
from kvatlas.directory.blend.fingerprints import FingerprintKey, Fingerprints
from kvatlas.directory.snapshot.format import Header, SnapshotError, decode_column

SAMPLE = 64
"""Contents whose fingerprints or anchors a restore recomputes to check a column (≈20 µs)."""


def saved_fingerprints(
    header: Header[memoryview], chunks: int
) -> tuple[FingerprintKey, Any] | None:
    """The header's fingerprint key and column (one ``uint64`` per chunk), checked against
    its digest; ``None`` when none was saved or it is under a key this build cannot compute.
    Raises :class:`SnapshotError` when the column is corrupt."""
    if header.version < 4 or header.fingerprint_key is None:
        return None
    scheme, bits, base = header.fingerprint_key
    key = FingerprintKey(scheme, header.chunk_size, bits, base)
    return _checked(key, header, "chunk_fingerprints", header.fingerprint_digest, chunks)


def saved_anchors(header: Header[memoryview], chunks: int) -> tuple[AnchorKey, Any] | None:
    """The header's anchor key and column (one ``uint64`` per chunk), as
    :func:`saved_fingerprints` takes theirs."""
    if header.version < 5 or header.anchor_key is None:
        return None
    scheme, keys = header.anchor_key
    key = AnchorKey(scheme, header.chunk_size, tuple(keys))
    return _checked(key, header, "chunk_anchors", header.anchor_digest, chunks)


def _checked(
    key: FingerprintKey | AnchorKey,
    header: Header[memoryview],
    name: str,
    digest: bytes,
    chunks: int,
) -> tuple[Any, Any] | None:
    if not key.usable():
        return None
    what = _noun(key)
    column = decode_column(header, name)
    if len(column) != chunks:
        raise SnapshotError(f"{what} column does not have one {what} per chunk")
    if key.digest([getattr(header, name)]) != digest:
        raise SnapshotError(f"corrupt {what} column (its digest does not match)")
    return key, column


def _noun(key: FingerprintKey | AnchorKey) -> str:
    return "fingerprint" if isinstance(key, FingerprintKey) else "anchor"


def check_sample(saved: Fingerprints | SavedAnchors, tokens: Sequence[npt.NDArray[Any]]) -> None:
    """Recompute the fingerprints or anchors of a random sample of the adds' contents
    (``tokens``, read in) and raise :class:`SnapshotError` unless each equals the saved one."""
    n = len(tokens)
    if not n:
        return
    rng = np.random.default_rng(secrets.randbits(64))  # not predictable from the file
    at = rng.choice(n, size=min(n, SAMPLE), replace=False)
    got = saved.key.of([tokens[i] for i in at.tolist()])
    if not np.array_equal(got, saved.values[at]):
        raise SnapshotError(f"{_noun(saved.key)} column does not match the token section")
