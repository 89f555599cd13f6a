"""Copies between vLLM's paged KV cache and the node's chunk layout, one layer at a time.

vLLM (0.33) hands a connector each attention layer's cache as a logical ``[B, H, N, C]`` view
(blocks, KV heads, tokens per block, and ``C`` = K dims + V dims of one cell), whatever its
physical strides; how K and V share a cell is the attention backend's choice
(``settings.KV_PACKINGS``). The node's chunk is ``[L, 2 (K, V), chunk, H, D]``. A token ``t``
of a request lives in block ``block_ids[t // N]`` at row ``t % N``: these functions move
exactly those rows, never a whole block, so a load cannot clobber rows it was not asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_NUMPY_OF_TORCH = {torch.float16: "float16", torch.float32: "float32", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The node's name for a torch KV dtype (``None``: a dtype no node holds, e.g. fp8)."""
    return _NUMPY_OF_TORCH.get(dtype)


def token_rows(
    block_ids: Sequence[int], block_size: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, rows)`` of tokens ``[start, end)``: where each sits in the paged cache."""
    positions = torch.arange(start, end)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return table[positions // block_size], positions % block_size


def kv_planes(page: torch.Tensor, packing: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a ``[B, H, N, C]`` layer view as two ``[B, H, N, D]`` views (writes through)."""
    if packing == "split_last":
        return page[..., :head_dim], page[..., head_dim:]
    blocks, heads, rows, _ = page.shape
    try:  # per (block, head): N rows of K, then N rows of V
        cells = page.view(blocks, heads, 2 * rows, head_dim)
    except RuntimeError as exc:
        raise ValueError(
            f"kv_packing split_tokens needs each (block, head) page contiguous; strides "
            f"{page.stride()} are not ({exc})"
        ) from None
    return cells[:, :, :rows], cells[:, :, rows:]


def gather_rows(
    page: torch.Tensor, packing: str, head_dim: int, blocks: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """``[2, T, H, D]``: K and V of the tokens at ``(blocks, rows)`` (a copy)."""
    k, v = kv_planes(page, packing, head_dim)
    return torch.stack([k[blocks, :, rows], v[blocks, :, rows]])


def scatter_rows(
    page: torch.Tensor, packing: str, head_dim: int, blocks: torch.Tensor, rows: torch.Tensor,
    kv: torch.Tensor,
) -> None:  # fmt: skip
    """Write ``kv`` ``[2, T, H, D]`` into the tokens at ``(blocks, rows)`` of ``page``."""
    k, v = kv_planes(page, packing, head_dim)
    k[blocks, :, rows] = kv[0].to(page.device, page.dtype)
    v[blocks, :, rows] = kv[1].to(page.device, page.dtype)


def to_numpy(t: torch.Tensor, numpy_dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A CPU tensor as a numpy array of the node's dtype, bit for bit (bf16 viewed, not cast)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype)
    return t.numpy()


def from_numpy(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """A node array (maybe read-only, maybe ``ml_dtypes.bfloat16``) as a torch tensor."""
    a = np.array(a, copy=True)  # replies are read-only views into the HTTP body
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
