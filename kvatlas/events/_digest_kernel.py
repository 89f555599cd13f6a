"""The compiled step of :func:`kvatlas.events.inventory.xor_elements`: each chunk hash's
element XORed into its bucket, in one call that holds the GIL.

numpy's ``ufunc.at`` (what the step was) releases the GIL on every call, whatever its size:
a release per batch of a few new chunks wakes a waiting thread each time and starves it
(docs/performance.md, "Directory: design figures"). This loop is as fast and never releases it.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np


@numba.njit(cache=True, boundscheck=False)
def xor_into(digest: Any, raw: Any, multiplier: Any, kept: Any) -> None:
    """``digest[h[0]] ^= first 8 bytes of h (little-endian) × multiplier mod 2^64`` for each
    32-byte hash ``h`` of ``raw`` (``uint8``), where ``kept[h[0]]`` (``uint8``, 256 flags, or
    one flag ``1`` for every bucket)."""
    every = kept.shape[0] == 1
    m = np.uint64(multiplier)
    for at in range(0, raw.shape[0] - 31, 32):
        b = raw[at]
        if every or kept[b]:
            first = np.uint64(0)
            for k in range(7, -1, -1):
                first = (first << np.uint64(8)) | np.uint64(raw[at + k])
            digest[b] ^= first * m
