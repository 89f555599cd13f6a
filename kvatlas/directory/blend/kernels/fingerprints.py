"""A content's ids read from its stored form, and its fingerprint taken there.

The write kernel fingerprints each content an op names (``writes.py``); a snapshot writer
fingerprints the contents it saves (the column a restore takes instead of reading and hashing
every id again: docs/directory.md, "Snapshots"). Both take each fingerprint from the stored
form (:func:`stored_fingerprint`: the polynomial of the ids, whatever their form,
``tests/directory/test_blend_kernels.py``); the write kernel reads the ids into a row
(:func:`load_ids`) only to compare them with a content of the same fingerprint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend.kernels.layout import ADDRESS_BITS, TOKENS_PLANES, TOKENS_U16
from kvatlas.directory.blend.kernels.modhash import (
    fingerprint_at,
    fold,
    mul_lazy,
    power_table,
    weighted_sum,
    weights_sum,
)
from kvatlas.directory.blend.kernels.planes import HEADER, plane_bytes, planes_load
from kvatlas.directory.blend.kernels.pointers import (
    helper,
    i64_ptr,
    inline,
    jit,
    u8_ptr,
    u16_ptr,
    u32_ptr,
)
from kvatlas.kernel_twins import gil_twins, releasing_twin


@inline
def tagged(addr: Any, token_bytes: Any) -> Any:
    """A content's token address with the tag of its form (``layout.py``; ``token_bytes``:
    2 for ``uint16``, 1 for the planes form, 4 for ``uint32``)."""
    if token_bytes == 2:
        return addr | TOKENS_U16
    if token_bytes == 1:
        return addr | TOKENS_PLANES
    return addr


@inline
def load_ids(row: Any, addr: Any, chunk: Any) -> None:
    """``row[:chunk]`` (``uint32``) = the ids at the tagged token address ``addr``."""
    if addr & TOKENS_U16:
        _load(row, u16_ptr(addr & ADDRESS_BITS), chunk)  # type: ignore[call-arg]
    elif addr & TOKENS_PLANES:
        planes_load(row, addr & ADDRESS_BITS, chunk)
    else:
        _load(row, u32_ptr(addr), chunk)  # type: ignore[call-arg]


@jit
def _load(out: Any, p: Any, chunk: Any) -> None:
    """``out[:chunk]`` = the ids at the typed pointer ``p`` (compiled once per width)."""
    for k in range(chunk):
        out[k] = p[k]


@helper
def stored_fingerprint(addr: Any, chunk: Any, weights: Any, fmask: Any) -> Any:
    """:func:`~kvatlas.directory.blend.kernels.modhash.fingerprint_at` of the ``chunk`` ids at
    the tagged token address ``addr``, read in their stored form (no copy into a row first).
    A planes-form id is its low half plus ``2^(16+p)`` for each plane ``p`` with its bit set,
    so the sum is the low halves' plus, per plane, ``2^(16+p)`` times the sum of the weights
    of the ids whose bit is set (each weight masked by its bit: no branch, SIMD)."""
    if addr & TOKENS_U16:
        return fingerprint_at(u16_ptr(addr & ADDRESS_BITS), 0, chunk, weights, fmask)  # type: ignore[call-arg]
    if not addr & TOKENS_PLANES:
        return fingerprint_at(u32_ptr(addr), 0, chunk, weights, fmask)  # type: ignore[call-arg]
    at = addr & ADDRESS_BITS
    h = np.int64(u8_ptr(at)[0])  # type: ignore[call-arg]
    total = weighted_sum(u16_ptr(at + HEADER), 0, chunk, weights)  # type: ignore[call-arg]
    planes: Any = u8_ptr(at + HEADER + 2 * chunk)  # type: ignore[call-arg]
    stride = plane_bytes(chunk)
    low, high = weights[0], weights[1]
    for p in range(h):
        row = p * stride
        lo = np.uint64(0)
        hi = np.uint64(0)
        for k in range(chunk):
            bit = (np.uint64(planes[row + (k >> 3)]) >> np.uint64(k & 7)) & np.uint64(1)
            lo += low[k] & (np.uint64(0) - bit)
            hi += high[k] & (np.uint64(0) - bit)
        total = fold(total + mul_lazy(weights_sum(lo, hi), np.uint64(1 << (16 + p))))
    return total & np.uint64(fmask)


@gil_twins()
def content_fingerprints(
    handles: Any, data_off: Any, token_bytes: Any, chunk: Any, base: Any, fmask: Any, out: Any
) -> None:
    """``out[i]`` = the fingerprint of the ``chunk`` ids of array ``i`` (``handles[i]``: its
    ``id``, the data pointer read at ``data_off``, or with ``data_off < 0`` the data address
    itself; ``token_bytes[i]``: its form, as :func:`tagged` takes it)."""
    powers = np.empty((2, chunk), np.uint64)
    power_table(base, chunk, powers)
    for i in range(handles.shape[0]):
        addr = handles[i]
        if data_off >= 0:
            addr = i64_ptr(addr + data_off)[0]  # type: ignore[call-arg]
        out[i] = stored_fingerprint(tagged(addr, token_bytes[i]), chunk, powers, fmask)


RELEASE_CONTENTS = 1024
"""Calls of at least this many contents (≈0.25 ms) release the GIL (``kernel_twins.py``)."""

content_fingerprints_releasing = releasing_twin(content_fingerprints)
""":func:`content_fingerprints`, the GIL released for the call."""
