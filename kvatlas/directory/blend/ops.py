"""The writes of a blend index, as typed values: what :meth:`BlendIndex.apply` takes.

Each op has exactly the effect of the method of the same name; a batch of them is applied in
order and atomically (see ``index.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvatlas.keys import BlendNamespace


class AddOp(NamedTuple):
    """Index ``chunk_hash`` (stored at ``token_offset``) as matchable for ``namespace``."""

    tokens: Any
    chunk_hash: bytes
    token_offset: int
    namespace: BlendNamespace


class RemoveClaimOp(NamedTuple):
    """Drop ``namespace``'s claim on the chunk; the occupant goes with its last claim."""

    tokens: Any
    chunk_hash: bytes
    namespace: BlendNamespace


class RemoveChunkOp(NamedTuple):
    """Drop the chunk's occupant and all its claims (re-stored with new content)."""

    tokens: Any
    chunk_hash: bytes


class AddColumns(NamedTuple):
    """``AddOp(tokens[j], chunk_hashes[j], token_offsets[j], namespaces[namespace_of[j]])``
    for each ``j``, in order, as columns: what an ingest batch queues (no op object per
    chunk). ``namespace_of`` ``None``: every entry is ``namespaces[0]``'s. When every content
    is one the index keeps as it is (the directory's stored contents of ``chunk_size`` ids, or
    read-only, C-contiguous, owning arrays), every hash an exact ``bytes`` of at
    most 32 and every offset valid, the whole batch is prepared without Python per entry;
    otherwise it is applied as the ``AddOp``s it stands for (same validation, same errors).

    ``vouched``: the caller guarantees all of that already (the directory, for contents it
    has just made itself; a snapshot reader, for the contents it made): the index then takes
    the columns without looking at each content (``op_columns.py``; tests hold both
    callers to it)."""

    tokens: Sequence[Any]
    chunk_hashes: Sequence[bytes]
    token_offsets: Any  # a sequence of ints or an integer array
    namespaces: Sequence[BlendNamespace]
    namespace_of: Any = None  # a sequence of ints or an integer array
    vouched: bool = False

    def ops(self) -> list[AddOp]:
        """The ``AddOp``s this stands for."""
        return [AddOp(*row) for row in self.rows()]

    def rows(self) -> list[tuple[Any, bytes, Any, BlendNamespace]]:
        """The ``AddOp``s' fields, as plain tuples (cheaper to make)."""
        spaces, which = self.namespaces, _namespace_ids(self.namespace_of, len(self.tokens))
        offsets = _listed(self.token_offsets)
        if len({len(self.tokens), len(self.chunk_hashes), len(offsets), len(which)}) != 1:
            raise ValueError("AddColumns: columns of different lengths")
        return [
            (t, h, o, spaces[s])
            for t, h, o, s in zip(self.tokens, self.chunk_hashes, offsets, which, strict=True)
        ]


class RemoveClaimColumns(NamedTuple):
    """``RemoveClaimOp(tokens[j], chunk_hashes[j], namespaces[namespace_of[j]])`` for each
    ``j``, in order, as columns: what fencing an instance queues for the chunks it empties
    (no op object per chunk). ``namespace_of`` ``None``: every entry is ``namespaces[0]``'s.
    ``vouched`` as for :class:`AddColumns` (the directory, for contents it keeps); otherwise
    applied as the ``RemoveClaimOp``s it stands for (same validation, same errors)."""

    tokens: Sequence[Any]
    chunk_hashes: Sequence[bytes]
    namespaces: Sequence[BlendNamespace]
    namespace_of: Any = None  # a sequence of ints or an integer array
    vouched: bool = False

    def ops(self) -> list[RemoveClaimOp]:
        """The ``RemoveClaimOp``s this stands for."""
        return [RemoveClaimOp(*row) for row in self.rows()]

    def rows(self) -> list[tuple[Any, bytes, BlendNamespace]]:
        """The ``RemoveClaimOp``s' fields, as plain tuples (cheaper to make)."""
        spaces, which = self.namespaces, _namespace_ids(self.namespace_of, len(self.tokens))
        if len({len(self.tokens), len(self.chunk_hashes), len(which)}) != 1:
            raise ValueError("RemoveClaimColumns: columns of different lengths")
        return [
            (t, h, spaces[s]) for t, h, s in zip(self.tokens, self.chunk_hashes, which, strict=True)
        ]


def _namespace_ids(namespace_of: Any, n: int) -> list[int]:
    """Each of ``n`` entries' index into ``namespaces`` (``None``: all the first)."""
    return [0] * n if namespace_of is None else _listed(namespace_of)


def _listed(values: Any) -> list[Any]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


BlendOp = AddOp | RemoveClaimOp | RemoveChunkOp | AddColumns | RemoveClaimColumns
"""One write of :meth:`BlendIndex.apply`: the arguments of the method of the same name
(:class:`AddColumns`: many adds; :class:`RemoveClaimColumns`: many claims dropped)."""
