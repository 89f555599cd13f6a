"""A restore's blend index, built from a snapshot's columns while its contents are filled.

With blend on (it is never turned off) the reader builds the records the index will hold
marked indexed, and the index from the columns (``directory/reindex.py``), not from the
records: each slice of adds once its contents are filled (``token_section.Filling``), while
the rest are filled. ``install`` publishes it whole.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from itertools import compress
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import BlendIndex
from kvatlas.directory.blend.anchors import SavedAnchors
from kvatlas.directory.blend.fingerprints import Fingerprints
from kvatlas.directory.blend.hash_words import HashWords
from kvatlas.directory.key_directory import KeyDirectory
from kvatlas.directory.reindex import index_adds
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.snapshot.format import Columns, Header
from kvatlas.directory.snapshot.saved_columns import (
    check_sample,
    saved_anchors,
    saved_fingerprints,
)
from kvatlas.directory.snapshot.token_section import Filling
from kvatlas.events import UNKNOWN_OFFSET


def indexable_chunks(
    directory: KeyDirectory, header: Header[memoryview], cols: Columns
) -> npt.NDArray[np.bool_] | None:
    """Chunks the blend index holds: bound content of ``chunk_size`` tokens, a known offset
    (as ``chunk_binding._bind`` decides); ``None`` when the restore builds no index (blend
    off: then ``install`` reads the records, if blend is on by then)."""
    if not directory.blend_lookup_enabled or header.chunk_size != directory.chunk_size:
        return None
    out: npt.NDArray[np.bool_] = (cols.lens == header.chunk_size) & (cols.offsets != UNKNOWN_OFFSET)
    return out


class IndexRoom(NamedTuple):
    """A restore's new blend index for the ``indexable`` chunks, its room being made."""

    blend: BlendIndex
    indexable: npt.NDArray[np.bool_]
    made: Future[None]


def index_room(directory: KeyDirectory, indexable: npt.NDArray[np.bool_]) -> IndexRoom:
    """A new blend index, room for the ``indexable`` chunks' adds made and faulted in on a
    thread of its own (``BlendIndex.reserve``) while the caller builds the records: ≈60 MB
    of arrays at 10^6 chunks, whose page faults (≈0.1 s) the build would otherwise take."""
    index = directory.new_blend_index()
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvatlas-index-room")
    made = pool.submit(index.reserve, int(np.count_nonzero(indexable)))
    pool.shutdown(wait=False)  # (the task still runs; the thread ends with it)
    return IndexRoom(index, indexable, made)


def built_index(
    room: IndexRoom,
    header: Header[memoryview],
    cols: Columns,
    tokens: list[Any],
    hashes: HashWords,
    sids: npt.NDArray[np.int64],
    table: ShapeTable,
    filling: Filling | None,
) -> BlendIndex:
    """The blend index of ``room``'s indexable chunks (all: the columns as they are), built
    from the columns while ``filling`` fills their contents (each slice once its contents
    are in). The adds are what the records ``reader._build`` marks indexed hold, vouched for
    (the index takes them without looking at each content: ``AddColumns.vouched``), safe
    because of where they come from: each content is a ``bytes`` this restore made itself
    in its form (``token_section.py``), of ``chunk_size`` ids (:func:`indexable_chunks`);
    each hash is 32 bytes of ``chunk_hashes`` (whose length ``reader._columns`` checked; read
    where they are, no ``bytes`` made: :class:`HashWords`); each offset is >= 0
    (``reader._columns`` refuses < -1, the indexable drop -1); namespaces index their list.
    Each add's fingerprint and anchor are the saved ones, if any (checked here on a sample
    once the contents are in)."""
    indexable = room.indexable
    at = np.flatnonzero(indexable)
    saved, anchored = saved_fingerprints(header, len(hashes)), saved_anchors(header, len(hashes))
    counts, first_key = cols.counts, cols.first_key
    several = [  # (row, every key's shape id) of the chunks with several keys
        (r, sids[first_key[c] : first_key[c] + counts[c]].tolist())
        for r in np.flatnonzero(counts[at] > 1).tolist()
        for c in (int(at[r]),)
    ]
    if len(at) < len(tokens):
        marks = indexable.tolist()
        tokens, hashes = list(compress(tokens, marks)), hashes.take(at)
    adds, (fps, anchor_values) = index_adds(
        tokens,
        hashes,
        cols.offsets[at].astype(np.int64),
        sids[first_key[at]],
        several,
        table,
        [None if column is None else column[1][at] for column in (saved, anchored)],
    )
    fingerprints = None if saved is None or fps is None else Fingerprints(saved[0], fps)
    anchors = None
    if anchored is not None and anchor_values is not None:
        anchors = SavedAnchors(anchored[0], anchor_values)

    def ready(k: int) -> None:  # the contents of the first k adds filled (those after
        if filling is not None and k:  # the first len(at) are further namespaces' adds of them)
            filling.wait(int(at[min(k, len(at)) - 1]) + 1)

    index = room.blend
    room.made.result()
    index.build(adds._replace(vouched=True), fingerprints, ready, anchors)
    for checked in (fingerprints, anchors):
        if checked is not None:
            ready(len(checked.values))
            check_sample(checked, adds.tokens)
    return index
