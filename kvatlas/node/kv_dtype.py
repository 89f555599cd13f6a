"""KV cache dtypes: the one place where a dtype name meets numpy and torch.

A chunk's KV is float16, bfloat16 or float32. numpy has no bfloat16 of its own; ``ml_dtypes``
(a kvatlas dependency) gives it a real one, so a bf16 chunk is an ``ml_dtypes.bfloat16`` array
in every tier and on every wire (stored over HTTP, decoded from L2 or a peer reply,
re-RoPE'd), whether or not torch is installed. bf16 is never widened to float32: that would
double every byte budget and break bit-exact round trips.

Conversions share memory wherever they can. A CPU torch tensor becomes a numpy view of its
buffer (bf16 through its 16-bit patterns: torch's numpy bridge has no bfloat16); ``uint16`` bit
patterns declared ``"bfloat16"`` become a bfloat16 view. torch is never imported here just to
check a type: a tensor can only exist once torch is loaded. Nor is ``ml_dtypes`` imported before
a bfloat16 dtype is asked for: its import costs most of a second of CPU, which every process
start (a coordinator, a float16 node) would otherwise pay for nothing.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np

KV_DTYPES: Final = ("float16", "bfloat16", "float32")
"""The cache dtypes a chunk may hold."""

KV_ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4}


@functools.cache
def bfloat16() -> np.dtype[Any]:
    """``ml_dtypes.bfloat16`` as a numpy dtype (imports ``ml_dtypes`` on the first call)."""
    import ml_dtypes

    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


_NUMPY: Final[dict[str, np.dtype[Any]]] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of cache dtype ``name`` (bfloat16: ``ml_dtypes.bfloat16``)."""
    found = _NUMPY.get(name)
    if found is not None:
        return found
    if name == "bfloat16":
        return bfloat16()
    raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {name!r}")


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of cache dtype ``name`` (imports torch: call only when it is wanted)."""
    import torch

    numpy_dtype(name)  # validates the name
    return getattr(torch, name)


def is_torch(x: object) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch (an optional dependency)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "element_size")


def dtype_name(kv: Any) -> str:
    """The dtype name of a numpy array or a torch tensor; ``"bfloat16"`` for both kinds of bf16."""
    if is_torch(kv):
        return str(kv.dtype).removeprefix("torch.")
    if isinstance(kv, np.ndarray):
        return str(kv.dtype.name)
    raise TypeError(f"kv must be a numpy array or a torch tensor, got {type(kv).__name__}")


def resolve(kv: Any, declared: str = "") -> tuple[Any, str]:
    """``kv`` as an array whose dtype is its cache dtype, and that dtype's name.

    ``declared`` is checked against the array's dtype; it only changes anything for numpy
    ``uint16`` bit patterns declared ``"bfloat16"``, which become a bfloat16 view (no copy).
    Torch tensors are returned as they are (an engine's tensor may live on a GPU).
    """
    name = dtype_name(kv)
    if name == "uint16" and declared == "bfloat16" and isinstance(kv, np.ndarray):
        kv, name = kv.view(bfloat16()), "bfloat16"
    if name not in KV_DTYPES:
        hint = " (raw bf16 bit patterns need kv_dtype='bfloat16')" if name == "uint16" else ""
        raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {name}{hint}")
    if declared and declared != name:
        raise ValueError(f"kv_dtype={declared!r} does not match the array's dtype {name}")
    return kv, name


def to_numpy(kv: Any) -> np.ndarray[Any, Any]:
    """``kv`` (array-like or torch tensor) as a numpy array of the same dtype.

    A contiguous CPU tensor is viewed, not copied; any other tensor is copied to the CPU once
    (contiguous). A torch bf16 tensor becomes an ``ml_dtypes.bfloat16`` array.
    """
    if not is_torch(kv):
        return np.asarray(kv)
    import torch

    t = kv.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return np.asarray(t.view(torch.int16).numpy()).view(bfloat16())
    return np.asarray(t.numpy())


def to_torch(arr: np.ndarray[Any, Any]) -> Any:
    """A numpy KV array as a CPU torch tensor of the same dtype, sharing its memory.

    Imports torch. A read-only array (a decoded chunk) is copied first: torch tensors are
    always writable, and stored KV must never change.
    """
    import torch

    if not arr.flags.writeable:
        arr = arr.copy()
    if arr.dtype == bfloat16():
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
