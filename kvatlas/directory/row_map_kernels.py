"""Compiled kernels of the chunk table's hash → row maps (``row_maps.py``; docs/directory.md,
"Records as columns", stage (2)).

A partition's map is two ``int32`` arrays: ``order``, the rows of its chunks by position
(insertion order; -1 a removed chunk's hole), and ``slots``, open addressing over the
positions (linear probing, power-of-two size, -1 empty, -2 a tombstone), homed by a keyed
mix of the hash's bytes after the first (the partition). A chunk's hash is not kept in the
map: it is the row's 32 bytes in the table-wide hash column, which every probe compares in
full. Callers keep (live + tombstones) at most 2/3 of the slots and room in ``order``
(:func:`short_parts` says which partitions lack it; ``relocate`` makes it), so a probe always
ends and no kernel allocates.

Every kernel reads the state through one context, an ``int64`` array at a fixed address
(``C_*``): the table of partitions (``P_*``, ``PART_WORDS`` a partition), the hash column,
the mix's keys, and a ``bytes``' layout (its type, length and payload offsets), so that the
single reads and writes are compiled entry points taking integers only (no numba dispatch)
and the batch ones take an object's ``id`` per hash, checked to be an exact 32-byte ``bytes``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import types

from kvatlas.directory.blend.kernels.pointers import helper, i32_ptr, i64_ptr, inline, jit, u64_ptr

C_PARTS, C_NPARTS, C_HASHES, C_KEYS, C_BYTES_TYPE, C_SIZE, C_DATA = 0, 1, 2, 3, 7, 8, 9
"""Context words: the partitions' table (address) and count, the hash column (address), the
mix's four keys, ``id(bytes)``, a ``bytes``' length and payload offsets."""
CONTEXT_WORDS = 10
P_SLOTS, P_MASK, P_ORDER, P_ORDER_CAP, P_USED, P_LIVE, P_TOMBS = 0, 1, 2, 3, 4, 5, 6
"""A partition's words: its slots (address) and their mask, its order (address) and room,
positions used (holes included), chunks held, tombstones."""
PART_WORDS = 8
EMPTY, TOMB = -1, -2
HASH_WORDS = 4
"""A chunk hash is 32 bytes: four ``uint64`` words in the hash column."""
ABSENT, BAD_KEY, NO_ROOM, INSERTED = -1, -2, -3, -4
"""Results of the single entry points besides a row."""

_ENTRY = (types.int64,) * 4


@inline
def _home(c: Any, h: Any) -> Any:
    """The mix of hash words ``h[0..3]`` (``uint64*``) without their first byte."""
    x = (h[0] >> np.uint64(8)) * np.uint64(c[C_KEYS])
    x += h[1] * np.uint64(c[C_KEYS + 1])
    x += h[2] * np.uint64(c[C_KEYS + 2])
    x += h[3] * np.uint64(c[C_KEYS + 3])
    return x ^ (x >> np.uint64(29))


@inline
def _key_words(c: Any, at: Any) -> Any:
    """The payload address of the object ``at`` (an ``id``) if it is an exact 32-byte
    ``bytes``, else 0."""
    if i64_ptr(at + 8)[0] != c[C_BYTES_TYPE] or i64_ptr(at + c[C_SIZE])[0] != 32:  # type: ignore[call-arg]
        return 0
    return at + c[C_DATA]


@inline
def _same(a: Any, b: Any) -> Any:
    return a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3]


@helper
def _slot_of(c: Any, m: Any, h: Any) -> Any:
    """The slot holding the chunk of hash words ``h`` in partition words ``m``, or -1 - the
    slot an insert takes (the first tombstone of the probe, else its empty end)."""
    slots, order = i32_ptr(m[P_SLOTS]), i32_ptr(m[P_ORDER])  # type: ignore[call-arg]
    hashes, mask = c[C_HASHES], m[P_MASK]
    i = np.int64(_home(c, h) & np.uint64(mask))
    free: Any = -1
    while True:
        s = slots[i]
        if s == EMPTY:
            return -1 - (i if free < 0 else free)
        if s == TOMB:
            if free < 0:
                free = i
        elif _same(u64_ptr(hashes + 32 * np.int64(order[s])), h):  # type: ignore[call-arg]
            return i
        i = (i + 1) & mask


@helper
def _take(c: Any, m: Any, slot: Any, h: Any, row: Any) -> None:
    """Put the chunk of hash words ``h`` at ``row`` into free slot ``slot`` (from
    :func:`_slot_of`) and the next position; its hash into the column."""
    slots, order = i32_ptr(m[P_SLOTS]), i32_ptr(m[P_ORDER])  # type: ignore[call-arg]
    if slots[slot] == TOMB:
        m[P_TOMBS] -= 1
    pos = m[P_USED]
    order[pos] = row
    slots[slot] = pos
    m[P_USED] = pos + 1
    m[P_LIVE] += 1
    column = u64_ptr(c[C_HASHES] + 32 * row)  # type: ignore[call-arg]
    for k in range(HASH_WORDS):
        column[k] = h[k]


@helper
def _drop(m: Any, slot: Any) -> Any:
    """Take the chunk at ``slot`` out of partition words ``m``; returns its row."""
    slots, order = i32_ptr(m[P_SLOTS]), i32_ptr(m[P_ORDER])  # type: ignore[call-arg]
    pos = slots[slot]
    row = order[pos]
    order[pos] = EMPTY
    if slots[(slot + 1) & m[P_MASK]] == EMPTY:  # the end of its run: no tombstone needed
        slots[slot] = EMPTY
    else:
        slots[slot] = TOMB
        m[P_TOMBS] += 1
    m[P_LIVE] -= 1
    while m[P_USED] > 0 and order[m[P_USED] - 1] == EMPTY:  # a hole at the end is no position
        m[P_USED] -= 1
    return row


@inline
def _room(m: Any, k: Any) -> Any:
    return (m[P_LIVE] + m[P_TOMBS] + k) * 3 <= (m[P_MASK] + 1) * 2 and (
        m[P_USED] + k <= m[P_ORDER_CAP]
    )


@inline
def _part(c: Any, p: Any) -> Any:
    return i64_ptr(c[C_PARTS] + 8 * PART_WORDS * p)  # type: ignore[call-arg]


@jit
def find_one(ctx: Any, p: Any, at: Any, unused: Any) -> Any:
    """The row of the object ``at`` (an ``id``) in partition ``p``: ``ABSENT``, or
    ``BAD_KEY`` if it is not an exact 32-byte ``bytes``. (Four arguments: one signature for
    every entry point.)"""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    words = _key_words(c, at)
    if words == 0:
        return BAD_KEY
    m = _part(c, p)
    h = u64_ptr(words)  # type: ignore[call-arg]
    s = _slot_of(c, m, h)
    if s < 0:
        return ABSENT
    return np.int64(i32_ptr(m[P_ORDER])[i32_ptr(m[P_SLOTS])[s]])  # type: ignore[call-arg]


@jit
def add_one(ctx: Any, p: Any, at: Any, row: Any) -> Any:
    """Map the object ``at`` to ``row`` in partition ``p`` if absent (``INSERTED``); else its
    row; ``BAD_KEY``; ``NO_ROOM`` (nothing changed: relocate the partition first)."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    words = _key_words(c, at)
    if words == 0:
        return BAD_KEY
    m = _part(c, p)
    h = u64_ptr(words)  # type: ignore[call-arg]
    s = _slot_of(c, m, h)
    if s >= 0:
        return np.int64(i32_ptr(m[P_ORDER])[i32_ptr(m[P_SLOTS])[s]])  # type: ignore[call-arg]
    if not _room(m, 1):
        return NO_ROOM
    _take(c, m, -1 - s, h, row)
    return INSERTED


@jit
def remove_one(ctx: Any, p: Any, at: Any, unused: Any) -> Any:
    """Take the object ``at`` out of partition ``p``: its row, ``ABSENT`` or ``BAD_KEY``."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    words = _key_words(c, at)
    if words == 0:
        return BAD_KEY
    m = _part(c, p)
    s = _slot_of(c, m, u64_ptr(words))  # type: ignore[call-arg]
    return ABSENT if s < 0 else np.int64(_drop(m, s))


def entry_point(kernel: Any) -> Any:
    """``kernel``'s compiled entry point for four ``int64``: called without numba's dispatch
    (as ``blend/kernels/writes.single_write``)."""
    kernel.compile(_ENTRY)
    return kernel.overloads[_ENTRY].entry_point


@inline
def _part_no(c: Any, at: Any, words: Any, parts: Any, i: Any) -> Any:
    """Entry ``i``'s partition: ``parts[i]``, or (``parts`` empty) its hash's first byte."""
    if parts.shape[0] == 0:
        return np.int64(i64_ptr(words)[0] & 0xFF)  # type: ignore[call-arg]
    return parts[i]


@jit
def rows_of(ctx: Any, handles: Any, parts: Any, out: Any, take: Any) -> None:
    """``out[i]``: the row of the object ``handles[i]`` (an ``id``) in partition
    ``parts[i]`` (``parts`` empty: its first byte), -1 if absent, ``BAD_KEY`` if not an
    exact 32-byte ``bytes``; with ``take``, each found is taken out of its partition."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    for i in range(handles.shape[0]):
        words = _key_words(c, handles[i])
        out[i] = ABSENT if words != 0 else BAD_KEY
        if words != 0:
            p = _part_no(c, handles[i], words, parts, i)
            if 0 <= p < c[C_NPARTS]:
                m = _part(c, p)
                s = _slot_of(c, m, u64_ptr(words))  # type: ignore[call-arg]
                if s >= 0 and take:
                    out[i] = _drop(m, s)
                elif s >= 0:
                    out[i] = i32_ptr(m[P_ORDER])[i32_ptr(m[P_SLOTS])[s]]  # type: ignore[call-arg]


@jit
def short_parts(ctx: Any, handles: Any, parts: Any, counts: Any, short: Any) -> Any:
    """Check a batch of writes: -1 - ``i`` if the object ``handles[i]`` is not an exact
    32-byte ``bytes`` (or its partition does not exist); else how many partitions lack room
    for their entries, ``k``, listed in ``short[:k]``, how many entries each in
    ``short[n:n + k]`` (``n`` partitions; ``counts``: their zeros, a scratch left zero)."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    for i in range(handles.shape[0]):
        words = _key_words(c, handles[i])
        p = -1 if words == 0 else _part_no(c, handles[i], words, parts, i)
        if p < 0 or p >= c[C_NPARTS]:
            counts[:] = 0
            return -1 - i
        counts[p] += 1
    k = 0
    for p in range(counts.shape[0]):
        if counts[p] and not _room(_part(c, p), counts[p]):
            short[k] = p
            short[counts.shape[0] + k] = counts[p]
            k += 1
        counts[p] = 0
    return k


@inline
def _row(rows: Any, first: Any, i: Any) -> Any:
    """Entry ``i``'s row: ``rows[i]``, past them ``first`` onwards."""
    k = rows.shape[0]
    return rows[i] if i < k else first + (i - k)


@jit
def add_rows(ctx: Any, handles: Any, parts: Any, rows: Any, first: Any, replace: Any) -> Any:
    """Map each object ``handles[i]`` (checked by :func:`short_parts`, room made) to row
    ``rows[i]``, past them ``first + i - len(rows)``. A chunk already held: with ``replace``,
    its position keeps the new row (as a dict's ``d[h] = r``); else every insert of this call
    is taken back (nothing changed) and -1 - ``i`` returned. Returns how many were inserted."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    n = handles.shape[0]
    for i in range(n):
        words = c[C_DATA] + handles[i]
        m = _part(c, _part_no(c, handles[i], words, parts, i))
        h = u64_ptr(words)  # type: ignore[call-arg]
        s = _slot_of(c, m, h)
        if s < 0:
            _take(c, m, -1 - s, h, _row(rows, first, i))
        elif replace:  # the position keeps the new row, whose column gets the hash
            r = _row(rows, first, i)
            i32_ptr(m[P_ORDER])[i32_ptr(m[P_SLOTS])[s]] = r  # type: ignore[call-arg]
            column = u64_ptr(c[C_HASHES] + 32 * r)  # type: ignore[call-arg]
            for k in range(HASH_WORDS):
                column[k] = h[k]
        else:
            for j in range(i - 1, -1, -1):
                words = c[C_DATA] + handles[j]
                m = _part(c, _part_no(c, handles[j], words, parts, j))
                _drop(m, _slot_of(c, m, u64_ptr(words)))  # type: ignore[call-arg]
            return -1 - i
    return n


@jit
def fill_words(ctx: Any, words: Any, parts: Any) -> None:
    """A restore's maps: hash ``words[i]`` (four ``uint64``) at row ``i`` of partition
    ``parts[i]`` (room made), written into the hash column and mapped (a hash twice: its
    later row, as a dict's)."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    column = u64_ptr(c[C_HASHES])  # type: ignore[call-arg]
    for i in range(words.shape[0]):
        for k in range(HASH_WORDS):
            column[HASH_WORDS * i + k] = words[i, k]
    for i in range(words.shape[0]):
        m = _part(c, parts[i])
        h = u64_ptr(c[C_HASHES] + 32 * i)  # type: ignore[call-arg]
        s = _slot_of(c, m, h)
        if s < 0:
            _take(c, m, -1 - s, h, i)
        else:
            i32_ptr(m[P_ORDER])[i32_ptr(m[P_SLOTS])[s]] = i  # type: ignore[call-arg]


@jit
def relocate(ctx: Any, p: Any, order: Any, slots: Any) -> None:
    """Move partition ``p`` into new arrays ``order`` (room for its chunks) and ``slots``
    (all -1, a power of two, at most 2/3 full after): positions compacted in order, no
    tombstone."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    m = _part(c, p)
    old = i32_ptr(m[P_ORDER])  # type: ignore[call-arg]
    mask, hashes, k = slots.shape[0] - 1, c[C_HASHES], 0
    for pos in range(m[P_USED]):
        row = old[pos]
        if row >= 0:
            order[k] = row
            i = np.int64(_home(c, u64_ptr(hashes + 32 * np.int64(row))) & np.uint64(mask))  # type: ignore[call-arg]
            while slots[i] != EMPTY:
                i = (i + 1) & mask
            slots[i] = k
            k += 1
    m[P_SLOTS], m[P_MASK] = slots.ctypes.data, mask
    m[P_ORDER], m[P_ORDER_CAP] = order.ctypes.data, order.shape[0]
    m[P_USED], m[P_LIVE], m[P_TOMBS] = k, k, 0


@jit
def part_rows(ctx: Any, p: Any, out: Any) -> Any:
    """Partition ``p``'s rows in order into ``out`` (room for its chunks); returns how many."""
    c = i64_ptr(ctx)  # type: ignore[call-arg]
    m = _part(c, p)
    order, k = i32_ptr(m[P_ORDER]), 0  # type: ignore[call-arg]
    for pos in range(m[P_USED]):
        if order[pos] >= 0:
            out[k] = order[pos]
            k += 1
    return k
