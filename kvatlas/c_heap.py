"""The C allocator's main heap (glibc): its functions through ``ctypes``, room faulted in on
another core ahead of a burst of allocations (:class:`HeapRoom`), arrays faulted in ahead of
their first writes (:func:`fault_in`), and long-lived growing arrays kept out of the heap, in
maps of their own (:func:`mapped_empty`).

Why the room: the first write to each fresh 4 KiB page of the heap is a page fault, ≈1.5 µs of
kernel time apiece on these VMs, taken by the thread that writes it while it holds the GIL. A
restore of 10^6 chunks allocates ≈580 MB of contents in one burst (≈145,000 faults, a third
of its wall time in a fresh process) while its reading thread waits for them. With the room,
the heap grows once for the whole burst and a thread of its own asks the kernel to fault the
new pages in (``madvise(MADV_POPULATE_WRITE)``, one call, the GIL released) while the
allocating thread goes on: the faults move to the other core (docs/performance.md, "Directory:
design figures"). Elsewhere (no glibc, a kernel before 5.14) nothing happens: the room is a hint,
never a condition of anything.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""
DEFAULT_TOP_PAD = 128 * 1024
"""glibc's own ``M_TOP_PAD`` (``DEFAULT_TOP_PAD``): what a heap grows by beyond a request."""
MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from the heaps, never from a map of their own: glibc's own ceiling
for its sliding mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)."""
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Free memory at a heap's top that glibc keeps rather than hands back after a ``free``: what
glibc pairs with that ceiling (twice the mmap threshold)."""
ROOM_MIN = 64 << 20
"""Bursts smaller than this get no room: their faults cost little (≈16,000 at most, ≈25 ms),
and setting ``M_TOP_PAD`` changes the process's allocator for good (see :class:`HeapRoom`)."""
MADV_POPULATE_WRITE = 23
"""``madvise``: fault the range in, writable, now (Linux 5.14; an error before: nothing)."""
PAGE = 4096
FAULT_IN_MIN = 1 << 20
"""Arrays :func:`fault_in` leaves alone: smaller ones cost a few faults at most."""
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0)
"""A map's unused room is not counted against the system's commit limit."""
MAPPED_MIN = 1 << 20
"""Arrays :func:`mapped_empty` places in a map of their own from this size on (below it, the
heap's holes they could leave are small)."""


def glibc(name: str, restype: Any, *argtypes: Any) -> Callable[..., Any] | None:
    """glibc's (or the C library's) function ``name`` (``None`` where there is none: musl
    has no ``malloc_trim``, macOS no ``mallopt``). Called through ``ctypes``, which releases
    the GIL for the call."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function  # type: ignore[no-any-return]


def _madvise() -> Callable[[int, int, int], int] | None:
    """glibc's ``madvise`` (``None`` where there is none)."""
    return glibc("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def whole_pages(start: int, end: int) -> tuple[int, int]:
    """The page-aligned range of the whole pages inside ``[start, end)`` (empty: ``lo >= hi``)."""
    return -(-start // PAGE) * PAGE, end // PAGE * PAGE


def malloc_blocks(requested: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """What glibc's ``malloc`` takes for each request of ``requested`` bytes: its 8-byte
    header added, rounded up to 16, at least 32."""
    return np.maximum((requested + 8 + 15) // 16 * 16, 32)


def fault_in(
    arrays: Iterable[npt.NDArray[Any]], madvise: Callable[[int, int, int], int] | None = None
) -> int:
    """Fault in the whole pages of each array of at least :data:`FAULT_IN_MIN` bytes,
    writable, without changing a byte (``madvise(MADV_POPULATE_WRITE)``, the GIL released):
    whoever writes them next takes no page fault. Returns the bytes asked for; nothing
    happens without glibc's ``madvise`` or before Linux 5.14 (a hint, like the room)."""
    madvise = madvise or _madvise()
    asked = 0
    for a in arrays:
        lo, hi = whole_pages(a.ctypes.data, a.ctypes.data + a.nbytes)
        if madvise is not None and a.nbytes >= FAULT_IN_MIN and hi > lo:
            madvise(lo, hi - lo, MADV_POPULATE_WRITE)
            asked += hi - lo
    return asked


def mapped_empty(
    shape: int | tuple[int, ...], dtype: npt.DTypeLike, room: int = 1
) -> npt.NDArray[Any]:
    """An uninitialised array (zeros, when mapped) for a long-lived array that is replaced by a
    larger copy as it grows: from :data:`MAPPED_MIN` bytes on, in an anonymous private map
    of its own, unmapped when the last array viewing it is gone. In glibc's heap, each old
    copy freed is a hole of free but resident pages between younger blocks (glibc hands back
    only a heap's top), ≈100 B a chunk at 10^5 chunks in a coordinator until the next
    ``malloc_trim`` (docs/performance.md, "Service: design figures"); a map's pages go back
    to the kernel when it is freed. Per-request buffers stay in the heap: there, a map would
    be faulted in afresh on every request. ``room``: the map is that many times the array's
    size (address space only: pages never written are not resident), so that
    :func:`mapped_grown` can grow the array in place that far."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MAPPED_MIN:
        return np.empty(shape, dt)
    # MAP_PRIVATE: Python's default for an anonymous map is shared (shmem-backed) memory.
    area = mmap.mmap(-1, room * nbytes, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
    return np.frombuffer(area, dt, math.prod(shape)).reshape(shape)


def mapped_grown(arr: npt.NDArray[Any], rows: int) -> npt.NDArray[Any] | None:
    """``arr`` (an array of :func:`mapped_empty`, the whole of it from its map's start) as
    ``rows`` rows in place: the same address, its contents kept, the rows past them the map's
    (zeros, or what a smaller view wrote there); ``None`` when it has no map or too little
    room. The old array stays valid and sees the new one's first rows."""
    view = arr.base
    while (
        isinstance(view, np.ndarray)
        and view.base is not None
        and not isinstance(view.base, memoryview)
    ):
        view = view.base
    if not isinstance(view, np.ndarray) or not isinstance(view.base, memoryview):
        return None
    area = view.base.obj
    row = arr.itemsize * math.prod(arr.shape[1:])
    if (
        not isinstance(area, mmap.mmap)
        or view.ctypes.data != arr.ctypes.data
        or not arr.flags.c_contiguous
        or rows * row > len(area)
    ):
        return None
    return np.frombuffer(area, arr.dtype, rows * math.prod(arr.shape[1:])).reshape(
        (rows, *arr.shape[1:])
    )


GROWTH_ROOM = 4
"""A map made by :func:`mapped_resized` has room for this many times its rows (address space
only): the array grows in place, copied once every ≈12 growths by an eighth."""


def mapped_resized(arr: npt.NDArray[Any], capacity: int, fill: int) -> npt.NDArray[Any]:
    """``arr``, a long-lived array of :func:`mapped_empty` that only grows (its largest view
    so far), as ``capacity`` rows: in place (the same address) where its map has room, else
    in a new map with room for :data:`GROWTH_ROOM` times the rows (no hole left behind in a
    heap, as a reallocation leaves); the rows past ``arr``'s set to ``fill``. In a map, rows
    no view has reached yet are the kernel's zero pages: a ``fill`` of 0 leaves them
    untouched, so a growth's room is not resident before rows are written there."""
    assert capacity >= arr.shape[0]
    out = mapped_grown(arr, capacity)
    zeros = out is not None  # (in place: past the largest view, nothing was ever written)
    if out is None:
        out = mapped_empty((capacity, *arr.shape[1:]), arr.dtype, GROWTH_ROOM)
        zeros = out.base is not None  # (a new map: zeros past the copy; else the heap's)
        out[: arr.shape[0]] = arr
    if fill or not zeros:
        out[arr.shape[0] :] = fill  # each byte written once (np.full then a copy: twice)
    return out


class HeapRoom:
    """Room for ``nbytes`` of blocks this thread is about to allocate from glibc's main heap,
    faulted in on a thread of its own while they are allocated. Inside ``with``, the heap's
    next growth is by ``nbytes`` at once (``M_TOP_PAD``); call :meth:`made` between pieces of
    the burst: the first time the heap has grown, the new pages the rest of the burst will
    take are handed to a thread that faults them in. On leaving, ``M_TOP_PAD`` is glibc's
    default again and the thread is joined. Pages faulted in and never used: at most what
    one piece took from below the old break (the heap's top is trimmed as usual later).

    Setting any of glibc's thresholds stops it sliding its mmap and trim thresholds for the
    rest of the process (glibc's ``no_dyn_threshold``), ``M_TOP_PAD`` included; so a room
    leaves them pinned where they would slide to under load, and where the coordinator's
    memory trim pins them anyway (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`): left
    where they were, a process's large buffers could be mapped and faulted in afresh on
    every request. Bursts below :data:`ROOM_MIN` get no room."""

    def __init__(
        self,
        nbytes: int,
        *,
        mallopt: Callable[[int, int], int] | None = None,
        sbrk: Callable[[int], int] | None = None,
        madvise: Callable[[int, int, int], int] | None = None,
    ) -> None:
        self.nbytes = nbytes
        self._mallopt = mallopt or glibc("mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int)
        self._sbrk = sbrk or glibc("sbrk", ctypes.c_void_p, ctypes.c_ssize_t)
        self._madvise = madvise or _madvise()
        self._break = 0  # the heap's break on entering (0: no room is made)
        self._padded = False
        self._thread: threading.Thread | None = None
        self.faulted: tuple[int, int] | None = None  # the range handed to the thread

    def __enter__(self) -> HeapRoom:
        if self._mallopt is None or self._sbrk is None or self._madvise is None:
            return self
        if self.nbytes < ROOM_MIN or not self._mallopt(M_TOP_PAD, self.nbytes):
            return self
        self._padded = True
        self._break = int(self._sbrk(0) or 0)
        return self

    def made(self, left: int) -> None:
        """A piece of the burst is allocated; ``left``: the bytes of blocks still to come."""
        if not self._break or self._thread is not None or left <= 0:
            return
        assert self._sbrk is not None
        now = int(self._sbrk(0) or 0)
        if now <= self._break:  # not grown yet (the piece fitted in free blocks)
            return
        # The blocks still to come are carved from the new top, which starts below the old
        # break by at most what this piece took from there.
        lo, hi = whole_pages(self._break, min(now, self._break + left))
        if hi <= lo:
            return
        self.faulted = (lo, hi)
        self._thread = threading.Thread(
            target=self._fault_in, args=(lo, hi - lo), name="kvatlas-heap-room", daemon=True
        )
        self._thread.start()

    def _fault_in(self, address: int, length: int) -> None:
        assert self._madvise is not None
        self._madvise(address, length, MADV_POPULATE_WRITE)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._padded:
            assert self._mallopt is not None
            self._mallopt(M_TOP_PAD, DEFAULT_TOP_PAD)
            self._mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            self._mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            self._padded = False
        if self._thread is not None:
            self._thread.join()
            self._thread = None
