"""re-RoPE: move a cached chunk's K from its stored positions to its positions in a new request.

A chunk stored at ``old_st`` and reused at ``cur_st`` (CacheBlend-style non-prefix reuse) has
K rotated for positions ``old_st + i``; attention at the new place needs ``cur_st + i``. RoPE
rotates each dim pair ``j`` of token ``i`` by ``pos * inv_freq[j]``, and rotations compose by
adding angles, so the fix is one rotation by ``Δ = cur_st - old_st`` -- the *same* angle for
every token of the chunk. That makes cos/sin a single vector of ``rotary_dim / 2`` values per
chunk, and the whole update one fused multiply over K.

Why one rotation in fp32, not "undo old, then apply new" in the cache dtype: every cast back to
fp16/bf16 adds a rounding error of up to half an ulp, and the two-step form casts twice (once
at the intermediate "position 0" K). Rotating once in fp32 and casting back once keeps the
re-RoPE'd K one rounding away from the exact value; in bf16 (8 mantissa bits) the saved
rounding is measurable (tests/node/test_rope.py pins it).

Why K only: V carries no position (RoPE is applied to Q and K, never to V), so V is copied
through untouched, bit for bit. Dims past ``rotary_dim`` (partial rotary) are position-free
for the same reason and are likewise left untouched.

Why the angles are computed in float64: ``Δ * inv_freq[0] = Δ`` radians, and |Δ| reaches
1e5..1e6 in long contexts, where the float32 spacing is 0.008..0.06 rad -- a K error larger
than fp16's own rounding. In float64 the angle is exact to ~1e-10 rad; cos/sin are then cast
to fp32 (values in [-1, 1], error ~6e-8). The cost is one length-``rotary_dim/2`` vector per
chunk.

Arrays: numpy by default -- bf16 included, as ``ml_dtypes.bfloat16`` arrays, so re-RoPE needs
no torch: K is widened to fp32, rotated and cast back to bf16 once, the same arithmetic as the
torch path. torch tensors are detected by type (torch is never imported here -- if a tensor
exists, torch is already loaded) and rotated with the same code on their device.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from kvatlas.node.kv_dtype import dtype_name
from kvatlas.node.kv_layout import KVLayout

KVArray: TypeAlias = Any
"""A chunk's KV: ``numpy.ndarray`` or ``torch.Tensor`` shaped ``KVLayout.shape`` (axis 2,
tokens, may be shorter than ``chunk_size`` for the last, partial chunk of a sequence)."""

_Backend: TypeAlias = Literal["numpy", "torch"]


def _backend_of(x: object) -> _Backend:
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    raise TypeError(f"KV must be a numpy.ndarray or torch.Tensor, got {type(x).__name__}")


def _check_chunk(kv: KVArray, layout: KVLayout, what: str = "kv") -> None:
    shape = tuple(kv.shape)
    L, two, C, H, D = layout.shape
    if (
        len(shape) != 5
        or shape[0] != L
        or shape[1] != two
        or shape[3] != H
        or shape[4] != D
        or not 1 <= shape[2] <= C
    ):
        raise ValueError(
            f"{what} shape {shape} does not fit layout {layout.shape} "
            f"([num_layers, 2 (K,V), tokens <= chunk_size, num_kv_heads, head_dim])"
        )
    dtype = dtype_name(kv)
    if dtype != layout.dtype:
        # A mismatch means the bytes are being read under the wrong layout: refuse, since the
        # rotation would "work" and hand the engine garbage.
        raise TypeError(f"{what} dtype {dtype} does not match layout dtype {layout.dtype}")


def _position(name: str, value: int) -> int:
    try:
        pos = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int position, got {value!r}") from None
    if pos < 0:
        # token_offset -1 means "unknown": a wrong position is wrong KV, so never guess.
        raise ValueError(f"{name} must be a known position >= 0, got {pos}")
    return pos


def rope_cos_sin(
    layout: KVLayout, deltas: int | Sequence[int] | npt.NDArray[np.integer[Any]]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """cos/sin of ``Δ * inv_freq`` for one Δ (shape ``[rotary_dim/2]``) or many (``[n, r/2]``).

    Angles in float64 (exact for any realistic |Δ|), results cast to float32 once.
    """
    d = np.asarray(deltas, dtype=np.int64).astype(np.float64)
    angles = d[..., None] * layout.inv_freq()
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate_into(dst: KVArray, src32: KVArray, cos: KVArray, sin: KVArray, style: str) -> None:
    """``dst[..., :r] = rotate(src32)``; both ``[..., r]``, cos/sin ``[r/2]`` (fp32).

    Pairs are rotated as ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``. Both outputs are
    computed before anything is written, so ``src32`` may alias ``dst`` (in-place fp32 cache).
    The write casts fp32 -> cache dtype: the single rounding of the whole operation.
    """
    if style == "neox":
        h = src32.shape[-1] // 2
        x1, x2 = src32[..., :h], src32[..., h:]
        lo, hi = (Ellipsis, slice(None, h)), (Ellipsis, slice(h, None))
    else:  # gptj: interleaved pairs (2j, 2j + 1)
        x1, x2 = src32[..., 0::2], src32[..., 1::2]
        lo, hi = (Ellipsis, slice(0, None, 2)), (Ellipsis, slice(1, None, 2))
    o1 = x1 * cos
    o1 -= x2 * sin
    o2 = x2 * cos
    o2 += x1 * sin
    dst[lo] = o1
    dst[hi] = o2


def _apply(
    kv: KVArray,
    layout: KVLayout,
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    out: KVArray | None,
    backend: _Backend,
) -> KVArray:
    r = layout.rope_dim
    if out is None:
        out = np.empty_like(kv) if backend == "numpy" else kv.new_empty(kv.shape)
    if out is not kv:
        # Only what the rotation does not overwrite: V and the position-free tail of K.
        out[:, 1] = kv[:, 1]
        if r < layout.head_dim:
            out[:, 0, :, :, r:] = kv[:, 0, :, :, r:]
    k_rot = kv[:, 0, :, :, :r]
    if backend == "numpy":
        src32: KVArray = k_rot.astype(np.float32, copy=False)
        cos_b: KVArray = cos
        sin_b: KVArray = sin
    else:
        torch = sys.modules["torch"]
        src32 = k_rot.to(torch.float32)
        cos_b = torch.from_numpy(cos).to(kv.device)
        sin_b = torch.from_numpy(sin).to(kv.device)
    _rotate_into(out[:, 0, :, :, :r], src32, cos_b, sin_b, layout.rope_style)
    return out


def _copy_into(out: KVArray, kv: KVArray, backend: _Backend) -> None:
    if backend == "numpy":
        np.copyto(out, kv)
    else:
        out.copy_(kv)


def rerope_k(
    kv: KVArray,
    layout: KVLayout,
    old_st: int,
    cur_st: int,
    *,
    out: KVArray | None = None,
) -> KVArray:
    """Return ``kv`` with K moved from positions ``old_st + i`` to ``cur_st + i``.

    One rotation by ``Δ = cur_st - old_st`` in fp32, cast back to the cache dtype once (see the
    module docstring). V and K dims past ``rotary_dim`` are copied bit for bit.

    Never mutates ``kv`` unless asked: chunks come straight out of L1, shared by every request
    that reuses them, so rotating them in place would corrupt the cache.

    - ``out=None``: the result is a new array -- except when ``Δ == 0``, where ``kv`` itself is
      returned (no work, no copy; treat the result as read-only, like the cached chunk).
    - ``out=buf`` (same shape/dtype/backend as ``kv``, not overlapping it): writes the result
      into ``buf`` (e.g. the request's assembled KV) and returns it; ``Δ == 0`` is a plain copy.
    - ``out=kv``: in place.

    Raises ``ValueError``/``TypeError`` for a shape/dtype that does not fit ``layout`` and for
    negative (unknown) positions.
    """
    old = _position("old_st", old_st)
    cur = _position("cur_st", cur_st)
    backend = _backend_of(kv)
    _check_chunk(kv, layout)
    if out is not None and out is not kv:
        if _backend_of(out) != backend:
            raise TypeError("out must be the same array type as kv")
        _check_chunk(out, layout, "out")
        if tuple(out.shape) != tuple(kv.shape):
            raise ValueError(f"out shape {tuple(out.shape)} != kv shape {tuple(kv.shape)}")
        if backend == "torch" and out.device != kv.device:
            raise ValueError(f"out is on {out.device}, kv on {kv.device}")
    delta = cur - old
    if delta == 0:
        if out is None or out is kv:
            return kv
        _copy_into(out, kv, backend)
        return out
    cos, sin = rope_cos_sin(layout, delta)
    return _apply(kv, layout, cos, sin, out, backend)


def rerope_chunks(
    chunks: Sequence[KVArray],
    layout: KVLayout,
    deltas: Sequence[int],
    *,
    in_place: bool = False,
) -> list[KVArray]:
    """re-RoPE several chunks, each by its own ``Δ = cur_st - old_st`` (same rules as
    :func:`rerope_k`; chunks may mix numpy and torch).

    All cos/sin rows are computed in one vectorised float64 pass. Chunks with ``Δ == 0`` are
    skipped and returned as the same object. ``in_place=True`` rotates each chunk in its own
    buffer (only for chunks the caller owns, never for chunks still held by L1).
    """
    if len(chunks) != len(deltas):
        raise ValueError(f"{len(chunks)} chunks but {len(deltas)} deltas")
    ds = []
    for i, d in enumerate(deltas):
        try:
            ds.append(operator.index(d))
        except TypeError:
            raise TypeError(f"deltas[{i}] must be an int, got {d!r}") from None
    backends = [_backend_of(kv) for kv in chunks]
    for i, kv in enumerate(chunks):
        _check_chunk(kv, layout, f"chunks[{i}]")
    moving = [i for i, d in enumerate(ds) if d != 0]
    results: list[KVArray] = list(chunks)
    if not moving:
        return results
    cos_all, sin_all = rope_cos_sin(layout, [ds[i] for i in moving])
    for row, i in enumerate(moving):
        kv = chunks[i]
        out = kv if in_place else None
        results[i] = _apply(kv, layout, cos_all[row], sin_all[row], out, backends[i])
    return results
