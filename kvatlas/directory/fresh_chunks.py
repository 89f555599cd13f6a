"""A ``store`` batch of new chunks, stored in bulk: the usual batch (a node reports chunks it
just computed), so the one :meth:`StoreRules.store <kvatlas.directory.chunk_stores.StoreRules.store>`
takes without Python code per entry.

:func:`store_fresh` stores exactly the records the table's entry-by-entry loop would (the same
columns, placement rows shared by size, in the same partitions; no record tuple) with C-level
maps over the batch's columns, and says which entries the blend index must add. It takes only batches where
that loop would do nothing else: every entry a chunk the table does not hold, no hash twice,
one key shape, every entry bound to a whole chunk of tokens (no log line per entry); for any
other batch it does nothing and the loop runs. :func:`store_adds` gives the index adds of a
store batch's new chunks (either path's) as one :class:`~kvatlas.directory.blend.AddColumns`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np

from kvatlas.directory.blend import AddColumns
from kvatlas.directory.chunk_parts import ChunkPart, add_fresh
from kvatlas.directory.records import PlacementRow, placement_row
from kvatlas.directory.shapes import KeyShape
from kvatlas.directory.token_store import StoredTokens
from kvatlas.events import UNKNOWN_OFFSET, EventBatch
from kvatlas.events.columns import EntryColumns, shape_index


def fresh_kind(
    parts: list[ChunkPart], cols: EntryColumns, sids: list[int], chunk_size: int
) -> bool:
    """Whether the entries ``cols`` (shape ids ``sids``) may be of the bulk path's kind: one
    shape, whole chunks of tokens, the first a chunk the table does not hold (a batch of
    re-stores, the usual other kind, is told by its first). The rest :func:`store_fresh`
    finds as it inserts."""
    n = len(cols)
    if sids.count(sids[0]) != n or cols.token_lengths.tolist().count(chunk_size) != n:
        return False
    return not first_held(parts, cols.chunk_hashes)


def first_held(parts: list[ChunkPart], hashes: Sequence[bytes]) -> bool:
    """Whether the table holds the first of ``hashes`` (a batch of re-stores, the usual kind
    the bulk path does not take, is told by its first)."""
    return bool(hashes) and hashes[0] in parts[hashes[0][0]]


def store_fresh(
    parts: list[ChunkPart],
    batches: Sequence[tuple[EventBatch, int]],
    cols: EntryColumns,
    sids: list[int],
    stored: list[StoredTokens | None],
    chunk_size: int,
    indexing: bool,
) -> tuple[int, list[int]] | None:
    """Store the entries ``cols`` (shape ids ``sids``, tokens ``stored``) as new chunks into
    ``parts`` if they qualify (see the module docstring); returns the bytes stored and the
    entries whose chunk is indexed (``indexing``: blend is on; offset known), or ``None``,
    having changed nothing. ``batches``: each batch and how many of the entries are its, in
    order (one batch, or a run of one emitter's: :mod:`~kvatlas.directory.store_runs`); an
    entry is placed as its batch says."""
    hashes, n = cols.chunk_hashes, len(cols)
    if not fresh_kind(parts, cols, sids, chunk_size):
        return None
    sizes, offsets = cols.size_bytes.tolist(), cols.token_offsets.tolist()
    placements: list[PlacementRow] = []
    at = 0
    for b, count in batches:
        own = sizes[at : at + count] if len(batches) > 1 else sizes
        rows = {
            size: placement_row(
                b.instance_id, b.incarnation, b.tier, b.backend, size, b.shared, b.ts
            )
            for size in set(own)
        }
        # (one placement row: the usual batch, without a lookup per entry)
        placements += [*rows.values()] * count if len(rows) == 1 else map(rows.__getitem__, own)
        at += count
    every = indexing and UNKNOWN_OFFSET not in offsets
    if every:
        indexed = [True] * n
    else:
        indexed = list(map(UNKNOWN_OFFSET.__ne__, offsets)) if indexing else [False] * n
    # inserted where absent, in one pass: a chunk the table holds (or the batch names twice)
    # keeps its record (then every row this inserted is taken out again, and the
    # entry-by-entry loop runs)
    # (``parts``, the table's list: each entry into ``parts[h[0]]``)
    if not add_fresh(parts, hashes, stored, cols.token_offsets, indexed, sids[0], placements):
        return None
    return sum(sizes), list(range(n)) if every else list(compress(range(n), indexed))


def store_adds(
    rows: list[int],
    cols: EntryColumns,
    stored: list[StoredTokens | None],
    sids: list[int],
    shapes: Sequence[KeyShape],
) -> AddColumns:
    """The index adds of entries ``rows`` of a store batch (new chunks, indexed), as columns:
    their stored contents, hashes, offsets and namespaces, vouched for: the directory made
    every content (``stored_columns``; a chunk's indexed content is chunk-sized, its hash 32
    exact bytes, its offset known)."""
    if len(rows) == len(cols) and sids.count(sids[0]) == len(sids):  # every entry, one shape
        tokens, hashes, offsets = stored, cols.chunk_hashes, cols.token_offsets
        spaces, which = [shapes[sids[0]].namespace], None
    else:
        used, which = shape_index(list(map(sids.__getitem__, rows)))  # (np.unique: the GIL)
        tokens = list(map(stored.__getitem__, rows))
        hashes = list(map(cols.chunk_hashes.__getitem__, rows))
        offsets = cols.token_offsets[np.array(rows, np.intp)]
        spaces = [shapes[s].namespace for s in used]
    # entries built from objects: a key's hash may be a ``bytes`` subclass, which the index
    # would keep by reference unchecked (decoded bodies' hashes are exact ``bytes``)
    exact = cols.token_objects is None or set(map(type, hashes)) == {bytes}
    return AddColumns(tokens, hashes, offsets, spaces, which, vouched=exact)
