"""Rebuilding the blend index from restored records, column-wise (a restore with blend on).

A restore installs records the index has never seen; with blend lookup on, every indexable
one (known content of ``chunk_size`` tokens at a known offset) is added for each namespace
its keys are in. Done op by op that costs Python per chunk (an ``AddOp`` each,
validated one by one, tracked by the garbage collector) and grows the index's arrays dozens of
times. Here the bindings are read column-wise (C-level maps over the records), the adds go
to the index as one :class:`~kvatlas.directory.blend.AddColumns` built at once
(:meth:`~kvatlas.directory.blend.BlendIndex.build`: the columnar add path, no Python per
entry, arrays and table sized once for the known number of contents), and records not yet
marked indexed (the snapshot reader marks them when blend is on as it reads) are marked by
C-level tuple concatenation. Only
records with keys in several namespaces take a Python step each (one extra add per further
namespace). Same state and answers as adding each chunk by itself
(``tests/directory/test_reindex.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_not
from typing import cast

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import AddColumns, BlendIndex
from kvatlas.directory.blend.hash_words import HashWords
from kvatlas.directory.chunk_counts import Partition
from kvatlas.directory.chunk_parts import ChunkPart
from kvatlas.directory.records import (
    Record,
    first_shape_ids,
    indexed_records,
    key_counts,
    record_indexed,
    record_offset,
    record_stored_tokens,
    shape_ids,
)
from kvatlas.directory.shapes import ShapeTable
from kvatlas.directory.token_store import StoredTokens, stored_shapes
from kvatlas.events import UNKNOWN_OFFSET
from kvatlas.keys import BlendNamespace


def reindex_records(
    parts: Sequence[Partition | ChunkPart],
    shapes: ShapeTable,
    chunk_size: int,
    index: BlendIndex,
) -> None:
    """Add every indexable chunk of ``parts`` to ``index`` (fresh: one
    :meth:`~kvatlas.directory.blend.BlendIndex.build`) and mark its record indexed."""
    hashes: list[bytes] = []
    records: list[Record] = []
    bounds = [0]
    for part in parts:
        hashes += part.keys()
        records += part.values()
        bounds.append(len(records))
    n = len(records)
    if not n:
        return
    tokens = list(map(record_stored_tokens, records))
    offsets = np.fromiter(map(record_offset, records), np.int64, n)
    bound = np.fromiter(map(is_not, tokens, repeat(None)), np.bool_, n)
    lengths = np.zeros(n, np.int64)
    bound_tokens = cast(list[StoredTokens], list(compress(tokens, bound.tolist())))
    lengths[bound] = stored_shapes(bound_tokens)[0]  # ids, whatever the form
    rows = np.flatnonzero(bound & (lengths == chunk_size) & (offsets != UNKNOWN_OFFSET))
    if not len(rows):
        return
    picked = rows.tolist()
    records = list(map(records.__getitem__, picked))
    hashes = list(map(hashes.__getitem__, picked))
    several = np.flatnonzero(key_counts(records) > 1).tolist()
    adds, _ = index_adds(
        cast(list[StoredTokens], list(map(tokens.__getitem__, picked))),  # all bound
        hashes,
        offsets[rows],
        np.asarray(first_shape_ids(records), np.int64),
        [(r, shape_ids(records[r])) for r in several],
        shapes,
    )
    index.build(adds)
    # mark the records indexed (unless the reader built them marked), partition by
    # partition (same keys: no dict resizes)
    todo = ~np.fromiter(map(record_indexed, records), np.bool_, len(records))
    if not todo.any():
        return
    picked = np.flatnonzero(todo).tolist()
    marked = indexed_records(map(records.__getitem__, picked))
    hashes = list(map(hashes.__getitem__, picked))
    cuts = np.searchsorted(rows[todo], bounds).tolist()
    for part, lo, hi in zip(parts, cuts, cuts[1:], strict=False):
        if hi > lo:
            part.update(zip(hashes[lo:hi], marked[lo:hi], strict=True))


def index_adds(
    tokens: list[StoredTokens],
    hashes: list[bytes] | HashWords,
    offsets: npt.NDArray[np.int64],
    first_sids: npt.NDArray[np.int64],
    several: Sequence[tuple[int, Sequence[int]]],
    shapes: ShapeTable,
    per_chunk: Sequence[npt.NDArray[np.uint64] | None] = (),
) -> tuple[AddColumns, list[npt.NDArray[np.uint64] | None]]:
    """The index adds of indexable chunks given as columns (``tokens``, ``hashes``,
    ``offsets``, the shape id of each one's first key): one add per chunk for its first
    key's namespace, then one per further namespace of the chunks in ``several`` (``(row,
    every key's shape id)``: chunks with more than one key), in row and namespace order;
    and each column of ``per_chunk`` (a value per chunk, or ``None``) the same way, one value
    per add (a snapshot's fingerprints and anchors)."""
    spaces: dict[BlendNamespace, int] = {}
    space_of_shape = np.array(
        [spaces.setdefault(s.namespace, len(spaces)) for s in shapes.shapes], np.int64
    )
    which = space_of_shape[first_sids]
    extra: list[int] = []  # (row, namespace index) of each further namespace, flattened
    for r, sids in several:
        first = int(which[r])
        for s in sorted({int(space_of_shape[sid]) for sid in sids} - {first}):
            extra += (r, s)
    if extra:
        more = np.array(extra[0::2], np.int64)
        tokens = tokens + list(map(tokens.__getitem__, more.tolist()))
        if isinstance(hashes, HashWords):  # (a restore's column: rows, not objects)
            hashes = hashes.take(np.concatenate((np.arange(len(hashes)), more)))
        else:
            hashes = hashes + list(map(hashes.__getitem__, more.tolist()))
        offsets = np.concatenate((offsets, offsets[more]))
        which = np.concatenate((which, np.array(extra[1::2], np.int64)))
        per_chunk = [None if c is None else np.concatenate((c, c[more])) for c in per_chunk]
    return AddColumns(tokens, hashes, offsets, list(spaces), which), list(per_chunk)
