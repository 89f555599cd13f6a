"""The shape and RoPE facts of one model's KV chunks.

A chunk's KV is one array ``[num_layers, 2 (K, V), chunk_size, num_kv_heads, head_dim]``. Storing
it is layout-agnostic, but *reusing* it at another position is not: re-RoPE must know how many
leading dims of each head are rotated (``rotary_dim``; models with partial rotary leave the rest
position-free), how the rotated dims are paired (``rope_style``) and the frequency base
(``rope_theta``). Getting any of these wrong does not fail loudly -- it silently yields K for the
wrong positions -- so they travel with the layout and are validated up front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvatlas.checks import is_plain_int
from kvatlas.keys import DEFAULT_CHUNK_SIZE
from kvatlas.node import kv_dtype
from kvatlas.node.kv_dtype import KV_DTYPES, KV_ITEMSIZE

ROPE_STYLES: Final = ("neox", "gptj")
"""``neox``: rotate-half (pairs ``(j, j + r/2)``); ``gptj``: interleaved (pairs ``(2j, 2j+1)``)."""


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; KVLayout(num_layers=True) is a bug, not a 1-layer model.
    if not is_plain_int(value) or value <= 0:
        raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape, cache dtype and RoPE convention of a model's KV chunks (one per model/TP rank).

    ``rotary_dim=None`` means full rotary (``rotary_dim == head_dim``); use :attr:`rope_dim`
    for the resolved value.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int = DEFAULT_CHUNK_SIZE
    dtype: str = "float16"
    rotary_dim: int | None = None
    rope_style: str = "neox"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size"):
            _check_positive_int(name, getattr(self, name))
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if self.rotary_dim is not None:
            _check_positive_int("rotary_dim", self.rotary_dim)
            # Both styles rotate *pairs* of dims, so an odd count has no meaning.
            if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ValueError(
                    f"KVLayout.rotary_dim must be even and <= head_dim={self.head_dim}, "
                    f"got {self.rotary_dim}"
                )
        elif self.head_dim % 2:
            raise ValueError(
                f"full rotary needs an even head_dim, got {self.head_dim}; set rotary_dim"
            )
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(
                f"KVLayout.rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}"
            )
        theta = self.rope_theta
        if (
            isinstance(theta, bool)
            or not isinstance(theta, int | float)
            or not math.isfinite(theta)
            or theta <= 1.0
        ):
            # theta <= 1 makes every frequency >= 1 rad/token: not a RoPE model, a typo.
            raise ValueError(f"KVLayout.rope_theta must be a finite number > 1, got {theta!r}")

    @property
    def rope_dim(self) -> int:
        """Leading dims of each head that are rotated (``rotary_dim``, default ``head_dim``)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, chunk_size, num_kv_heads, head_dim)``; axis 1 is (K, V)."""
        return (self.num_layers, 2, self.chunk_size, self.num_kv_heads, self.head_dim)

    def fits(self, shape: tuple[int, ...], dtype: str) -> bool:
        """Whether a chunk of KV ``shape`` and cache ``dtype`` is of this layout (else it is
        another layout's: never used by a node of this one)."""
        return tuple(shape) == self.shape and dtype == self.dtype

    @property
    def itemsize(self) -> int:
        return KV_ITEMSIZE[self.dtype]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk's KV (what L1/L2 byte budgets are charged)."""
        return math.prod(self.shape) * self.itemsize

    def inv_freq(self) -> npt.NDArray[np.float64]:
        """``theta ** (-2i / rotary_dim)`` for ``i < rotary_dim / 2``, in float64.

        float64 because re-RoPE multiplies these by position deltas up to ~1e6: in float32 the
        angle itself would already be off by ~ulp(1e6) = 0.06 rad (see ``rope.rope_cos_sin``).
        """
        r = self.rope_dim
        exponents = np.arange(0, r, 2, dtype=np.float64) / r
        return np.asarray(float(self.rope_theta) ** -exponents, dtype=np.float64)

    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of this layout's chunks (bfloat16: ``ml_dtypes.bfloat16``)."""
        return kv_dtype.numpy_dtype(self.dtype)

    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` of this layout's chunks (imports torch; only call when needed)."""
        return kv_dtype.torch_dtype(self.dtype)
