"""A snapshot's token section read into place, on a thread of its own.

Restore overlaps what does not need the GIL with what does: the token section is read into
its slab (the kernel faults the pages in and copies, the GIL released) while the calling
thread builds the records. Nothing reads a content before the read is joined
(the returned ``Future``; a content the cut copies instead of viewing waits for it too).
See docs/directory.md.

Measured and left out (docs/performance.md, "Measured and left out"): building the blend
index on a thread of its own as well (its kernel runs without the GIL: +0.2 s of CPU per
10^6 keys at load 2.5 and no wall time); faulting the pages in first with one
``madvise(MADV_POPULATE_WRITE)`` (0.03 s less CPU, but it holds the process's memory-map
lock while the calling thread allocates: 0.17 s more wall time).
"""

from __future__ import annotations

import io
import sys
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.planes import FORM_U32
from kvatlas.directory.snapshot.format import SnapshotError
from kvatlas.directory.token_slab import TokenSlab
from kvatlas.directory.token_store import form_sizes, stored_batch, stored_from_arena

V1_GROUP = 65_536
"""Chunks of a version-1 token section read (and compacted) at a time."""


def read_token_section(
    f: io.FileIO,
    start: int,
    lens: np.ndarray[Any, Any],
    widths: np.ndarray[Any, Any],
    version: int,
) -> tuple[list[Any], tuple[TokenSlab, ...], Future[None] | None]:
    """Each chunk's content (``None`` for unknown content) in its stored form (``widths``:
    form codes), the slab that holds them, and the read still under way (``None``: done).

    The whole section is read into one :class:`TokenSlab` and each content is a read-only
    view of it, cut in bulk (no allocation per chunk; the chunk table frees the slab once
    most of it is dead, see :mod:`kvatlas.directory.token_store`). The read runs on a thread
    of its own (it releases the GIL), so the views are cut before their ids are in: wait for
    the read before anything reads them. A version-1 section (every width 4) is put in the
    forms its ids need as it is read, into arrays of their own, on the calling thread; so
    are a version-2 section's uint32 contents (written before the planes form existed),
    once the read is in."""
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
        return out, (), None
    slab = TokenSlab(int(form_sizes(lens, widths).sum()))
    into = slab.mapped_memory()
    reading = None
    if into is None or sys.byteorder != "little":  # (cut swaps the ids in place)
        fill(f, slab.buffer.data.cast("B"), start)
    else:
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvatlas-restore-read")
        reading = pool.submit(fill, f, into, start)
        pool.shutdown(wait=False)  # (the read still runs; the thread ends with it)
    try:
        tokens = slab.cut(lens, widths, None if reading is None else reading.result)
    except BaseException:
        if reading is not None:  # no read outlives the restore that started it
            futures.wait([reading])
        raise
    if version < 3:
        wide = np.flatnonzero((widths == FORM_U32) & (lens > 0)).tolist()
        if wide:
            if reading is not None:
                reading.result()
                reading = None
            refit = stored_batch([tokens[i] for i in wide])  # (their views of the slab die:
            for i, stored in zip(wide, refit, strict=True):  # the chunk table reclaims it)
                tokens[i] = stored
    return tokens, (slab,) if slab.views else (), reading


def fill(f: io.FileIO, view: memoryview, pos: int) -> None:
    """``view`` filled from the file at ``pos`` (a truncated file: :class:`SnapshotError`)."""
    f.seek(pos)
    filled = 0
    while filled < len(view):
        got = f.readinto(view[filled:])
        if not got:
            raise SnapshotError("truncated snapshot token arena")
        filled += got
