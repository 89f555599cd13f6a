"""A tiny RoPE "model" whose KV has an exact ground truth at every position.

K and V of every layer depend only on the token and its position (RMSNorm → per-layer W_k, W_v
→ RoPE on K; no attention mixing), like layer 0 of a real RoPE model. So "a chunk stored at p,
re-RoPE'd to q" can be checked exactly against "the chunk computed fresh at q" — what the demo
and the end-to-end tests verify. RoPE here is written from scratch (complex multiply at absolute
positions, float64), independent of :mod:`kvatlas.node.rope`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.node.kv_layout import KVLayout

HIDDEN = 48
VOCAB = 512

F64 = npt.NDArray[np.float64]


def rope_at_positions(k: F64, positions: npt.NDArray[np.integer[Any]], layout: KVLayout) -> F64:
    """RoPE ``k`` ``[L, C, H, D]`` (float64) at absolute ``positions`` ``[C]``."""
    r = layout.rope_dim
    freqs = 1.0 / (layout.rope_theta ** (np.arange(0, r, 2) / r))
    phase = np.exp(1j * np.outer(positions.astype(np.float64), freqs))[None, :, None, :]
    out = k.copy()
    if layout.rope_style == "neox":
        z = (k[..., : r // 2] + 1j * k[..., r // 2 : r]) * phase
        out[..., : r // 2], out[..., r // 2 : r] = z.real, z.imag
    else:
        z = (k[..., 0:r:2] + 1j * k[..., 1:r:2]) * phase
        out[..., 0:r:2], out[..., 1:r:2] = z.real, z.imag
    return out


class ToyRopeModel:
    def __init__(self, layout: KVLayout, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n_layers, heads, dim = layout.num_layers, layout.num_kv_heads, layout.head_dim
        self.layout = layout
        self.embed = rng.standard_normal((VOCAB, HIDDEN))
        self.w_k = rng.standard_normal((n_layers, HIDDEN, heads * dim)) / np.sqrt(HIDDEN)
        self.w_v = rng.standard_normal((n_layers, HIDDEN, heads * dim)) / np.sqrt(HIDDEN)

    def _proj(self, tokens: npt.NDArray[Any], w: F64) -> F64:
        x = self.embed[np.asarray(tokens, dtype=np.int64) % VOCAB]
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        out: F64 = np.einsum("ch,lhd->lcd", x, w)
        return out.reshape(w.shape[0], len(tokens), self.layout.num_kv_heads, -1)

    def k_fresh(self, tokens: npt.NDArray[Any], start: int) -> F64:
        """float64 ``[L, C, H, D]`` K of ``tokens`` placed at ``start, start+1, ...``."""
        k = self._proj(tokens, self.w_k)
        return rope_at_positions(k, start + np.arange(len(tokens)), self.layout)

    def kv_chunk(self, tokens: npt.NDArray[Any], start: int, dtype: Any = None) -> npt.NDArray[Any]:
        """The chunk as a node stores it: ``[L, 2, C, H, D]`` in the cache dtype."""
        kv = np.stack([self.k_fresh(tokens, start), self._proj(tokens, self.w_v)], axis=1)
        return kv.astype(dtype or self.layout.numpy_dtype())

    def kv_chunks(self, tokens: npt.NDArray[Any]) -> list[npt.NDArray[Any]]:
        """KV of every full chunk of a sequence, each at its own position."""
        c = self.layout.chunk_size
        return [self.kv_chunk(tokens[i : i + c], i) for i in range(0, len(tokens) - c + 1, c)]
