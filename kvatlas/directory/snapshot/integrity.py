"""A version-6 snapshot's checksums: a trailer after the token arena.

``piece digests | header digest``: a blake3 digest of each piece of the token arena (the
pieces a restore reads, :func:`~kvatlas.directory.snapshot.token_section.piece_bounds`), in
order, then one of the file's prefix, its header and those piece digests. A restore checks
the header's digest before it decodes a column, and each piece's as the piece is read (on
the thread that reads it), so a file damaged on disk — a flipped bit, a block of zeros — is
refused (:class:`SnapshotError`, nothing installed) instead of restoring another directory:
other placements, other hashes, other token ids for a content. A checksum, not a MAC: it
catches damage, not a writer of the file (docs/security.md).
"""

from __future__ import annotations

import io
from typing import Any

import blake3
import numpy as np

from kvatlas.directory.snapshot import token_section
from kvatlas.directory.snapshot.format import SnapshotError
from kvatlas.directory.snapshot.token_section import piece_bounds, piece_digest, read_exactly

DIGEST = 32
"""Bytes of each checksum."""


def trailer_size(chunks: int, piece: int) -> int:
    """Bytes of the trailer of a version-6 snapshot of ``chunks`` chunks, ``piece`` a piece."""
    if piece < 1:
        raise SnapshotError(f"snapshot checksum piece {piece} is not a count of chunks")
    return DIGEST * (-(-chunks // piece) + 1)


class PieceDigests:
    """The writer's side: the token arena's bytes as they are written, digested a piece of
    :attr:`piece` chunks at a time (``sizes``: each partition's chunks' bytes in the arena),
    and the header's bytes."""

    def __init__(self, sizes: list[np.ndarray[Any, Any]], piece: int | None = None) -> None:
        self.piece = piece or token_section.FILL_PIECE  # (read now: tests make it small)
        ends = np.cumsum(np.concatenate([np.zeros(0, np.int64), *sizes]))
        self._bounds = piece_bounds(ends, self.piece)
        self._i = 0  # the piece being digested
        self._pos = 0  # arena bytes seen
        self._hash = blake3.blake3()
        self._header = blake3.blake3()
        self.digests: list[bytes] = []
        self._close()  # (pieces of chunks without content: no bytes)

    def header(self, data: bytes | memoryview) -> None:
        self._header.update(data)

    def arena(self, data: bytes | memoryview) -> None:
        view, at = memoryview(data).cast("B"), 0
        while at < len(view):
            take = min(len(view) - at, self._bounds[self._i + 1] - self._pos)
            if take <= 0:
                raise ValueError("more token arena bytes than its pieces hold")
            self._hash.update(view[at : at + take])
            at += take
            self._pos += take
            self._close()

    def trailer(self) -> bytes:
        """The trailer, once every arena byte was given."""
        if len(self.digests) != len(self._bounds) - 1:
            raise ValueError("fewer token arena bytes than its pieces hold")
        pieces = b"".join(self.digests)
        self._header.update(pieces)
        return pieces + self._header.digest()

    def _close(self) -> None:
        bounds = self._bounds
        while self._i + 1 < len(bounds) and self._pos == bounds[self._i + 1]:
            self.digests.append(self._hash.digest())
            self._hash = blake3.blake3()
            self._i += 1


def checked_trailer(
    f: io.FileIO, size: int, chunks: int, piece: int, prefix: memoryview, header: memoryview
) -> list[bytes]:
    """The piece digests of the version-6 snapshot open as ``f`` (``size`` bytes, ``chunks``
    chunks in pieces of ``piece``), once the digest of its ``prefix``, ``header`` and those
    matches the trailer's."""
    n = trailer_size(chunks, piece)
    if size < n:
        raise SnapshotError("truncated snapshot checksums")
    f.seek(size - n)
    raw = bytes(read_exactly(f, n))
    if len(raw) != n:
        raise SnapshotError("truncated snapshot checksums")
    pieces, want = raw[:-DIGEST], raw[-DIGEST:]
    digest = blake3.blake3(prefix)
    digest.update(header)
    digest.update(pieces)
    if digest.digest() != want:
        raise SnapshotError("snapshot header fails its checksum (the file is damaged)")
    return [pieces[i : i + DIGEST] for i in range(0, len(pieces), DIGEST)]


__all__ = ["DIGEST", "PieceDigests", "checked_trailer", "piece_digest", "trailer_size"]
