"""A snapshot's token section read into place, on a thread of its own.

Restore overlaps what does not need the GIL with what does: the token section is read into
one buffer (the kernel faults the pages in and copies, the GIL released) while the calling
thread allocates each chunk's content, and the contents are filled from the buffer on the
same thread once the read is in, a piece of :data:`FILL_PIECE` chunks at a time in chunk
order (the copy and the contents' page faults, the GIL released), while the calling thread
builds the records and then the blend index. The index waits only for the pieces whose
contents it reads (:meth:`Filling.wait`), and a caller that waits fills the next piece
nobody has started itself; :meth:`Filling.finish` joins both (filling what is left on both
threads) before anything else reads a content. See docs/directory.md.

Measured and left out (docs/performance.md, "Measured and left out"): building the blend
index on a thread of its own as well (its kernel runs without the GIL: +0.2 s of CPU per
10^6 keys at load 2.5 and no wall time); faulting the pages in first with one
``madvise(MADV_POPULATE_WRITE)`` (0.03 s less CPU, but it holds the process's memory-map
lock while the calling thread allocates: 0.17 s more wall time).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import sys
import threading
import weakref
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.checks import refuse_big_endian
from kvatlas.directory.blend.kernels.planes import FORM_U32
from kvatlas.directory.snapshot.format import SnapshotError
from kvatlas.directory.token_store import (
    empty_contents,
    fill_contents,
    form_sizes,
    stored_batch,
    stored_from_arena,
    widened,
)

V1_GROUP = 65_536
"""Chunks of a version-1 token section read (and compacted) at a time."""

FILL_PIECE = 65_536
"""Chunks whose contents the reading thread fills at a time (the unit :meth:`Filling.wait`
waits for: a blend-index rebuild reads a slice's contents once their pieces are in)."""


class Filling:
    """The contents of a token section being filled: the read, then each piece of
    :data:`FILL_PIECE` chunks in chunk order, by the reading thread and by whoever waits for
    a piece nobody has started (a waiting caller fills it itself: the two threads share the
    copy and its page faults instead of one waiting for the other)."""

    def __init__(
        self, pool: ThreadPoolExecutor, reading: Future[None], pieces: list[tuple[Any, ...]]
    ) -> None:
        """``pieces``: :func:`fill_contents`'s arguments for each piece; the reading thread
        (``pool``'s, ``reading`` its read) fills them once the read is in."""
        self._reading, self._pieces, self._n = reading, pieces, len(pieces)
        self._lock = threading.Lock()
        self._next = 0  # the first piece nobody has started
        self._done = [threading.Event() for _ in pieces]
        self._failed: dict[int, BaseException] = {}
        self._filler = pool.submit(self._fill_all)

    def wait(self, chunks: int) -> None:
        """Return once the contents of the first ``chunks`` chunks are filled, filling those
        of them nobody has started; raises what the read or their fill raised (then call
        :meth:`finish` all the same)."""
        self._reading.result()
        need = min(-(-chunks // FILL_PIECE), self._n)
        while (i := self._claim(need)) is not None:
            self._fill(i)
        for i in range(need):
            self._done[i].wait()
            if i in self._failed:
                raise self._failed[i]

    def finish(self) -> None:
        """Join the read and every piece, whatever happened, filling those nobody has
        started: call it before anything but :meth:`wait`'s caller reads a content, and
        before the contents are dropped (a failed read raises from here once no piece
        writes into them any more)."""
        try:
            self.wait(FILL_PIECE * self._n)
        finally:  # the reading thread fills after the read, whatever the read did
            futures.wait([self._filler])
        self._filler.result()

    def _fill_all(self) -> None:
        while (i := self._claim(self._n)) is not None:
            self._fill(i)

    def _claim(self, below: int) -> int | None:
        with self._lock:
            i = self._next
            if i >= below:
                return None
            self._next += 1
            return i

    def _fill(self, i: int) -> None:
        piece, self._pieces[i] = self._pieces[i], ()  # (its share of the buffer: freed after)
        try:
            fill_contents(*piece)
        except BaseException as exc:
            self._failed[i] = exc
        finally:
            del piece
            self._done[i].set()


def read_token_section(
    f: io.FileIO,
    start: int,
    lens: np.ndarray[Any, Any],
    widths: np.ndarray[Any, Any],
    version: int,
) -> tuple[list[Any], Filling | None]:
    """Each chunk's content (``None`` for unknown content) in its stored form (``widths``:
    form codes), and their :class:`Filling` (``None``: they are done): the whole section is
    read into one buffer on a thread of its own (it releases the GIL) while the contents
    are allocated, and the contents filled from it on that thread after the read, piece by
    piece, while the caller goes on. Call ``finish`` before anything reads a content (but
    through ``wait``), and whatever happens (a failed read raises from it: the restore fails
    before anything is installed). A version-1 section (every width 4) is put in the forms
    its ids need as it is read, on the calling thread; so are a version-2 section's uint32
    contents (written before the planes form existed), once the read is in."""
    if version < 2:  # a group of chunks at a time: no second copy of a whole uint32 section
        lengths, out, pos = lens.astype(np.int64), [], start
        for lo in range(0, len(lengths), V1_GROUP):
            group = lengths[lo : lo + V1_GROUP]
            arena = np.empty(int(group.sum()), np.uint32)
            fill(f, arena.data.cast("B"), pos)
            pos += arena.nbytes
            if sys.byteorder != "little":  # pragma: no cover - the section is little-endian
                arena.byteswap(inplace=True)
            out += stored_from_arena(arena, np.cumsum(group) - group, group)
        return out, None
    refuse_big_endian("a snapshot's token section", SnapshotError)
    lens = lens.astype(np.int64)
    ends = np.cumsum(form_sizes(lens, widths))
    buffer, into = _zeroed(int(ends[-1]) if len(ends) else 0)
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvatlas-restore-read")
    reading = pool.submit(fill, f, into, start)
    try:
        tokens = empty_contents(lens, widths)
    except BaseException:
        pool.shutdown(wait=False)
        futures.wait([reading])  # no read outlives the restore that started it
        raise
    # the contents are filled on the same thread once the read is in, piece by piece (the
    # copy and its page faults, GIL released), while the caller builds the partitions
    pieces = []
    for lo in range(0, len(tokens), FILL_PIECE):
        hi = min(lo + FILL_PIECE, len(tokens))
        at = int(ends[lo - 1]) if lo else 0
        pieces.append((tokens[lo:hi], buffer[at : int(ends[hi - 1])], lens[lo:hi], widths[lo:hi]))
    filling = Filling(pool, reading, pieces)
    pool.shutdown(wait=False)  # (the tasks still run; the thread ends with them)
    if version < 3:
        wide = np.flatnonzero((widths == FORM_U32) & (lens > 0)).tolist()
        if wide:
            filling.finish()
            refit = stored_batch([widened(tokens[i]) for i in wide])  # type: ignore[arg-type]
            for i, stored in zip(wide, refit, strict=True):
                tokens[i] = stored
            return tokens, None
    return tokens, filling


def read_exactly(f: io.FileIO, n: int) -> bytearray:
    """Up to ``n`` bytes from the unbuffered ``f``: one ``read`` returns at most ≈2 GiB on
    Linux, so this loops until ``n`` or the end of the file (then fewer)."""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    view.release()
    del out[got:]
    return out


def fill(f: io.FileIO, view: memoryview, pos: int) -> None:
    """``view`` filled from the file at ``pos`` (a truncated file: :class:`SnapshotError`)."""
    f.seek(pos)
    filled = 0
    while filled < len(view):
        got = f.readinto(view[filled:])
        if not got:
            raise SnapshotError("truncated snapshot token arena")
        filled += got


_ANONYMOUS: int = getattr(mmap, "MAP_ANONYMOUS", 0)


def _zeroed(nbytes: int) -> tuple[npt.NDArray[np.uint8], memoryview]:
    """A fresh buffer of ``nbytes`` and a writable view of it that holds no reference to the
    array: an anonymous mapping of small pages, faulted in by whatever writes them first
    (the read, on its own thread: no page is touched here). Not numpy's own large arrays:
    they ask for huge pages, whose first allocation in a process can stall for a second
    while the kernel compacts memory (docs/performance.md). Traced by ``tracemalloc`` as
    numpy's own memory is, so memory measurements see it while it lives."""
    if not (nbytes and _ANONYMOUS):
        buffer = np.empty(nbytes, np.uint8)
        return buffer, buffer.data.cast("B")
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANONYMOUS)
    buffer = np.frombuffer(mapping, np.uint8)
    address = buffer.ctypes.data
    if _track(_TRACE_DOMAIN, address, nbytes) == 0:  # tracing: forget it when it is freed
        weakref.finalize(mapping, _untrack, _TRACE_DOMAIN, address)
    return buffer, memoryview(mapping)


_TRACE_DOMAIN = 0x6B76  # the tracemalloc domain of restore buffers ("kv")
_track = ctypes.pythonapi.PyTraceMalloc_Track
_track.argtypes, _track.restype = [ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t], ctypes.c_int
_untrack = ctypes.pythonapi.PyTraceMalloc_Untrack
_untrack.argtypes, _untrack.restype = [ctypes.c_uint, ctypes.c_size_t], ctypes.c_int
