"""Settling a batch's dropped claims column-wise: what :meth:`IndexState._settle` hands over
for the ``remove_claim`` ops that only dropped a claim (an occupant's inline one, not one of
its extra set) or nothing, and with it maybe the occupant and the content (a fence's
``RemoveClaimColumns``: one op a chunk). Settled one by one, each cost a Python pass of its
own; for these ops any order settles the same (every count is a sum, and an occupant or
content goes once: ids freed by a batch are not reused within it), so they are settled as
columns. Tests: ``tests/directory/test_fence_columns.py`` (against the ops one by one).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.id_lists import put, tally
from kvatlas.directory.blend.kernels import F_CLAIM_DROPPED, F_CONTENT_GONE, F_OCCUPANT_GONE
from kvatlas.directory.blend.namespaces import NamespaceIds
from kvatlas.directory.blend.op_checks import Tokens, token_nbytes


class DropsOf(Protocol):
    """What settling drops changes of an index's state (``state.IndexState``)."""

    namespaces: NamespaceIds
    tokens: list[Tokens | None]
    owned: set[int]
    claims: int
    occupants: int
    contents: int
    token_bytes: int
    owned_bytes: int


def settle_drops(
    state: DropsOf,
    flags: npt.NDArray[np.int64],
    contents: npt.NDArray[np.int64],
    occupants: npt.NDArray[np.int64],
    nss: npt.NDArray[np.int64],
) -> None:
    """The bookkeeping of such ops (per op the kernel's flags, content id and occupant id,
    and its namespace id: columns, so a small batch settles without releasing the GIL), as
    ``_settle_removal`` does it op by op."""
    dropped = flags & F_CLAIM_DROPPED != 0
    if dropped.any():
        for ns, n in tally(nss[dropped]):
            state.namespaces.release(ns, n)
        state.claims -= int(np.count_nonzero(dropped))
    state.occupants -= int(np.count_nonzero(flags & F_OCCUPANT_GONE))
    ids = contents[flags & F_CONTENT_GONE != 0]
    if len(ids):
        gone = list(map(state.tokens.__getitem__, ids.tolist()))
        state.token_bytes -= sum(map(token_nbytes, [t for t in gone if t is not None]))
        if state.owned:
            for cid, arr in zip(ids.tolist(), gone, strict=True):
                if arr is not None and cid in state.owned:
                    state.owned.discard(cid)
                    state.owned_bytes -= token_nbytes(arr)
        put(state.tokens, ids, [None] * len(ids))
        state.contents -= len(ids)
