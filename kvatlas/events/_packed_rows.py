"""The compiled step of :func:`kvatlas.events.msgpack_codec.decode_msgpack_columns`: where each
entry's token ids lie in the batch's arena (its contents joined), in one call.

A batch's checks and offsets as numpy steps (the contents' lengths modulo 4, the references'
range, two appends, a cumulative sum, two gathers) cost ≈1–1.5 µs each however few the
entries: most of decoding a node's batch of one chunk. This loop does all of it in one call.

This module imports numba: ``msgpack_codec`` imports it on first use only, so that importing
``kvatlas.events`` (and every client) stays free of numba.
"""

from __future__ import annotations

from typing import Any

from kvatlas.kernel_twins import njit_without_nrt


@njit_without_nrt(cache=True, nogil=True, boundscheck=False)
def packed_rows(
    sizes: Any, refs: Any, firsts: Any, starts: Any, lengths: Any
) -> bool:  # pragma: no cover
    """``starts[j]``, ``lengths[j]``: where entry ``j``'s ids lie in the arena of contents
    of ``sizes`` bytes each (one after the other, 4 bytes an id), entry ``j`` reading content
    ``refs[j]`` (-1: none, then start 0 and length 0); ``firsts`` (one more than the
    contents) gets where each content starts. ``False`` (the outputs not all written) when a
    content is not whole ids or a reference names no content."""
    n = sizes.shape[0]
    firsts[0] = 0
    for c in range(n):
        size = sizes[c]
        if size % 4:
            return False
        firsts[c + 1] = firsts[c] + size // 4
    for j in range(refs.shape[0]):
        r = refs[j]
        if r < -1 or r >= n:
            return False
        if r < 0:
            starts[j] = 0
            lengths[j] = 0
        else:
            starts[j] = firsts[r]
            lengths[j] = firsts[r + 1] - firsts[r]
    return True
