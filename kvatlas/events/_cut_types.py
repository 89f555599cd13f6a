"""The type both the JSON codec and its compiled scanner speak, in a module of its own so that
neither imports the other for it (the codec loads the scanner, and numba, only when used)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

KV_RANK, GROUP, SIZE, OFFSET, TOKENS, MODEL_AT, MODEL_END, SALT_AT, SALT_END, RUN, START = range(11)
COLUMNS = 11
"""Rows of the integer column matrix (``cols[c, e]``: column ``c`` of entry ``e``): the key's
``kv_rank`` and ``object_group_id``, ``size_bytes``, ``token_offset``, the count of token
ids, the model name's and the cache salt's spans in the body, the entry's run (entries one
after the other with one key shape share a run; runs count up from 0) and where its token
ids start in the arena (the ids of the entries before it, all of them)."""


class CutBody(NamedTuple):
    """What the compiled scanner (``_json_cut.cut_entries``) gives: the body with each batch's
    entries cut out, and the entries as columns (row ``e``: the ``e``-th entry of the body)."""

    small: npt.NDArray[np.uint8]
    """The body with each batch's ``entries`` array written ``[]``."""
    arena: npt.NDArray[np.uint32]
    """Every entry's token ids, one after the other."""
    counts: npt.NDArray[np.int64]
    """Each batch object's count of entries, in body order."""
    hashes: npt.NDArray[np.uint8]
    """Each entry's chunk hash (32 bytes a row)."""
    cols: npt.NDArray[np.int64]
    """Each entry's integers and spans (:data:`COLUMNS`: ``cols[column, entry]``)."""
    runs: npt.NDArray[np.int64]
    """The first entry of each run of entries of one key shape."""
