"""A batch's entries read as columns, grouped for the rules that change one key's placements
in bulk (deletes, accesses, re-stores): the chunks held under one key, grouped by that key's
placements value (a stored batch's chunks share one) and shape, so a rule computes each
group's new placements once and writes them to every row of it, no record built. Chunks
held under several keys are left to the rules' entry-by-entry paths.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

from kvatlas.directory.chunk_parts import ChunkPart, rows_of


@dataclass(frozen=True, slots=True)
class KeyGroups:
    """Entry ``held[j]`` of the batch names a chunk held at ``rows[j]`` under a known shape;
    ``fields`` are the rows' four columns (contents, ``2 * shape id + indexed``, the first
    key's placements, the other keys; see ``ChunkColumns.fields``), aligned with ``held``.
    ``groups`` maps (``id`` of a placements value, shape id) to the positions ``j`` of the
    chunks under one key, that key the entry's, each chunk once (its first entry: a repeat
    reads what the first one left); ``left`` are the entries of chunks under several keys,
    in order (with ``keep_rest``: every entry not grouped). An entry in neither names no held
    key: it changes nothing."""

    held: list[int]
    rows: list[int]
    fields: tuple[Sequence[Any], ...]
    groups: dict[tuple[int, int], list[int]]
    left: list[int]

    def placements(self, group: list[int]) -> Any:
        """The placements value a group shares."""
        return self.fields[2][group[0]]


def key_groups(
    parts: Sequence[ChunkPart],
    hashes: list[bytes],
    sids: Sequence[int | None],
    *,
    keep_rest: bool = False,
) -> KeyGroups | None:
    """The :class:`KeyGroups` of entries (chunk ``hashes``, shape ids ``sids``; ``None``: a
    shape never interned), or ``None`` if no entry names a held chunk under a known shape.
    With ``keep_rest`` (a store: an entry that names no held key adds one, and a repeat of a
    chunk may change it again) every entry not grouped is ``left``, and so is every entry
    of a chunk the batch names more than once."""
    found = [
        (i, r, s)
        for i, r, s in zip(count(), rows_of(parts, hashes), sids)
        if r is not None and s is not None
    ]
    if not found:
        return None
    held, rows, shapes = map(list, zip(*found, strict=True))
    fields = parts[0].cols.fields(rows)
    _, flagged, placements, rests = fields
    left: list[int] = []
    first: dict[int, int] = {}  # row -> its chunk's first entry (a position in ``held``)
    for j, rest, f, sid in zip(count(), rests, flagged, shapes):
        if rest:
            left.append(held[j])
        elif f >> 1 == sid:
            first.setdefault(rows[j], j)
    if keep_rest:
        once = set(first.values())
        if len(rows) != len(set(rows)):  # chunks named twice: every entry of them left
            named = Counter(rows)
            once = {j for j in once if named[rows[j]] == 1}
        grouped = {held[j] for j in once}
        left = [i for i in range(len(hashes)) if i not in grouped]
        first = {rows[j]: j for j in sorted(once)}
    groups: dict[tuple[int, int], list[int]] = {}
    for j in first.values():
        groups.setdefault((id(placements[j]), shapes[j]), []).append(j)
    return KeyGroups(held, rows, fields, groups, left)
