"""Capture and install: the directory's whole state out (for a snapshot) and back in.

A :class:`Capture` yields every partition exactly as it was when the capture started, however
much the directory changes meanwhile (copy-on-write: a change preserves the capture-start
record of a chunk whose partition is not captured yet). The directory lock is held for one
partition at a time, never for the whole directory, and ingestion goes on in between. One
capture at a time per directory; :meth:`KeyDirectory.install` is refused while one is open.
See docs/directory.md.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvatlas.directory.blend import AddColumns
from kvatlas.directory.blend.fingerprints import FingerprintKey, Fingerprints
from kvatlas.directory.chunk_counts import PARTS, ChunkCounts, Partition
from kvatlas.directory.chunk_parts import ChunkPart, copied_records, copy_rows
from kvatlas.directory.chunk_table import ChunkTable
from kvatlas.directory.gate import EmitterCursor
from kvatlas.directory.records import CapacityDeclaration, Record
from kvatlas.directory.shapes import ShapeTable
from kvatlas.errors import Conflict


@dataclass(frozen=True, slots=True)
class DirectoryState:
    """Everything a snapshot holds besides the chunks (small, copied under the lock)."""

    chunk_size: int
    cursors: dict[str, EmitterCursor]
    capacities: dict[str, CapacityDeclaration]
    fingerprint_key: FingerprintKey | None = None
    """The blend index's at capture start (``None``: blend off): a snapshot saves the
    contents' fingerprints under it."""


@dataclass(frozen=True, slots=True)
class CapturedPart:
    """One partition's records at capture start, as (chunk hash, record) pairs in no
    particular order, and how long the directory lock was held to take them."""

    records: list[tuple[bytes, Record]]
    lock_held_s: float


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
            taken = build()  # the records, built without the lock (see CowJournal.take)
            with self._lock:
                held_from = time.perf_counter()
                records = self._journal.finish(part_no, taken)
                held += time.perf_counter() - held_from
            # the records are built for the capture (the table keeps columns): one young
            # collection untracks them (their contents are untracked), so a writer holding
            # a whole directory's adds nothing to full-collection pauses
            gc.collect(0)
            yield CapturedPart(records, held)

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

    def take(self, part_no: int, part: ChunkPart) -> Callable[[], list[tuple[bytes, Record]]]:
        """Start taking partition ``part_no`` (under the lock): its hash → row pairs are
        copied, and the function returned builds their records from the columns (without the
        lock: the rows may change meanwhile, but each change journals the record it replaces
        first, and :meth:`finish` puts those back). Records are immutable: no copy of their
        contents."""
        pairs, cols = list(part.row.items()), part.cols
        objs, offsets = cols.objs, cols.offsets  # (a compaction replaces, never changes them)

        def build() -> list[tuple[bytes, Record]]:
            hashes = [h for h, _ in pairs]
            rows = [r for _, r in pairs]
            return list(zip(hashes, copied_records(copy_rows(objs, offsets, rows)), strict=True))

        return build

    def finish(self, part_no: int, rows: list[tuple[bytes, Record]]) -> list[tuple[bytes, Record]]:
        """Partition ``part_no`` as it was at capture start, from the records :meth:`take`
        built and the records journaled since the capture started (under the lock); later
        changes to it are no longer journaled."""
        saved, self.saved[part_no] = self.saved[part_no], {}
        self.done[part_no] = True
        if not saved:
            return rows
        out = []
        for h, rec in rows:
            if h in saved:
                old = saved[h]
                if old is not None:
                    out.append((h, old))
            else:
                out.append((h, rec))
        held = {h for h, _ in rows}
        out += [(h, old) for h, old in saved.items() if old is not None and h not in held]
        return out


@dataclass(frozen=True, slots=True)
class Restored:
    """Directory state rebuilt from a snapshot, for :meth:`KeyDirectory.install`.

    ``parts`` are :data:`~kvatlas.directory.chunk_counts.PARTS` dicts, each chunk in partition
    ``hash[0]``, its records unindexed and their shape ids indexing ``shapes``. ``counts``, if
    given, must equal ``ChunkCounts.scan(parts)`` (a loader that can compute them faster than
    that pass passes them; ``None``: install scans). ``adds``, if given, are the blend-index adds
    of every record marked indexed, vouched for (``AddColumns.vouched``: a snapshot reader
    builds them from its columns; ``None``: the rebuild reads the records). ``fingerprints``:
    theirs, one per add, from the snapshot (checked by the reader; the index takes them only
    under its own function and bits, ``BlendIndex.build``)."""

    state: DirectoryState
    shapes: ShapeTable
    parts: Sequence[Partition | ChunkPart]
    counts: ChunkCounts | None = None
    adds: AddColumns | None = None
    fingerprints: Fingerprints | None = None

    def counts_or_scan(self) -> ChunkCounts:
        """``counts``, or (none given) one pass over the records."""
        return ChunkCounts.scan(self.parts) if self.counts is None else self.counts
