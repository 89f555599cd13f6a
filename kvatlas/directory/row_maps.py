"""The chunk table's hash → row maps, one per partition, without a Python object per chunk
(docs/directory.md, "Records as columns", stage (2); the kernels: ``row_map_kernels.py``).

A chunk's hash is kept once, by value: 32 bytes in the hash column of its row. A partition
maps it to the row by open addressing over positions in its ``order`` (insertion order; a
replaced chunk keeps its position), so it iterates as the ``dict`` it replaced did. Every
write is refused, with nothing changed, unless its hash is an exact 32-byte ``bytes``; a read
of anything else finds nothing (as a ``dict`` of such hashes would). A partition's arrays
are only ever moved whole, by one compiled pass over its ≤ 1/256 of the chunks, when a write
finds no room; the hash column grows in a map of its own (``c_heap.mapped_resized``: no hole
left in the heap by each growth's old copy, as the blend index's arrays grow).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from functools import cache
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.c_heap import mapped_empty, mapped_resized
from kvatlas.directory import row_map_kernels as k
from kvatlas.directory.blend._cpython import BYTES_DATA_OFFSET, BYTES_SIZE_OFFSET
from kvatlas.directory.blend.kernels.objects import object_handles
from kvatlas.errors import InvalidInput
from kvatlas.events.json_codec import split_hashes

BY_FIRST_BYTE: Final = np.empty(0, np.int64)
"""A batch's partitions given as none: each hash's first byte (the table's partitions)."""
_NO_ROWS: Final = np.empty(0, np.int64)
_NO_SLOTS: Final = np.empty(0, np.int32)
MIN_SLOTS = 16
HASH_BYTES: Final = 32


def bad_hash(h: object) -> InvalidInput:
    """The error of a write whose chunk hash is not an exact 32-byte ``bytes``."""
    if type(h) is bytes:
        return InvalidInput(f"a chunk hash is {HASH_BYTES} bytes, not {len(h)}: {h.hex()[:80]}")
    return InvalidInput(f"a chunk hash is {HASH_BYTES} bytes, not a {type(h).__name__}")


def exact(h: object) -> object:
    """``h`` as an exact ``bytes`` if it is a ``bytes`` subclass (an ``ObjectKey`` accepts
    one), else ``h`` itself: its own bytes (``bytes(h)`` would call a ``__bytes__``)."""
    return bytes(memoryview(h)) if isinstance(h, bytes) and type(h) is not bytes else h


def mix_keys() -> list[int]:
    """The probe's four multipliers, drawn for each set of maps (odd): a node cannot craft
    hashes that share a home without knowing them."""
    keys = np.frombuffer(os.urandom(32), np.uint64) | np.uint64(1)
    out: list[int] = keys.view(np.int64).tolist()
    return out


@cache
def single_entries() -> tuple[Any, Any, Any]:
    """The compiled entry points of ``find_one``, ``add_one``, ``remove_one``."""
    return (
        k.entry_point(k.find_one),
        k.entry_point(k.add_one),
        k.entry_point(k.remove_one),
    )


class RowMaps:
    """The maps of the partitions sharing one set of columns, and the columns' hashes."""

    __slots__ = (
        "add", "counts", "ctx", "ctx_addr", "find", "hashes", "meta", "orders", "short", "slots",
        "take",
    )  # fmt: skip

    def __init__(self) -> None:
        self.ctx = array("q", bytes(8 * k.CONTEXT_WORDS))  # (never resized: a fixed address)
        self.ctx_addr: int = self.ctx.buffer_info()[0]
        self.ctx[k.C_KEYS : k.C_KEYS + 4] = array("q", mix_keys())
        self.ctx[k.C_BYTES_TYPE] = id(bytes)
        self.ctx[k.C_SIZE], self.ctx[k.C_DATA] = BYTES_SIZE_OFFSET, BYTES_DATA_OFFSET
        self.find, self.add, self.take = single_entries()
        self.meta = array("q")  # PART_WORDS per partition
        self.hashes = mapped_empty((0, k.HASH_WORDS), np.uint64)  # a row's hash, as words
        self.slots: list[npt.NDArray[np.int32]] = []
        self.orders: list[npt.NDArray[np.int32]] = []
        # a batch's scratch: per partition its entries (zeros between batches), the short ones
        # (numpy's zeros of a few KB releases the GIL: a short batch must not)
        self.counts = np.zeros(0, np.int64)
        self.short = np.zeros(0, np.int64)

    def _moved(self) -> None:
        ctx = self.ctx
        ctx[k.C_PARTS] = self.meta.buffer_info()[0]
        ctx[k.C_NPARTS] = len(self.meta) // k.PART_WORDS
        ctx[k.C_HASHES] = self.hashes.ctypes.data

    def add_part(self) -> int:
        """A new empty partition's number."""
        p = len(self.orders)
        self.meta.frombytes(bytes(8 * k.PART_WORDS))
        self.slots.append(_NO_SLOTS)  # (relocate sets both)
        self.orders.append(_NO_SLOTS)
        self.counts = np.zeros(p + 1, np.int64)
        self.short = np.zeros(2 * (p + 1), np.int64)
        self._moved()
        self.relocate(p, 0)
        return p

    def ensure_rows(self, rows: int) -> None:
        """Room in the hash column for ``rows`` rows (the rows past the table's are room)."""
        have = len(self.hashes)
        if have < rows:  # (by a quarter at least: a growth past the map's room copies it)
            self.hashes = mapped_resized(self.hashes, max(rows, have + have // 4), 0)
            self.ctx[k.C_HASHES] = self.hashes.ctypes.data

    def live(self, p: int) -> int:
        return self.meta[k.PART_WORDS * p + k.P_LIVE]

    def relocate(self, p: int, extra: int) -> None:
        """Partition ``p`` moved into arrays with room for ``extra`` more chunks: slots a
        power of two at most 2/3 full after it (so growth doubles them, amortized), positions
        for as many chunks as 2/3 of the slots take; one that shrank shrinks."""
        need = self.live(p) + extra
        size = max(MIN_SLOTS, 1 << (3 * need // 2).bit_length())
        order = np.empty(max(need, 2 * size // 3), np.int32)
        slots = np.full(size, k.EMPTY, np.int32)
        k.relocate(self.ctx_addr, p, order, slots)
        self.orders[p], self.slots[p] = order, slots

    def prepare(
        self, hashes: Sequence[object], parts: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], Sequence[object]]:
        """Check a batch of writes (``parts``: the hashes' partitions, or
        :data:`BY_FIRST_BYTE`) and make room for it; returns the hashes' ``id``s and the hashes
        they are of (``bytes`` subclasses copied: keep them for the write). Raises
        :class:`InvalidInput` (nothing changed) at a hash that is not 32 bytes."""
        n = len(self.orders)
        handles = object_handles(hashes)
        found = k.short_parts(self.ctx_addr, handles, parts, self.counts, self.short)
        if found < 0:
            h = hashes[-1 - found]
            if type(h) is bytes and len(h) == HASH_BYTES:  # (a caller's bug: no such partition)
                p = int(parts[-1 - found]) if len(parts) else h[0]
                raise IndexError(f"no partition {p} of {n}")
            if exact(h) is h:
                raise bad_hash(h)
            return self.prepare(list(map(exact, hashes)), parts)
        if found:
            short = self.short
            for p, more in zip(short[:found].tolist(), short[n : n + found].tolist(), strict=True):
                self.relocate(p, more)
        return handles, hashes

    def rows(self, p: int) -> npt.NDArray[np.int32]:
        """Partition ``p``'s rows in order."""
        out = np.empty(self.live(p), np.int32)
        k.part_rows(self.ctx_addr, p, out)
        return out

    def hashes_of(self, rows: npt.NDArray[Any] | Sequence[int]) -> list[bytes]:
        """The hashes at ``rows``, each a new ``bytes``."""
        return split_hashes(self.raw_hashes(rows))

    def raw_hashes(self, rows: npt.NDArray[Any] | Sequence[int]) -> bytes:
        """The hashes at ``rows``, end to end (one copy: ``json_codec.split_hashes`` makes them)."""
        if not len(rows):
            return b""
        return self.hashes[np.asarray(rows, np.intp)].tobytes()

    def rows_of(self, hashes: Sequence[object], parts: npt.NDArray[np.int64]) -> list[int | None]:
        """The row of each of ``hashes`` (``None``: not held, or not 32 bytes)."""
        out = np.empty(len(hashes), np.int64)
        k.rows_of(self.ctx_addr, object_handles(hashes), parts, out, False)
        rows = out.tolist()
        if k.BAD_KEY in rows and any(exact(h) is not h for h in hashes):
            return self.rows_of(list(map(exact, hashes)), parts)
        return [None if r < 0 else r for r in rows]

    def fill(self, hashes: Sequence[bytes], parts: npt.NDArray[np.int64], first: int) -> None:
        """Map each of ``hashes`` to rows ``first`` onwards in its partition (a chunk held:
        its position keeps the new row, as a dict's)."""
        handles, kept = self.prepare(hashes, parts)
        self.ensure_rows(first + len(hashes))
        k.add_rows(self.ctx_addr, handles, parts, _NO_ROWS, first, True)
        del kept

    def fill_words(self, words: npt.NDArray[np.uint64], parts: npt.NDArray[np.int64]) -> None:
        """A restore's maps, its rows ``0..n`` (the first rows of these columns): hash
        ``words[i]`` (``uint64``, four a hash) at row ``i`` of partition ``parts[i]``."""
        counts = np.bincount(parts, minlength=len(self.orders)).tolist()
        for p, more in enumerate(counts):
            if more:
                self.relocate(p, more)
        self.ensure_rows(len(words))
        k.fill_words(self.ctx_addr, np.require(words, np.uint64, ["C", "A"]), parts)

    def add_fresh(
        self,
        hashes: Sequence[bytes],
        parts: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        first: int,
    ) -> bool:
        """Map each of ``hashes`` to its row (``rows``, then ``first`` onwards) if none is
        held; else nothing changes, ``False``. (No numpy reduction or range: on a short batch
        they release the GIL.)"""
        handles, kept = self.prepare(hashes, parts)
        self.ensure_rows(first + len(hashes) - len(rows))
        added = k.add_rows(self.ctx_addr, handles, parts, rows, first, False)
        del kept
        return bool(added >= 0)

    def remove_many(self, hashes: Sequence[object], parts: npt.NDArray[np.int64]) -> list[int]:
        """Take each of ``hashes`` out of its partition; their rows (-1: not held)."""
        out = np.empty(len(hashes), np.int64)
        k.rows_of(self.ctx_addr, object_handles(hashes), parts, out, True)
        rows: list[int] = out.tolist()
        if k.BAD_KEY in rows:  # ``bytes`` subclasses: only they again, as exact copies (the
            # others are out already: a second pass over them would find them absent)
            again = [
                i
                for i, r in enumerate(rows)
                if r == k.BAD_KEY and exact(hashes[i]) is not hashes[i]
            ]
            taken = self.remove_many(
                [exact(hashes[i]) for i in again], parts[again] if len(parts) else parts
            )
            for i, r in zip(again, taken, strict=True):
                rows[i] = r
        return [max(r, -1) for r in rows]


def warm_up_row_maps() -> None:
    """Every kernel above, compiled or loaded (servers do not compile on first use)."""
    maps = RowMaps()
    for _ in range(2):
        maps.add_part()
    h = [bytes([i % 2]) + bytes(30) + bytes([i]) for i in range(20)]
    maps.add_fresh(h[:10], BY_FIRST_BYTE, np.arange(2, dtype=np.int64), 2)
    maps.fill(h[10:], np.full(10, 1, np.int64), 10)
    words = np.frombuffer(b"".join(h[:3]), np.uint64).reshape(3, k.HASH_WORDS)
    for given in (words, words.copy()):  # a snapshot's words: read-only, or sorted (a copy)
        restored = RowMaps()
        restored.add_part()
        restored.fill_words(given, np.zeros(3, np.int64))
    maps.rows_of(h, BY_FIRST_BYTE)
    maps.hashes_of(maps.rows(0))
    maps.remove_many(h[:4], BY_FIRST_BYTE)
    for one in (maps.find, maps.add, maps.take):
        one(maps.ctx_addr, 0, id(h[0]), 0)
