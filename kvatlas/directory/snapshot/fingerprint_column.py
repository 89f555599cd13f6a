"""A snapshot's saved content fingerprints (version 4), checked before a restore takes them.

A restore with blend on takes the saved column instead of reading and hashing every content's
ids again (``BlendIndex.build``). A fingerprint that does not belong to its content could not
cause a wrong match (each candidate's ids are compared first) but would hide the content from
every lookup, so the column is checked before it is taken: a key this build cannot compute
or would never draw (another fingerprint function, invalid bits, a weak base) and the column
is ignored and recomputed; a column whose digest does not match its key and bytes, or whose
sample recomputed from the token section differs, and the file is refused
(:class:`SnapshotError`), as any corrupt one. The digest is not a MAC and the sample is a
sample: this catches a damaged file, not one a writer of the file forged (whoever can write
the snapshot decides the directory it restores anyway). See docs/directory.md, "Snapshots".
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.fingerprints import FingerprintKey, Fingerprints
from kvatlas.directory.snapshot.format import Header, SnapshotError, decode_column

SAMPLE = 64
"""Contents whose fingerprints a restore recomputes to check the column (≈20 µs)."""


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
    if not key.usable():
        return None
    column = decode_column(header, "chunk_fingerprints")
    if len(column) != chunks:
        raise SnapshotError("fingerprint column does not have one fingerprint per chunk")
    if key.digest([header.chunk_fingerprints]) != header.fingerprint_digest:
        raise SnapshotError("corrupt fingerprint column (its digest does not match)")
    return key, column


def check_sample(fingerprints: Fingerprints, tokens: Sequence[npt.NDArray[Any]]) -> None:
    """Recompute the fingerprints of a random sample of the adds' contents (``tokens``, read
    in) and raise :class:`SnapshotError` unless each equals the saved one."""
    n = len(tokens)
    if not n:
        return
    rng = np.random.default_rng(secrets.randbits(64))  # not predictable from the file
    at = rng.choice(n, size=min(n, SAMPLE), replace=False)
    got = fingerprints.key.of([tokens[i] for i in at.tolist()])
    if not np.array_equal(got, fingerprints.values[at]):
        raise SnapshotError("fingerprint column does not match the token section")
