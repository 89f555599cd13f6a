"""Capture and install: the directory's whole state out (for a snapshot) and back in.

A :class:`Capture` yields every partition exactly as it was when the capture started, however
much the directory changes meanwhile (copy-on-write: a change preserves the capture-start
record of a chunk whose partition is not captured yet). The directory lock is held for one
partition at a time, never for the whole directory, and ingestion goes on in between. One
capture at a time per directory; :meth:`KeyDirectory.install` is refused while one is open.
See docs/directory.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress
from types import TracebackType
from typing import Any

import numpy as np

from kvatlas.directory.blend import BlendIndex
from kvatlas.directory.blend.anchors import AnchorKey
from kvatlas.directory.blend.fingerprints import FingerprintKey
from kvatlas.directory.chunk_counts import PARTS, ChunkCounts, Partition
from kvatlas.directory.chunk_parts import ChunkPart
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.gate import EmitterCursor
from kvatlas.directory.records import (
    CapacityDeclaration,
    Placements,
    Record,
    records_from_columns,
    split_columns,
)
from kvatlas.directory.row_copies import copy_rows
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.tenant_bindings import Bindings
from kvatlas.directory.token_store import StoredTokens
from kvatlas.errors import Conflict
from kvatlas.events.json_codec import split_hashes


@dataclass(frozen=True, slots=True)
class DirectoryState:
    """Everything a snapshot holds besides the chunks (small, copied under the lock)."""

    chunk_size: int
    cursors: dict[str, EmitterCursor]
    capacities: dict[str, CapacityDeclaration]
    fingerprint_key: FingerprintKey | None = None
    """The blend index's at capture start (``None``: blend off): a snapshot saves the
    contents' fingerprints under it."""
    anchor_key: AnchorKey | None = None
    """The same for the contents' anchors."""
    tenants: dict[bytes, Bindings] = field(default_factory=dict)
    """The per-salt bindings of the chunks held under keys of several salts, an entry for
    each such chunk (:mod:`~kvatlas.directory.tenant_bindings`)."""


@dataclass(frozen=True, slots=True)
class CapturedPart:
    """One partition's chunks at capture start, in no particular order, as columns: their
    ``hashes`` and their records split as :func:`~kvatlas.directory.records.split_record`
    splits them (``flagged``: ``2 * shape id + indexed`` of the first key; ``placements``
    that key's; ``rests`` the other keys as flat (shape id, placements) pairs) — no object
    per chunk; and how long the directory lock was held to take them."""

    hashes: list[bytes]
    tokens: Sequence[StoredTokens | None]
    offsets: Sequence[int]
    flagged: Sequence[int]
    placements: Sequence[Placements]
    rests: Sequence[tuple[Any, ...]]
    lock_held_s: float = 0.0

    @classmethod
    def of_records(cls, records: Sequence[tuple[bytes, Record]]) -> CapturedPart:
        """The columns of (chunk hash, record) pairs."""
        tokens, offsets, indexed, sids, pls, rests = split_columns([r for _, r in records])
        flagged = [2 * sid + i for sid, i in zip(sids, indexed, strict=True)]
        return cls([h for h, _ in records], tokens, offsets, flagged, pls, rests)

    def records(self) -> list[tuple[bytes, Record]]:
        """The (chunk hash, record) pairs (built on demand: tests, tools)."""
        flagged = np.asarray(self.flagged, np.int64)
        records = records_from_columns(
            self.tokens,
            self.offsets,
            (flagged >> 1).tolist(),
            self.placements,
            (flagged & 1).astype(bool).tolist(),
            self.rests,
        )
        return list(zip(self.hashes, records, strict=True))

    def without(self, gone: Container[bytes], more: CapturedPart) -> CapturedPart:
        """These chunks but those of ``gone``, then ``more``'s."""
        keep = [h not in gone for h in self.hashes]
        pairs = zip(self._columns(), more._columns(), strict=True)
        hashes, tokens, offsets, flagged, placements, rests = (
            [*compress(mine, keep), *theirs] for mine, theirs in pairs
        )
        return CapturedPart(hashes, tokens, offsets, flagged, placements, rests)

    def _columns(self) -> tuple[Sequence[Any], ...]:
        return (self.hashes, self.tokens, self.offsets, self.flagged, self.placements, self.rests)


class Capture:
    """A copy-on-write capture in progress; use it as a context manager (closing it ends the
    copy-on-write). ``state`` is the small state at capture start; ``shapes`` is the shape
    table every captured record's shape ids index (append-only: safe to read unlocked).

    Created by :meth:`KeyDirectory.capture` while it holds ``lock``; raises
    :class:`~kvatlas.errors.Conflict` if another capture of ``chunks`` is open."""

    def __init__(self, lock: threading.Lock, chunks: ChunkTable, state: DirectoryState) -> None:
        if chunks.journal is not None:
            raise Conflict("a snapshot is already being taken")
        self._journal = chunks.journal = CowJournal()
        self.state = state
        self.shapes: ShapeTable = chunks.shapes
        self._lock = lock
        self._chunks = chunks
        self._open = True
        self._iterated = False

    def parts(self) -> Iterator[CapturedPart]:
        """Every partition, in partition order (once per capture)."""
        if self._iterated or not self._open:
            raise Conflict("a capture's partitions can be taken once, while it is open")
        self._iterated = True
        for part_no in range(PARTS):
            with self._lock:
                if not self._open:
                    raise Conflict("the capture was closed")
                held_from = time.perf_counter()
                build = self._journal.take(part_no, self._chunks.parts[part_no])
                held = time.perf_counter() - held_from
            taken = build()  # the rows' fields, copied without the lock (CowJournal.take)
            with self._lock:
                held_from = time.perf_counter()
                saved = self._journal.finish(part_no)
                held += time.perf_counter() - held_from
            yield replace(at_start(taken, saved), lock_held_s=held)

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                self._chunks.journal = None

    def __enter__(self) -> Capture:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CowJournal:
    """The capture-start records of chunks changed since, for partitions not captured yet
    (``None``: the chunk did not exist)."""

    __slots__ = ("done", "saved")

    def __init__(self) -> None:
        self.done = [False] * PARTS
        self.saved: list[dict[bytes, Record | None]] = [{} for _ in range(PARTS)]

    def save(self, h: bytes, rec: Record | None) -> None:
        p = h[0]
        if not self.done[p]:
            saved = self.saved[p]
            if h not in saved:
                saved[h] = rec

    def take(self, part_no: int, part: ChunkPart) -> Callable[[], CapturedPart]:
        """Start taking partition ``part_no`` (under the lock): its hashes and rows are
        copied, and the function returned copies the rows' fields from the columns (without
        the lock: the rows may change meanwhile, but each change journals the record it
        replaces first, and :meth:`finish` puts those back). Records are immutable: no copy
        of their contents."""
        (raw, rows), cols = part.raw_hashes_and_rows(), part.cols
        objs, offsets = cols.objs, cols.offsets  # (a compaction replaces, never changes them)

        def build() -> CapturedPart:
            hashes = split_hashes(raw)  # (the hashes' bytes made after the lock)
            copied = copy_rows(objs, offsets, rows)
            tokens, flagged, placements, rests = copied.fields()
            return CapturedPart(hashes, tokens, copied.offsets, flagged, placements, rests)

        return build

    def finish(self, part_no: int) -> dict[bytes, Record | None]:
        """The records of partition ``part_no`` journaled since the capture started (under
        the lock); later changes to it are no longer journaled. :func:`at_start` puts them
        back into the columns :meth:`take` built (no lock needed: both are the capture's)."""
        saved, self.saved[part_no] = self.saved[part_no], {}
        self.done[part_no] = True
        return saved


def at_start(taken: CapturedPart, saved: dict[bytes, Record | None]) -> CapturedPart:
    """A partition as it was at capture start: the columns taken, each chunk journaled since
    replaced by its capture-start record (or gone: ``None``, it did not exist)."""
    if not saved:
        return taken
    old = [(h, rec) for h, rec in saved.items() if rec is not None]
    return taken.without(saved, CapturedPart.of_records(old))


@dataclass(frozen=True, slots=True)
class Restored:
    """Directory state rebuilt from a snapshot, for :meth:`KeyDirectory.install`.

    ``parts`` are :data:`~kvatlas.directory.chunk_counts.PARTS` dicts, each chunk in partition
    ``hash[0]``, its records unindexed and their shape ids indexing ``shapes``. ``counts``, if
    given, must equal ``ChunkCounts.scan(parts)`` (a loader that can compute them faster than
    that pass passes them; ``None``: install scans). ``index``, if given, is the blend index of
    every record marked indexed, built on one :meth:`KeyDirectory.new_blend_index` gave (a
    snapshot reader builds it from its columns while the contents are filled; ``None``: the
    rebuild reads the records)."""

    state: DirectoryState
    shapes: ShapeTable
    parts: Sequence[Partition | ChunkPart]
    counts: ChunkCounts | None = None
    index: BlendIndex | None = None

    def counts_or_scan(self) -> ChunkCounts:
        """``counts``, or (none given) one pass over the records."""
        return ChunkCounts.scan(self.parts) if self.counts is None else self.counts
