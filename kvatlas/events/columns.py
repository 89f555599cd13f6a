"""A batch's entries as columns: what the directory applies without one object per entry.

``POST /events`` bodies decode straight into these (``decode_json_columns``,
``decode_msgpack_columns``): chunk hashes, the distinct key shapes and a shape index per entry,
sizes and token offsets as integer arrays, and every entry's tokens in one ``uint32`` arena
(start and length per entry; length 0: no tokens, content unknown). Entries of one content
(several ranks of a chunk) may share a start. Columns are built only from validated input, so
they hold exactly what the :class:`~kvatlas.events.CacheEntry` objects of the same batch would
(:meth:`EntryColumns.entries` builds those, for the paths that still want objects).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvatlas.api.events import UNKNOWN_OFFSET, BatchHeader
from kvatlas.events.model import (
    ACCESS,
    DELETE,
    I64_MAX,
    STORE,
    U64_MAX,
    CacheEntry,
    EventBatch,
    batch_from_wire,
)
from kvatlas.keys import MAX_MODEL_NAME_CHARS, ObjectKey, TokenArray
from kvatlas.keys.object_key import ShapeParts

_Shape = TypeVar("_Shape", bound=Hashable)
Int64s = npt.NDArray[np.int64]
_ZERO_HASH = bytes(32)
LISTED_ENTRIES = 16
"""Batches of at most this many entries have their sizes and offsets bounded by the lists'
own minimum (a node's report of a chunk or a few): numpy's costs ≈1.5 µs however short."""
assert np.iinfo(np.int64).max == I64_MAX  # sizes and offsets fit int64 columns exactly


def shape_ok(shape: ShapeParts) -> bool:
    """Whether a key of this shape is valid as the wire gives it (what an :class:`ObjectKey`
    would accept, its model name at most ``MAX_MODEL_NAME_CHARS`` characters)."""
    try:
        ObjectKey(_ZERO_HASH, *shape)
    except (ValueError, TypeError):
        return False
    return shape[2] <= U64_MAX and len(shape[0]) <= MAX_MODEL_NAME_CHARS


def shape_index(parts: list[_Shape]) -> tuple[list[_Shape], npt.NDArray[np.intp]]:
    """The distinct shapes of ``parts`` in order of first use, and each part's index among
    them (one shape, the usual batch: compared with ``list.count``, no lookup each; no
    numpy call that releases the GIL, as ``np.unique`` does)."""
    n = len(parts)
    if not n or parts.count(parts[0]) == n:
        return parts[:1], np.zeros(n, np.intp)
    index = dict.fromkeys(parts)  # the distinct shapes, in order (a batch has few)
    ids = dict(zip(index, range(len(index)), strict=True))
    return list(index), np.fromiter(map(ids.__getitem__, parts), np.intp, n)


@dataclass(frozen=True, slots=True, eq=False)
class EntryColumns:
    """Entry ``j`` is ``chunk_hashes[j]`` with shape ``shapes[shape_of[j]]``, ``size_bytes[j]``,
    ``token_offsets[j]`` and tokens ``tokens[token_starts[j]:+token_lengths[j]]`` (or
    ``token_objects[j]`` when given)."""

    chunk_hashes: list[bytes]
    shapes: list[ShapeParts]
    shape_of: npt.NDArray[np.intp]
    size_bytes: Int64s
    token_offsets: Int64s
    tokens: TokenArray
    token_starts: Int64s
    token_lengths: Int64s
    token_objects: tuple[TokenArray | None, ...] | None = None
    """Built from objects (:meth:`of_entries`): each entry's own array, instead of the arena."""

    def __len__(self) -> int:
        return len(self.chunk_hashes)

    @classmethod
    def of_entries(cls, entries: Sequence[CacheEntry]) -> EntryColumns:
        """The columns of validated entries (the transports that still build objects); their
        token arrays are kept as they are (no copy: a binding shares the caller's array)."""
        keys = [e.key for e in entries]
        parts = [(k.model_name, k.kv_rank, k.object_group_id, k.cache_salt) for k in keys]
        shapes, shape_of = shape_index(parts)
        arrays = tuple(e.token_ids for e in entries)
        return cls(
            [k.chunk_hash for k in keys],
            shapes,
            shape_of,
            np.array([e.size_bytes for e in entries], dtype=np.int64),
            np.array([e.token_offset for e in entries], dtype=np.int64),
            np.empty(0, dtype=np.uint32),
            np.zeros(len(arrays), dtype=np.int64),
            np.array([0 if t is None else len(t) for t in arrays], dtype=np.int64),
            arrays,
        )

    @classmethod
    def checked(
        cls,
        chunk_hashes: list[bytes],
        parts: list[ShapeParts],
        size_bytes: list[int],
        token_offsets: list[int],
        tokens: TokenArray,
        token_starts: Int64s,
        token_lengths: Int64s,
    ) -> EntryColumns | None:
        """Columns of decoded wire entries (hashes already 32 bytes each, tokens parsed), or
        ``None`` when any entry breaks a rule a :class:`CacheEntry` would refuse: the decoder
        then asks the per-entry path which entry and why. Each distinct shape is checked once."""
        shapes, shape_of = shape_index(parts)
        if not all(map(shape_ok, shapes)):
            return None
        try:
            sizes = np.array(size_bytes, dtype=np.int64)
            offsets = np.array(token_offsets, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            return None
        if len(sizes) <= LISTED_ENTRIES:
            least_size, least_offset = min(size_bytes, default=0), min(token_offsets, default=0)
        else:
            least_size, least_offset = int(sizes.min()), int(offsets.min())
        if least_size < 0 or least_offset < UNKNOWN_OFFSET:
            return None  # the upper bounds are int64's (I64_MAX)
        return cls(
            chunk_hashes,
            shapes,
            shape_of,
            sizes,
            offsets,
            tokens,
            token_starts,
            token_lengths,
        )

    @classmethod
    def joined(cls, parts: Sequence[EntryColumns]) -> EntryColumns | None:
        """The entries of ``parts`` end to end, or ``None`` unless they have one list of
        shapes and their tokens in one arena (the batches of one decoded body) or all as
        objects: then nothing is copied but the integer columns."""
        first = parts[0]
        objects = first.token_objects is not None
        if any(
            p.shapes != first.shapes
            or (p.token_objects is not None) != objects
            or (not objects and p.tokens is not first.tokens)
            for p in parts
        ):
            return None

        def cat(column: Callable[[EntryColumns], npt.NDArray[Any]]) -> npt.NDArray[Any]:
            return np.concatenate(list(map(column, parts)))

        return cls(
            list(chain.from_iterable(p.chunk_hashes for p in parts)),
            first.shapes,
            cat(attrgetter("shape_of")),
            cat(attrgetter("size_bytes")),
            cat(attrgetter("token_offsets")),
            first.tokens,
            cat(attrgetter("token_starts")),
            cat(attrgetter("token_lengths")),
            tuple(chain.from_iterable(p.token_objects or () for p in parts)) if objects else None,
        )

    def rows_shared(self) -> bool:
        """Whether two entries with tokens share a row of the arena (one content for several
        ranks). A token-less entry has no row, though its start is the next entry's."""
        if len(self.token_starts) < 2:
            return False
        rows = self.token_starts[self.token_lengths > 0]
        if len(rows) < 2 or bool((rows[1:] > rows[:-1]).all()):
            return False  # rising starts (every decoded body's): no sort needed
        return len(np.unique(rows)) != len(rows)

    def token_arrays(self) -> list[TokenArray | None]:
        """Each entry's tokens as its own read-only array (``None``: no tokens); entries that
        share a start share one array. Copies: a chunk never pins the request's arena."""
        if self.token_objects is not None:
            return list(self.token_objects)
        arena = self.tokens
        starts, lengths = self.token_starts.tolist(), self.token_lengths.tolist()
        out: list[TokenArray | None]
        if not self.rows_shared():  # no content shared: one comprehension
            out = [
                arena[a : a + n].copy() if n else None for a, n in zip(starts, lengths, strict=True)
            ]
        else:
            out = []
            made: dict[tuple[int, int], TokenArray] = {}
            for a, n in zip(starts, lengths, strict=True):
                arr = made.get((a, n)) if n else None
                if n and arr is None:
                    arr = made[(a, n)] = arena[a : a + n].copy()
                out.append(arr)
        for arr in out:
            if arr is not None:
                arr.setflags(write=False)
        return out

    def salts(self) -> set[str]:
        """The cache salts of the entries' keys."""
        used = np.unique(self.shape_of).tolist() if len(self) else []
        return {self.shapes[s][3] for s in used}

    def without_salts(self, salts: frozenset[str]) -> EntryColumns:
        """The entries whose key's cache salt is not in ``salts`` (the same arena of tokens)."""
        gone = [i for i, shape in enumerate(self.shapes) if shape[3] in salts]
        if not gone:
            return self
        keep = ~np.isin(self.shape_of, gone)
        kept = keep.tolist()
        objects = self.token_objects
        return EntryColumns(
            [h for h, k in zip(self.chunk_hashes, kept, strict=True) if k],
            self.shapes,
            self.shape_of[keep],
            self.size_bytes[keep],
            self.token_offsets[keep],
            self.tokens,
            self.token_starts[keep],
            self.token_lengths[keep],
            None if objects is None else tuple(t for t, k in zip(objects, kept, strict=True) if k),
        )

    def entries(self) -> tuple[CacheEntry, ...]:
        """The same entries as objects."""
        shapes = self.shapes
        return tuple(
            CacheEntry(ObjectKey(h, *shapes[s]), size, tokens, offset)
            for h, s, size, offset, tokens in zip(
                self.chunk_hashes,
                self.shape_of.tolist(),
                self.size_bytes.tolist(),
                self.token_offsets.tolist(),
                self.token_arrays(),
                strict=True,
            )
        )


@dataclass(frozen=True, slots=True, eq=False)
class ColumnBatch:
    """One batch: its header (an :class:`EventBatch`, validated like any) and, for a ``store``,
    ``delete`` or ``access`` batch decoded from a wire body, its entries as
    :class:`EntryColumns` (then the header carries no entries). Other batches carry their
    entries in the header (``columns`` None)."""

    header: EventBatch
    columns: EntryColumns | None = None

    @classmethod
    def of(cls, batch: EventBatch) -> ColumnBatch:
        return cls(batch)

    @property
    def n_entries(self) -> int:
        cols = self.columns
        return len(self.header.entries) if cols is None else len(cols)

    def entry_columns(self) -> EntryColumns:
        """The entries as columns (built from the header's if need be)."""
        cols = self.columns
        return EntryColumns.of_entries(self.header.entries) if cols is None else cols

    def batch(self) -> EventBatch:
        """The batch with its entries as objects (the observer, tests)."""
        cols = self.columns
        if cols is None:
            return self.header
        h = self.header
        return EventBatch(
            h.instance_id, h.incarnation, h.seq, h.event_type, h.tier, h.backend, h.shared,
            h.ts, cols.entries(), h.capacity_bytes, h.capacity_revision, h.dropped_events,
            h.prefixes,
        )  # fmt: skip

    def salts(self) -> set[str]:
        cols = self.columns
        if cols is None:
            return {e.key.cache_salt for e in self.header.entries}
        return cols.salts()

    def without_salts(self, salts: frozenset[str]) -> ColumnBatch:
        """The same batch (its header, its seq) without the entries whose key's cache salt is
        in ``salts``; itself when it has none."""
        cols = self.columns
        if cols is not None:
            kept = cols.without_salts(salts)
            return self if kept is cols else ColumnBatch(self.header, kept)
        entries = tuple(e for e in self.header.entries if e.key.cache_salt not in salts)
        if len(entries) == len(self.header.entries):
            return self
        return ColumnBatch(replace(self.header, entries=entries))


def column_batch(wb: BatchHeader, backend: str, cols: EntryColumns) -> ColumnBatch | None:
    """A decoded wire batch with its entries as ``cols``: a ``store``, ``delete`` or
    ``access`` batch keeps them as columns; a ``resync`` batch carries them as objects (its
    header checks their hashes against its prefixes). ``None`` when the header breaks a rule
    (the decoder then asks the per-entry path which and why)."""
    kept = wb.event_type in (STORE, DELETE, ACCESS)
    try:
        header = batch_from_wire(wb, () if kept else cols.entries(), wb.instance_id, backend)
    except ValueError:
        return None
    return ColumnBatch(header, cols if kept else None)
