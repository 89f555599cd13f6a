"""The index's anchor table, kept up to date lazily: writes only note the contents they
made, and the next lookup anchors them (``kernels/anchors.py`` says what an anchor is).

A write pays nothing but the note (a node adds one chunk at a time, where a second compiled
call would cost more than the write); a lookup first anchors what was written since the last
one (≈0.17–0.33 µs a content). The table (content ids, linear probing, load ≤ 3/4: its bytes
count against the index's 128 a chunk) is rebuilt from the live contents whenever the slots
taken since the last rebuild would pass three quarters of it: that grows it with the contents
and sheds the slots of removed ones, at a cost amortized over the inserts. A restore adopts
the anchors its snapshot saved (:class:`AnchorKey`, :meth:`Anchors.adopt`). Everything here
runs under the index lock but :meth:`Anchors.query`, the query's own work.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import blake3
import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.fingerprints import ContentReads
from kvatlas.directory.blend.kernels import RELEASE_WINDOWS, scan, scan_releasing
from kvatlas.directory.blend.kernels.anchors import (
    K,
    adopt_anchors,
    adopt_anchors_releasing,
    anchor_contents,
    anchor_contents_releasing,
    content_anchors,
    content_anchors_releasing,
    offset_bits,
    query_minima,
    query_minima_releasing,
)
from kvatlas.directory.blend.kernels.fingerprints import RELEASE_CONTENTS
from kvatlas.directory.blend.kernels.layout import IDS_CONTENTS, BlendArrays
from kvatlas.directory.blend.op_checks import Tokens

Query = tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64], int]
"""A query's k-gram hashes, the positions of its window minima and how many there are."""

_MIN_SLOTS = 64

SCHEME = "kgram4-keyed-murmur3-spread-leftmost"
"""What an anchor is (``kernels/anchors.py``): another k, hash, spread or tie rule is another
scheme, and a snapshot's anchors under it are recomputed, never read."""


@dataclass(frozen=True, slots=True)
class AnchorKey:
    """What a content's anchor depends on besides its ids: the scheme, the chunk size and
    the hash's secret multipliers (saved in a snapshot beside the ids they key, as the
    fingerprints' base is: docs/security.md)."""

    scheme: str
    chunk_size: int
    keys: tuple[int, ...]

    def usable(self) -> bool:
        """Whether anchors under this key can be computed here: else a snapshot's column
        under it is recomputed, never read."""
        return (
            self.scheme == SCHEME
            and self.chunk_size >= 1
            and len(self.keys) == K
            and all(0 < k < 1 << 32 and k & 1 for k in self.keys)
        )

    def of(self, contents: Sequence[Tokens]) -> npt.NDArray[np.uint64]:
        """The anchors of ``contents`` (as ``FingerprintKey.of`` takes them: stored forms of
        ``chunk_size`` ids each, read by address), each its spread hash << 32 | its offset."""
        return self.of_reads(ContentReads.of(contents))

    def of_reads(self, reads: ContentReads) -> npt.NDArray[np.uint64]:
        """:meth:`of` of contents whose reads were worked out already."""
        n = len(reads.widths)
        out = np.empty(n, np.uint64)
        if n:
            kernel = content_anchors if n < RELEASE_CONTENTS else content_anchors_releasing
            secret = np.array(self.keys, np.uint32)
            kernel(reads.addrs, -1, reads.widths, self.chunk_size, secret, out)
        return out

    def digest(self, pieces: Iterable[bytes]) -> bytes:
        """blake3 of this key and an anchor column (its bytes, as ``pieces``)."""
        h = blake3.blake3(f"{self.scheme}|{self.chunk_size}|{self.keys}|".encode())
        for piece in pieces:
            h.update(piece)
        return h.digest()


class SavedAnchors(NamedTuple):
    """Each add's content anchor under ``key`` (a snapshot's column, checked by its reader):
    ``BlendIndex.build`` adopts them instead of anchoring every content on the first lookup."""

    key: AnchorKey
    values: npt.NDArray[np.uint64]


class Anchors:
    def __init__(self, chunk_size: int, keys: npt.NDArray[np.uint32]) -> None:
        self.chunk_size = chunk_size
        self.bits = offset_bits(chunk_size)
        self.keys = keys  # the hash's secret (``kernels.anchors.new_keys``), the index's
        self.slots = np.full(_MIN_SLOTS, -1, np.int32)
        self.tags = np.zeros(_MIN_SLOTS, np.uint8)  # beside each slot: its hash's low byte
        self.c_anchor = np.zeros(0, np.uint32)  # by content id
        self._row = np.empty(chunk_size, np.uint32)  # a content's ids, then their k-grams' hashes
        self._hashes = np.empty(chunk_size, np.uint32)
        self._taken = 0  # slots taken since the last rebuild (removed contents' too)
        self._noted: list[npt.NDArray[np.int64]] = []
        self._noted_one: list[int] = []
        self._noted_count = 0
        self._all = False  # every content is to be anchored (after a bulk build)
        self._scratch = threading.local()  # a query's buffers, per thread

    @property
    def key(self) -> AnchorKey:
        return AnchorKey(SCHEME, self.chunk_size, tuple(int(k) for k in self.keys))

    def adopt(self, key: AnchorKey, saved: npt.NDArray[np.uint64], capacity: int) -> None:
        """Contents ``0 .. len(saved)`` anchored as ``saved`` says, under ``key``'s secret
        (a fresh index's bulk build: nothing else is in the table; ``capacity``: the
        contents' arrays' length)."""
        self.keys = np.array(key.keys, np.uint32)
        self.c_anchor = np.zeros(max(capacity, len(saved)), np.uint32)
        self._empty_table(len(saved))
        adopt = adopt_anchors_releasing if len(saved) >= RELEASE_WINDOWS else adopt_anchors
        self._taken = adopt(saved, self.bits, self.c_anchor, self.slots, self.tags)
        self._forget_notes()

    def query(self, q: npt.NDArray[np.uint32]) -> Query:
        """``q``'s k-gram hashes and window minima (no lock: they are the query's own), in
        buffers kept per thread between queries (fresh large arrays cost page faults)."""
        if q.shape[0] >= 1 << 32:
            raise ValueError(f"a query of {q.shape[0]} tokens: at most 2^32 - 1")
        buffers: tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64]] | None
        buffers = getattr(self._scratch, "buffers", None)
        if buffers is None or buffers[0].shape[0] < q.shape[0]:
            buffers = np.empty(q.shape[0], np.uint32), np.empty(q.shape[0], np.int64)
            self._scratch.buffers = buffers
        kgrams, minima = buffers
        find = query_minima_releasing if q.shape[0] >= RELEASE_WINDOWS else query_minima
        return kgrams, minima, find(q, self.chunk_size, self.keys, kgrams, minima)

    def scan(
        self,
        q: npt.NDArray[np.uint32],
        query: Query,
        start: int,
        stop: int,
        stride: int,
        ns: int,
        arrays: tuple[Any, ...],
    ) -> Any:
        """``kernels.scan`` of the windows ``[start, stop)`` (under the index lock, after
        :meth:`sync`)."""
        kernel = scan_releasing if stop - start >= RELEASE_WINDOWS else scan
        kgrams, minima, n_minima = query
        return kernel(
            q, kgrams, minima, n_minima, start, stop, stride, self.chunk_size, self.bits, ns,
            arrays, self.slots, self.tags, self.c_anchor,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes + self.tags.nbytes + self.c_anchor.nbytes)

    def note(self, ids: npt.NDArray[np.int64]) -> None:
        """Contents ``ids`` were made (under new ids or reused ones)."""
        self._noted_count += len(ids)
        if not self._bounded():
            self._noted.append(np.array(ids, np.int64))  # (a copy: not a view of a report)

    def note_one(self, cid: int) -> None:
        self._noted_count += 1
        if not self._bounded():
            self._noted_one.append(cid)

    def _bounded(self) -> bool:
        """Whether the notes are past what the table can take without a rebuild: the next
        sync rebuilds from every live content then, so they are dropped (a coordinator that
        only ingests keeps no list of every content it made)."""
        if self._all or self._past_room():
            self.note_all()
            return True
        return False

    def _past_room(self) -> bool:
        """Whether the noted contents would take the table past 3/4 (then it is rebuilt)."""
        return 4 * (self._taken + self._noted_count) > 3 * self.slots.shape[0]

    def note_all(self) -> None:
        """Every content is to be anchored (a bulk build made them, or too many were noted)."""
        self._all = True
        self._noted.clear()
        self._noted_one.clear()

    def sync(self, arrays: BlendArrays, live: int) -> None:
        """Anchor the contents noted since the last call (``live``: how many are live)."""
        if not self._noted_count and not self._all:
            return
        if self.c_anchor.shape[0] < arrays.content_capacity:  # (grown with the contents)
            grown = np.zeros(arrays.content_capacity, np.uint32)
            grown[: self.c_anchor.shape[0]] = self.c_anchor
            self.c_anchor = grown
        if self._all or self._past_room():
            cids = np.arange(int(arrays.ids[IDS_CONTENTS]), dtype=np.int64)
            self._empty_table(live)
        else:
            cids = np.concatenate([*self._noted, np.array(self._noted_one, np.int64)])
        anchor = anchor_contents_releasing if len(cids) >= RELEASE_WINDOWS else anchor_contents
        self._taken += anchor(
            cids, arrays.c_addr, self.chunk_size, self.keys, self.bits, self.c_anchor,
            self.slots, self.tags, self._row, self._hashes,
        )  # fmt: skip
        self._forget_notes()

    def _empty_table(self, live: int) -> None:
        """An empty table for ``live`` contents (load <= 2/3 after a rebuild, <= 3/4 before
        the next)."""
        size = _MIN_SLOTS
        while 2 * size < 3 * live:
            size *= 2
        self.slots = np.full(size, -1, np.int32)
        self.tags = np.zeros(size, np.uint8)
        self._taken = 0

    def _forget_notes(self) -> None:
        self._noted.clear()
        self._noted_one.clear()
        self._noted_count = 0
        self._all = False
