"""Building an empty blend index from vouched adds: the Python around the write kernel done
once, column-wise (a restore's rebuild, ``BlendIndex.build``).

The adds go through the one write kernel (``kernels.apply_ops``) in the slices the general
path would apply them in; what differs is the Python around it. Each content's form and
address are read in one compiled pass (``contents.vouched_layout``) instead of a call per
content; the op arrays are filled from whole columns; and the bookkeeping is settled once
for all adds. That is exact because the index starts empty: nothing is freed, so ids are
handed out fresh and in order, and the k-th add the kernel reports a new content (occupant)
for is content (occupant) id k. The index's list of contents is then the adds' column where
the kernel said so (it copied each new occupant's hash into its row), its counters sums over
the reported flags. Namespaces are registered in
the order the sliced path registers them, so its ids are the same too: the state is exactly
the one :meth:`IndexState.apply` builds (``tests/directory/test_blend_bulk_build.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend import _cpython
from kvatlas.directory.blend.anchors import SavedAnchors
from kvatlas.directory.blend.hash_words import HashWords
from kvatlas.directory.blend.kernels import (
    ADD,
    F_EXTRA_CLAIM,
    F_NEW_CLAIM,
    F_NEW_CONTENT,
    F_NEW_OCCUPANT,
)
from kvatlas.directory.blend.kernels.contents import vouched_layout
from kvatlas.directory.blend.kernels.layout import IDS_CONTENTS, IDS_OCCUPANTS
from kvatlas.directory.blend.kernels.objects import hash_lengths, object_handles
from kvatlas.directory.blend.namespaces import NamespaceIds
from kvatlas.directory.blend.op_checks import HASH_WIDTH, token_nbytes
from kvatlas.directory.blend.ops import AddColumns
from kvatlas.directory.blend.state import IndexState

_EXTRA = F_NEW_CLAIM | F_EXTRA_CLAIM
"""The flags of an add whose claim went to the extra-claim set (a further namespace)."""

_ANY_SIZE = 1 << 62
"""A bound no object's size reaches (``hash_lengths`` as a check of type alone)."""


def is_empty(state: IndexState) -> bool:
    """Whether ``state`` never held anything (its id lists only ever grow)."""
    return not state.tokens and not state.occupant_ids and not len(state.namespaces)


def build_empty(
    state: IndexState,
    adds: AddColumns,
    fps: npt.NDArray[np.uint64] | None,
    slice_size: int,
    ready: Callable[[int], None] | None = None,
    anchors: SavedAnchors | None = None,
) -> bool:
    """Apply ``adds`` (``vouched``, at least one) to the empty ``state`` as
    ``IndexState.apply`` of each slice of ``slice_size`` adds, the last add on its own,
    would, then shrink the extra-claim set as ``BlendIndex.build`` does. ``fps``: each
    add's fingerprint under the state's base and bits, or ``None``. ``ready(k)``, if given,
    is called before the payloads of the first ``k`` adds' contents are read, slice by
    slice, and blocks until they may be (``BlendIndex.build``). ``anchors``: each add's
    content anchor under a key the caller checked, adopted instead of anchoring every content
    on the first lookup. Returns ``False``, having
    changed nothing, unless every content is a ``bytes`` content, every hash a ``bytes`` of
    at most ``HASH_WIDTH`` (or ``chunk_hashes`` is a :class:`HashWords` column, read where its
    hashes are) and every column one entry per add (then the caller takes the
    general path, which refuses what is wrong). An exception midway leaves ``state`` partly
    written: the caller discards it."""
    tokens = adds.tokens if type(adds.tokens) is list else list(adds.tokens)
    n = len(tokens)
    layout = _cpython.OBJECT_LAYOUT
    if layout is None or not n:  # pragma: no cover - not CPython + numpy
        return False
    contents = object_handles(tokens)
    data_off = _cpython.BYTES_DATA_OFFSET
    widths, addrs = np.empty(n, np.int64), np.empty(n, np.int64)
    # each content's type (its size into widths, written over below): no payload read yet
    if not hash_lengths(contents, tuple(layout), id(bytes), _ANY_SIZE, widths):
        return False
    hashes = adds.chunk_hashes
    which_n = n if adds.namespace_of is None else len(adds.namespace_of)
    if len(hashes) != n or len(adds.token_offsets) != n or which_n != n:
        return False  # (the general path refuses them)
    if type(hashes) is HashWords:  # (a snapshot's column: each hash read where it is)
        handles, hash_lens = hashes.addresses(), np.full(n, HASH_WIDTH, np.int64)
    else:
        hashes = list(hashes)  # (kept alive while their addresses are read)
        handles = object_handles(hashes)
        hash_lens = np.empty(n, np.int64)
        if not hash_lengths(handles, tuple(layout), id(bytes), HASH_WIDTH, hash_lens):
            return False
        handles += data_off  # each hash's payload
    offsets = np.asarray(adds.token_offsets).astype(np.int64, copy=False)
    which = (
        np.zeros(n, np.int64)
        if adds.namespace_of is None
        else np.asarray(adds.namespace_of).astype(np.int64, copy=False)
    )
    bounds = [*range(0, n - 1, slice_size), n - 1, n]
    ns = _registered(state.namespaces, list(adds.namespaces), which, bounds)[which]
    # one namespace: every further add to an occupant is its inline claim's (no extra claim)
    state.reserve(n, 0 if bool((ns == ns[0]).all()) else None)
    flags = np.empty(n, np.int64)
    extra: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
    nbytes = 0
    for lo, hi in pairwise(bounds):
        if ready is not None:
            ready(hi)
        nbytes += vouched_layout(
            contents[lo:hi], tuple(layout), id(bytes), data_off, widths[lo:hi], addrs[lo:hi]
        )
        out = state.run_ops(
            ADD,
            addrs[lo:hi],
            widths[lo:hi],
            handles[lo:hi],
            hash_lens[lo:hi],
            offsets[lo:hi],
            ns[lo:hi],
            None if fps is None else fps[lo:hi],
        )
        flags[lo:hi] = out[:, 0]
        at = np.flatnonzero(out[:, 0] & _EXTRA == _EXTRA)
        if len(at):
            extra.append((at + lo, out[at, 2]))
    _settle(state, tokens, flags, ns, nbytes, anchors)
    before_last = 0  # extra claims before the last add (BlendIndex.build)
    for at, occs in extra:
        before_last += int(np.count_nonzero(at < n - 1))
        for occ, space in zip(occs.tolist(), ns[at].tolist(), strict=True):
            state.extra_claims.setdefault(occ, set()).add(space)
    state.n_extra += sum(len(at) for at, _ in extra)
    state.namespaces.end_write()
    state.trim_claims(before_last + 1)
    return True


def _registered(
    namespaces: NamespaceIds, spaces: list[Any], which: npt.NDArray[np.int64], bounds: list[int]
) -> npt.NDArray[np.int64]:
    """Each of ``spaces``' id, registered in the order slice by slice registration does
    (``IndexState._op_namespaces``): a slice's new namespaces in ``spaces`` order, slices in
    order (-1: a namespace no add uses, not registered)."""
    first = np.full(len(spaces), len(which), np.int64)
    np.minimum.at(first, which, np.arange(len(which)))
    order = sorted(
        (int(np.searchsorted(bounds, f, side="right")), s)
        for s, f in enumerate(first.tolist())
        if f < len(which)
    )
    ids = np.full(len(spaces), -1, np.int64)
    for _, s in order:
        ids[s] = namespaces.register(spaces[s])
    return ids


def _settle(
    state: IndexState,
    tokens: list[Any],
    flags: npt.NDArray[np.int64],
    ns: npt.NDArray[np.int64],
    nbytes: int,
    anchors: SavedAnchors | None,
) -> None:
    """The bookkeeping of all adds at once (``IndexState._settle`` of each slice): fresh
    ids in order, so the list of contents is the column where the flags say new (the
    kernel copied each new occupant's hash into its row)."""
    new = flags & F_NEW_CONTENT != 0
    if new.all():
        state.tokens += tokens
        state.token_bytes += nbytes
    else:
        kept = list(compress(tokens, new.tolist()))
        state.tokens += kept
        state.token_bytes += sum(map(token_nbytes, kept))
    state.contents += int(np.count_nonzero(new))
    state.occupants += int(np.count_nonzero(flags & F_NEW_OCCUPANT))
    if anchors is None:
        state.anchors.note_all()
    else:  # (the new contents' anchors: their ids are handed out in order)
        state.anchors.adopt(anchors.key, anchors.values[new], state.arrays.content_capacity)
    ids = state.arrays.ids
    if int(ids[IDS_CONTENTS]) != len(state.tokens) or int(ids[IDS_OCCUPANTS]) != state.occupants:
        raise AssertionError("bulk build: ids not handed out fresh and in order")
    new = flags & F_NEW_CLAIM != 0
    counts = np.bincount(ns[new])
    for space in np.flatnonzero(counts).tolist():
        state.namespaces.claims[space] += int(counts[space])
    state.claims += int(np.count_nonzero(new))
