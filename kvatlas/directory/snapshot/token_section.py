"""A snapshot's token section read into place, piece by piece, beside the caller.

Restore overlaps what does not need the GIL with what does: the token section is read a
piece of :data:`FILL_PIECE` chunks at a time, in chunk order, each piece into a scratch
buffer of the thread that takes it and its contents filled from there (the reads, the copies
and the contents' page faults release the GIL). A reading thread starts on the first piece
while the calling thread allocates each chunk's content, and goes on while the caller builds
the records and then the blend index; the index waits only for the pieces whose contents it
reads (:meth:`Filling.wait`), and a caller that waits takes the next piece nobody has started
itself. :meth:`Filling.finish` joins both (filling what is left on both threads) before
anything else reads a content, and frees the scratch buffers. See docs/directory.md.

Measured and left out (docs/performance.md): building the blend index on a thread of its own
as well (its kernel runs without the GIL: +0.2 s of CPU per 10^6 keys at load 2.5 and no wall
time); one buffer for the whole section (a page fault per 4 KB of it: ≈0.3 s more CPU per
10^6 keys than the pieces' reused scratch buffers).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import sys
import threading
import weakref
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import blake3
import numpy as np
import numpy.typing as npt

from kvatlas.c_heap import HeapRoom, malloc_blocks
from kvatlas.checks import refuse_big_endian
from kvatlas.directory.blend.kernels.objects import payload_addresses
from kvatlas.directory.blend.kernels.planes import FORM_PLANES, FORM_U32
from kvatlas.directory.blend.kernels.pointers import releasing, u8_ptr
from kvatlas.directory.snapshot.format import SnapshotError
from kvatlas.directory.token_store import (
    content_sizes,
    empty_contents,
    stored_batch,
    stored_from_arena,
    widened,
)

V1_GROUP = 65_536
"""Chunks of a version-1 token section read (and compacted) at a time."""

ALLOCATE_PIECE = 4_096
"""Contents allocated at a time by :func:`allocated_contents` (between two pieces its heap
room may start: pages faulted in and never used are at most one piece's, ≈2.4 MB)."""

FILL_PIECE = 16_384
"""Chunks read and filled at a time: each piece is read into a scratch buffer of the thread
that takes it (reused, so its pages are faulted in once and stay in cache) and its
contents filled from there; and the unit :meth:`Filling.wait` waits for."""


Scratch = tuple[npt.NDArray[np.uint8], memoryview]
"""A buffer a thread reads a piece into (:func:`_zeroed`'s array and writable view)."""


class Filling:
    """A token section read into its contents a piece of :data:`FILL_PIECE` chunks at a
    time, in chunk order: by a reading thread of its own, which starts at once (reading the
    first piece while the contents are allocated), and by whoever waits for a piece nobody
    has started (a waiting caller takes it itself: the two threads share the reads, the
    copies and their page faults instead of one waiting for the other). One caller thread."""

    def __init__(
        self,
        f: io.FileIO,
        start: int,
        ends: npt.NDArray[np.int64],
        lens: Any,
        forms: Any,
        digests: list[bytes] | None = None,
        piece: int | None = None,
    ) -> None:
        """``ends``: where each chunk's bytes end in the section (from ``start`` in ``f``);
        ``digests``: each piece's checksum (version 6: pieces of ``piece`` chunks, the
        file's), checked when it is read."""
        self._f, self._start, self._lens, self._forms = f, start, lens, forms
        piece = piece or FILL_PIECE
        self._n = -(-len(lens) // piece)
        at = np.minimum(np.arange(self._n + 1) * piece, len(lens))
        self._bounds = piece_bounds(ends, piece)  # each piece's bytes: bounds[i] to bounds[i + 1]
        self._widest = int(np.diff(self._bounds).max(initial=0))
        self._sizes = np.diff(ends, prepend=0)  # each chunk's bytes in the section
        self._digests = digests
        self._at = at  # each piece's first chunk (and the end)
        self._targets: FillTargets | None = None  # where the contents' bytes go
        self._made: list[int] = []  # each piece's first target (and the end)
        self._allocated = threading.Event()
        self._lock = threading.Lock()
        self._next = 1  # the first piece nobody has started (the reading thread starts at 0)
        self._done = [threading.Event() for _ in range(self._n)]
        self._failed: dict[int, BaseException] = {}
        self._callers: Scratch | None = None  # the caller's scratch (the reader's: its own)
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvatlas-restore-read")
        self._reader = pool.submit(self._read_all)
        pool.shutdown(wait=False)  # (the task still runs; the thread ends with it)

    def allocated(self, contents: list[Any]) -> None:
        """The contents to fill (:func:`allocated_contents`). Where each piece's bytes go is
        worked out here, for all pieces at once, so that filling one takes the GIL only to
        start its copy: a thread that needs it between steps waits, each time, for whatever
        long C-level pass the caller is in (building the partitions: 0.4 s for the first
        piece at 10^6 keys, docs/performance.md). The targets' sizes are the section's own
        (the pieces' bounds come from them): each piece's fill takes exactly its bytes."""
        present = self._lens > 0
        try:
            targets = fill_targets(contents, present, self._forms, self._sizes)
        except BaseException:
            self.abandon()
            raise
        self._targets = targets
        self._made = np.concatenate(([0], np.cumsum(present)))[self._at].tolist()
        self._allocated.set()

    def abandon(self) -> None:
        """The contents' allocation failed: return once the reading thread has ended (the
        pieces it reads are dropped)."""
        self._allocated.set()
        futures.wait([self._reader])

    def wait(self, chunks: int) -> None:
        """Return once the contents of the first ``chunks`` chunks are filled, taking those
        pieces nobody has started; raises what their read or fill raised (then call
        :meth:`finish` all the same)."""
        need = min(-(-chunks // FILL_PIECE), self._n)
        while (i := self._claim(need)) is not None:
            if self._callers is None:
                self._callers = _zeroed(self._widest)
            self._piece(i, self._callers)
        for i in range(need):
            self._done[i].wait()
            if i in self._failed:
                raise self._failed[i]

    def finish(self) -> None:
        """Fill every piece (taking those nobody has started) and join the reading thread,
        whatever happened: call it before anything but :meth:`wait`'s caller reads a
        content, and before the contents are dropped (a failed piece raises from here once
        no piece writes into them any more). The scratch buffers and targets are freed."""
        try:
            self.wait(FILL_PIECE * self._n)
        finally:
            futures.wait([self._reader])
            self._callers, self._targets = None, None
        self._reader.result()

    def _read_all(self) -> None:
        scratch = _zeroed(self._widest)
        if self._n:
            self._piece(0, scratch)
        while (i := self._claim(self._n)) is not None:
            self._piece(i, scratch)

    def _claim(self, below: int) -> int | None:
        with self._lock:
            i = self._next
            if i >= below:
                return None
            self._next += 1
            return i

    def _piece(self, i: int, scratch: Scratch) -> None:
        """Read piece ``i`` into this thread's ``scratch``, then (once they are allocated) fill
        its contents from there."""
        lo, hi = self._bounds[i], self._bounds[i + 1]
        try:
            fill(self._f, scratch[1][: hi - lo], self._start + lo)
            if (
                self._digests is not None
                and piece_digest(scratch[1][: hi - lo]) != self._digests[i]
            ):
                raise SnapshotError(f"snapshot token arena piece {i} fails its checksum")
            self._allocated.wait()
            if self._targets is not None:
                part = self._targets.part(self._made[i], self._made[i + 1])
                fill_piece(part, scratch[0][: hi - lo])
        except BaseException as exc:
            self._failed[i] = exc
        finally:
            self._done[i].set()


def read_token_section(
    f: io.FileIO,
    start: int,
    lens: np.ndarray[Any, Any],
    widths: np.ndarray[Any, Any],
    ends: npt.NDArray[np.int64],
    version: int,
    digests: list[bytes] | None = None,
    piece: int | None = None,
) -> tuple[list[Any], Filling | None]:
    """Each chunk's content (``None`` for unknown content) in its stored form (``widths``:
    form codes; ``ends``: where each chunk's bytes end in the section, ``form_sizes``
    summed, which the caller checked against the file), and their :class:`Filling`
    (``None``: they are done): the section is read and the contents filled a piece at a
    time on a thread of its own (the reads and the copies release the GIL) while the
    contents are allocated and the caller goes on. Call ``finish`` before anything reads a
    content (but through ``wait``), and whatever happens (a failed read raises from it: the
    restore fails before anything is installed). A version-1 section (every width 4) is put
    in the forms its ids need as it is read, on the calling thread; so are a version-2
    section's uint32 contents (written before the planes form existed), once they are
    read."""
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
    filling = Filling(f, start, ends, lens, widths, digests, piece)
    try:
        tokens = allocated_contents(lens, widths)
    except BaseException:
        filling.abandon()  # no read outlives the restore that started it
        raise
    filling.allocated(tokens)
    if version < 3:
        wide = np.flatnonzero((widths == FORM_U32) & (lens > 0)).tolist()
        if wide:
            filling.finish()
            refit = stored_batch([widened(tokens[i]) for i in wide])  # type: ignore[arg-type]
            for i, stored in zip(wide, refit, strict=True):
                tokens[i] = stored
            return tokens, None
    return tokens, filling


def allocated_contents(lens: npt.NDArray[np.int64], forms: Any) -> list[bytes | None]:
    """:func:`empty_contents` of every chunk, a piece of :data:`ALLOCATE_PIECE` at a time, in
    a :class:`~kvatlas.c_heap.HeapRoom` of their size: their pages are faulted in on another
    core while this thread allocates (in a fresh process, one page fault per 4 KiB of
    contents otherwise: a third of a restore's wall time)."""
    sizes, present = content_sizes(lens, forms), lens > 0
    at = [slice(lo, lo + ALLOCATE_PIECE) for lo in range(0, len(lens), ALLOCATE_PIECE)]
    # glibc's bytes for each piece's contents (a piece at a time: small arrays, in cache)
    blocks = [int(malloc_blocks(sizes[p] + _BYTES_SIZE)[present[p]].sum()) for p in at]
    left = sum(blocks)
    contents: list[bytes | None] = [None] * len(lens)
    with HeapRoom(left) as room:
        for p, piece in zip(at, blocks, strict=True):
            contents[p] = empty_contents(sizes[p], present[p])
            left -= piece
            room.made(left)
    return contents


_BYTES_SIZE = sys.getsizeof(b"")
"""What a ``bytes`` object asks ``malloc`` for beyond its length (its header and the NUL)."""


class FillTargets(NamedTuple):
    """Where the contents of :func:`empty_contents` are filled (:func:`fill_targets`), as
    columns over the present ones, in order: the address of each one's bytes, the bytes of
    its ids in a snapshot's token section (``token_store.form_sizes``), its form code."""

    dsts: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    forms: npt.NDArray[np.int64]

    def part(self, lo: int, hi: int) -> FillTargets:
        """The targets ``[lo, hi)`` (of the present contents)."""
        return FillTargets(self.dsts[lo:hi], self.sizes[lo:hi], self.forms[lo:hi])


def fill_targets(
    contents: list[bytes | None],
    present: npt.NDArray[np.bool_],
    forms: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
) -> FillTargets:
    """The :class:`FillTargets` of the contents of :func:`empty_contents` (``present``: where
    they are not ``None``), of each chunk's form and its bytes in the section
    (:func:`~kvatlas.directory.token_store.form_sizes`)."""
    if bool(present.all()):
        return FillTargets(payload_addresses(contents), sizes, forms)  # type: ignore[arg-type]
    made: list[bytes] = [c for c in contents if c is not None]
    return FillTargets(payload_addresses(made), sizes[present], forms[present])


def fill_piece(targets: FillTargets, payloads: npt.NDArray[np.uint8]) -> None:
    """Write into the contents of ``targets`` (nobody else holds them yet) their headers and,
    one after another in ``payloads``, the bytes of their ids in their form (a snapshot's
    token section, little-endian): one compiled pass, the GIL released. ``payloads`` is as
    long as ``targets.sizes`` add up to by construction (a piece's bounds are the sum of its
    chunks' sizes in the section, :class:`Filling`)."""
    _fill(payloads, targets.sizes, targets.forms, targets.dsts)


@releasing  # (a restore fills pieces on two threads while the partitions and index are built)
def _fill(payloads: Any, sizes: Any, forms: Any, dsts: Any) -> None:
    """Content ``j`` (at ``dsts[j]``) = its header and the next ``sizes[j]`` bytes. The
    payloads are read through a pointer: indexed, each read checked for a negative index and
    the copy ran a byte at a time (6.8 against 0.8 ms for a piece of 16,384 Llama 3
    contents). ``payloads`` holds the ``sizes`` (:func:`fill_piece`)."""
    src: Any = u8_ptr(payloads.ctypes.data)  # type: ignore[call-arg]
    at = 0
    for j in range(dsts.shape[0]):
        dst: Any = u8_ptr(dsts[j])  # type: ignore[call-arg]
        form = forms[j]
        skip = 0
        if form < FORM_PLANES:
            dst[1] = np.uint8(form)
            skip = form
        n = sizes[j]
        for k in range(n):
            dst[skip + k] = src[at + k]
        at += n


def piece_bounds(ends: npt.NDArray[np.int64], piece: int) -> list[int]:
    """Where each piece of ``piece`` chunks starts in a token section whose chunks' bytes end
    at ``ends``, and where the last ends: the pieces a restore reads, and those a version-6
    snapshot has a checksum for."""
    pieces = -(-len(ends) // piece)
    starts = np.concatenate(([0], ends)).astype(np.int64)
    bounds: list[int] = starts[np.minimum(np.arange(pieces + 1) * piece, len(ends))].tolist()
    return bounds


def piece_digest(data: bytes | memoryview) -> bytes:
    """The checksum of one piece of a version-6 snapshot's token section."""
    return blake3.blake3(data).digest()


def read_exactly(f: io.FileIO, n: int) -> memoryview:
    """Up to ``n`` bytes from the unbuffered ``f`` (fewer at the end of the file), as a
    read-only view of a buffer of their own (:func:`_zeroed`'s: read into as the kernel hands
    it out, no zeroing pass, small pages). One ``read`` returns at most ≈2 GiB on Linux, so
    this loops until ``n`` or the end."""
    view, got = _zeroed(n)[1], 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return view[:got].toreadonly()


def fill(f: io.FileIO, view: memoryview, pos: int) -> None:
    """``view`` filled from the file at ``pos`` (a truncated file: :class:`SnapshotError`),
    by positional reads (threads may read one file at once)."""
    filled = 0
    while filled < len(view):
        got = os.preadv(f.fileno(), [view[filled:]], pos + filled)
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
