"""Kernels only ``kvatlas bench blend`` uses: the rolling fingerprint alone over a query, on
the same SIMD lanes as the blend scan (``directory/blend/kernels``), as the floor a match's
latency is measured against."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvatlas.directory.blend import kernels


@kernels.jit
def _lane_roll(qt: Any, h: Any, blk: Any, chunk: Any, b: Any, b_pow: Any, out: Any) -> None:
    """out[i, j] = fingerprint of the window starting at lane j's origin + i."""
    for i in range(blk):
        kernels.lane_step(h, out[i], qt[i + chunk], qt[i], b, b_pow)


@kernels.jit
def window_fingerprints(
    q: Any, start: Any, n: Any, chunk: Any, base: Any, base_pow: Any, qt: Any, out: Any
) -> Any:
    """Unmasked fingerprints of the ``n`` windows starting at ``start``, as a (blk, LANES)
    view of ``out``: window ``start + j * blk + i`` is at ``[i, j]`` (entries past ``n`` are
    junk). ``qt`` and ``out`` are caller-owned scratch (see :func:`scratch_shapes`)."""
    blk = (n + kernels.LANES - 1) // kernels.LANES
    rows = blk + chunk
    if qt.shape[0] < rows or out.shape[0] < blk or qt.shape[1] != kernels.LANES:
        raise ValueError("scratch buffers too small (see scratch_shapes)")
    qv = kernels.lane_load(q, start, blk, rows, qt)
    b = np.uint64(base)
    h = kernels.lane_init(qv, chunk, b)
    ov = out[:blk]
    _lane_roll(qv, h, blk, chunk, b, np.uint64(base_pow), ov)
    return ov


def scratch_shapes(windows: int, chunk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the (qt, out) scratch for up to ``windows`` windows."""
    lanes = kernels.LANES
    blk = (windows + lanes - 1) // lanes
    return (blk + chunk, lanes), (blk, lanes)


@kernels.jit
def rolling_floor(q: Any, chunk: Any, base: Any, base_pow: Any, qt: Any, fps_buf: Any) -> Any:
    """The floor the scan is measured against: the rolling fingerprint alone over the query
    (same SIMD lanes as the scan), folded to one value so nothing is optimised away."""
    n = q.shape[0] - chunk + 1
    if n <= 0:
        return 0
    fps = window_fingerprints(q, 0, n, chunk, base, base_pow, qt, fps_buf)
    acc = np.uint64(0)
    for i in range(fps.shape[0]):
        for j in range(kernels.LANES):
            acc ^= fps[i, j]
    return np.int64(acc & np.uint64(0x7FFFFFFFFFFFFFFF))
