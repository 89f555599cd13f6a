"""Content fingerprints as a column: what a snapshot saves so a restore need not read and hash
every id again (docs/directory.md, "Snapshots").

A fingerprint is a function of a content's ids and of its :class:`FingerprintKey`: the
function's name (``kernels.modhash.SCHEME``), the chunk size, the bits kept and the secret
base. An index takes a column only under its own function, chunk size and bits, and only
while it is fresh, adopting the column's base (``BlendIndex.build``); anything else is
recomputed. The base is never on the wire; it is saved in the snapshot beside the token ids it
keys (a file of mode 0600: docs/security.md). A wrong column cannot cause a wrong match (every
candidate's ids are compared before a match is returned), only a missed one, so the reader
checks a column before it is used (its digest, and a sample recomputed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import blake3
import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.fingerprints import (
    RELEASE_CONTENTS,
    content_fingerprints,
    content_fingerprints_releasing,
)
from kvatlas.directory.blend.kernels.modhash import MERSENNE61, SCHEME
from kvatlas.directory.blend.op_checks import Tokens, token_widths
from kvatlas.directory.blend.op_columns import addresses


class ContentReads(NamedTuple):
    """Where each of some contents' ids lie and their width (``token_widths``: 1, the planes
    form): what the kernels reading contents by address take, worked out once for every
    kernel that reads the same contents (a snapshot's fingerprints and anchors)."""

    addrs: npt.NDArray[np.int64]
    widths: npt.NDArray[np.int64]

    @classmethod
    def of(cls, contents: Sequence[Tokens]) -> ContentReads:
        tokens = list(contents)
        if not tokens:
            return cls(np.empty(0, np.int64), np.empty(0, np.int64))
        widths = token_widths(tokens)
        return cls(addresses(tokens, widths), widths)


@dataclass(frozen=True, slots=True)
class FingerprintKey:
    """What a content's fingerprint depends on besides its ids."""

    scheme: str
    chunk_size: int
    bits: int
    base: int

    def usable(self) -> bool:
        """Whether fingerprints under this key can be computed here (this build's function,
        valid bits and base): else a column under it is recomputed, never read."""
        return (
            self.scheme == SCHEME
            and 1 <= self.bits <= 61
            and 2 <= self.base <= MERSENNE61 - 2  # as the index draws it: 0, 1, -1 are weak
            and self.chunk_size >= 1
        )

    def of(self, contents: Sequence[Tokens]) -> npt.NDArray[np.uint64]:
        """The fingerprints of ``contents``, as the directory stores them (``bytes`` contents,
        or read-only C-contiguous ``uint16``, ``uint32`` or planes-form arrays), of
        ``chunk_size`` ids each, which the caller guarantees: they are read by address."""
        return self.of_reads(ContentReads.of(contents))

    def of_reads(self, reads: ContentReads) -> npt.NDArray[np.uint64]:
        """:meth:`of` of contents whose reads were worked out already."""
        n = len(reads.widths)
        out = np.empty(n, np.uint64)
        if n:
            kernel = (
                content_fingerprints if n < RELEASE_CONTENTS else content_fingerprints_releasing
            )
            mask = (1 << self.bits) - 1
            kernel(reads.addrs, -1, reads.widths, self.chunk_size, self.base, mask, out)
        return out

    def digest(self, pieces: Iterable[bytes]) -> bytes:
        """blake3 of this key and a fingerprint column (its bytes, as ``pieces``): a column
        changed on disk, or paired with another key, does not match."""
        h = blake3.blake3(f"{self.scheme}|{self.chunk_size}|{self.bits}|{self.base}|".encode())
        for piece in pieces:
            h.update(piece)
        return h.digest()


class Fingerprints(NamedTuple):
    """Each add's content fingerprint under ``key`` (``BlendIndex.build`` takes them instead
    of computing them when ``key`` is its own but for the base)."""

    key: FingerprintKey
    values: npt.NDArray[np.uint64]
