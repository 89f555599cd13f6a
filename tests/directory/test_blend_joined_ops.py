"""An index write made of several batches' ops (``op_columns``: one batch's columns each,
joined): a namespace several batches name is one namespace of the write, so that a body of
batches in one namespace takes the write's one-namespace paths; every op keeps its own."""

from __future__ import annotations

import numpy as np

from kvatlas.directory.blend import AddColumns, RemoveChunkOp
from kvatlas.directory.blend.op_columns import op_columns
from kvatlas.keys import BlendNamespace

CHUNK = 4
A, B = BlendNamespace("m"), BlendNamespace("m", "salt")


def _adds(first: int, spaces: list[BlendNamespace], of: list[int] | None) -> AddColumns:
    n = 3
    tokens = [np.arange(k, k + CHUNK, dtype=np.uint32) for k in range(first, first + n)]
    for t in tokens:
        t.flags.writeable = False
    hashes = [bytes([first + k]) * 32 for k in range(n)]
    return AddColumns(tokens, hashes, np.zeros(n, np.int64), spaces, of)


def test_batches_of_one_namespace_join_as_one() -> None:
    cols = op_columns([_adds(0, [A], None), _adds(10, [BlendNamespace("m")], None)], CHUNK)
    assert cols is not None and cols.spaces == [A]
    assert cols.space_of.tolist() == [0] * 6


def test_each_op_keeps_its_namespace() -> None:
    parts = [
        _adds(0, [A], None),
        _adds(10, [B, A], [1, 0, 1]),
        RemoveChunkOp(np.arange(CHUNK, dtype=np.uint32), bytes([99]) * 32),
        _adds(20, [B], None),
    ]
    cols = op_columns(parts, CHUNK)
    assert cols is not None and sorted(map(repr, cols.spaces)) == sorted(map(repr, [A, B]))
    named = [None if s < 0 else cols.spaces[s] for s in cols.space_of.tolist()]
    assert named == [A, A, A, A, B, A, None, B, B, B]
