"""Long-lived growing arrays in maps of their own (``c_heap.mapped_empty``, used by the blend
index's arrays in ``directory/blend/kernels/layout.py``): a large one is a private map that
goes back to the kernel with the array, a small one stays in the heap, and growing the blend
index's arrays keeps their contents, and the addresses handed to kernels are the new arrays'."""

from __future__ import annotations

import ctypes
import gc
import mmap

import numpy as np

from kvatlas.c_heap import (
    GROWTH_ROOM,
    MAPPED_MIN,
    PAGE,
    mapped_empty,
    mapped_grown,
    mapped_resized,
)
from kvatlas.directory.blend.kernels.layout import CTX_ARRAYS, BlendArrays, write_context
from tests.helpers import mapping_of


def _map_of(a: np.ndarray) -> object:
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_a_large_array_is_a_private_zeroed_map_unmapped_with_the_array() -> None:
    a = mapped_empty((MAPPED_MIN // 40 + 1, 5), np.int64)
    assert a.shape == (MAPPED_MIN // 40 + 1, 5) and a.dtype == np.int64
    assert isinstance(_map_of(a), mmap.mmap) and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % PAGE == 0 and not a.any()
    line = mapping_of(a.ctypes.data)
    assert line is not None and line.split()[1] == "rw-p", line  # private, not shmem
    a[:] = 7
    assert int(a.sum()) == 7 * a.size
    address = a.ctypes.data
    del a, line
    gc.collect()
    assert mapping_of(address) is None  # the pages went back with the array


def test_a_small_array_stays_in_the_heap() -> None:
    a = mapped_empty(MAPPED_MIN // 8 - 1, np.int64)
    assert a.base is None and a.shape == (MAPPED_MIN // 8 - 1,)
    assert mapped_empty(0, np.uint8).shape == (0,)


def test_growing_the_blend_arrays_past_the_map_size_keeps_contents_and_fills_the_rest() -> None:
    rng = np.random.default_rng(5)
    arrays = BlendArrays.empty(1024)
    fields = ("c_fp", "c_addr", "c_first", "o_i64", "o_i32", "o_hlen")
    for f in fields:
        a = getattr(arrays, f)
        a[...] = rng.integers(0, 100, a.shape, dtype=np.int64).astype(a.dtype)
    before = {f: getattr(arrays, f).copy() for f in fields}
    grown = MAPPED_MIN // 8  # every content and occupant column of >= 8 bytes a row is mapped
    old = arrays
    arrays = arrays.with_content_capacity(grown).with_occupant_capacity(grown)
    fills = {"c_first": -1}
    for f in fields:
        a = getattr(arrays, f)
        assert (
            a.shape[0] == grown
            and a.shape[1:] == before[f].shape[1:]
            and a.dtype == before[f].dtype
        )
        assert np.array_equal(a[:1024], before[f]), f
        assert (a[1024:] == fills.get(f, 0)).all(), f
    assert isinstance(_map_of(arrays.c_fp), mmap.mmap) and isinstance(
        _map_of(arrays.o_i64), mmap.mmap
    )
    table = arrays.with_empty_table(MAPPED_MIN // 2).table
    assert isinstance(_map_of(table), mmap.mmap) and (table == -1).all()
    # the addresses a single write is handed are the grown arrays', and stay mapped
    ctx = write_context(
        arrays,
        4,
        np.zeros((2, 4), np.uint64),
        0,
        (np.zeros(4, np.uint32), np.zeros(4, np.int64)),
        (0, 0, 0, 0),
        0,
    )
    del old
    gc.collect()
    for k, f in enumerate(BlendArrays._fields):
        a = getattr(arrays, f)
        assert (
            ctx[CTX_ARRAYS + 2 * k] == a.ctypes.data and ctx[CTX_ARRAYS + 2 * k + 1] == a.shape[0]
        )
        assert mapping_of(a.ctypes.data) is not None


def test_a_mapped_array_grows_in_place_within_its_room_and_keeps_its_contents() -> None:
    rows = MAPPED_MIN // 40 + 1
    a = mapped_empty((rows, 5), np.int64, 3)
    a[:] = np.arange(a.size).reshape(a.shape)
    grown = mapped_grown(a, 3 * rows)
    assert grown is not None and grown.ctypes.data == a.ctypes.data
    assert grown.shape == (3 * rows, 5) and grown.dtype == np.int64
    assert np.array_equal(grown[:rows], np.arange(a.size).reshape(a.shape))
    assert not grown[rows:].any()  # the room: zeros
    grown[0, 0] = -5
    assert a[0, 0] == -5  # the old array stays valid: the new one's first rows
    assert mapped_grown(a, 3 * rows + 1) is None  # past the room
    assert mapped_grown(a[1:], rows) is None  # not from the map's start
    assert mapped_grown(np.zeros((rows, 5), np.int64), rows + 1) is None  # not mapped


def test_the_blend_arrays_grow_in_place_then_move_when_their_room_is_used() -> None:
    arrays = BlendArrays.empty(1024).with_occupant_capacity(MAPPED_MIN // 8)
    arrays.o_i64[:, 1] = np.arange(arrays.o_i64.shape[0])
    at = arrays.o_i64.ctypes.data
    rows = arrays.o_i64.shape[0]
    within = arrays.with_occupant_capacity(GROWTH_ROOM * rows)
    assert within.o_i64.ctypes.data == at
    assert np.array_equal(within.o_i64[:rows, 1], np.arange(rows))
    assert not within.o_i64[rows:].any()
    beyond = within.with_occupant_capacity(GROWTH_ROOM * rows + 1)
    assert beyond.o_i64.ctypes.data != at
    assert np.array_equal(beyond.o_i64[:rows, 1], np.arange(rows)) and not beyond.o_i64[rows:].any()
    assert (beyond.o_i32[rows:] == 0).all() and (beyond.o_hlen[rows:] == 0).all()


def _resident_bytes(a: np.ndarray) -> int:
    """How many bytes of ``a``'s pages are resident (``mincore``: per page, not per mapping;
    the kernel merges neighbouring anonymous maps into one). A read of a page never written
    maps the zero page, which counts here: measure before reading the room."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = a.ctypes.data
    pages = -(-a.nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) == 0
    return PAGE * sum(v & 1 for v in vec)


def test_a_growths_room_is_not_resident_until_written_and_reads_as_its_fill() -> None:
    """Growing by zeros leaves the new rows as the kernel's zero pages (resident only once
    written: each growth's room is not part of the process's RSS); other fills are written;
    the heap's arrays are filled as before."""
    rows = MAPPED_MIN // 8
    a = mapped_empty(rows, np.int64, GROWTH_ROOM)
    a[:] = 3
    grown = mapped_resized(a, 3 * rows, 0)
    assert grown.ctypes.data == a.ctypes.data  # in place
    assert _resident_bytes(grown) == a.nbytes  # the room (2 MiB) untouched
    assert not grown[rows:].any() and (grown[:rows] == 3).all()
    moved = mapped_resized(grown, 5 * rows, 0)  # past the room: a new map, the copy written
    assert _resident_bytes(moved) == grown.nbytes  # (the copy; 2 of 5 MiB untouched)
    assert moved.ctypes.data != a.ctypes.data and not moved[rows:].any()
    assert (moved[:rows] == 3).all()
    filled = mapped_resized(moved, 6 * rows, -1)
    assert (filled[5 * rows :] == -1).all() and not filled[rows : 5 * rows].any()
    small = mapped_resized(np.full(4, 7, np.int64), 8, 0)  # (the heap's: np.empty, filled)
    assert small.tolist() == [7] * 4 + [0] * 4
