"""Token-id validation and packing shared by every key scheme.

Token ids cross int32, int64 and uint32 channels between engines; a key must never depend on
which one delivered them, so everything is normalised to uint32 after a range check (an id
outside ``[0, 2**32)`` is an error, never a silent wrap-around).
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import numpy.typing as npt

from kvatlas.checks import bool_position, is_plain_int

TOKEN_LIMIT = 1 << 32

TokenArray = npt.NDArray[np.uint32]
_UINT32_ARRAY_CODE = next((code for code in "IL" if array(code).itemsize == 4), "")


def _torch_to_numpy(tokens: Any) -> Any:
    """Torch tensors are accepted without importing torch (it is an optional dependency)."""
    module = type(tokens).__module__
    if module.startswith("torch") and hasattr(tokens, "detach"):
        return tokens.detach().cpu().numpy()
    return tokens


def _from_python_ints(arr: npt.NDArray[np.object_]) -> npt.NDArray[np.int64]:
    """Mixed or huge Python ints arrive as an object array: check each one, then convert."""
    for t in arr.ravel():
        if not (is_plain_int(t) or isinstance(t, np.integer)):
            raise ValueError(f"token ids must be integers, got {t!r:.40}")
        if not 0 <= int(t) < TOKEN_LIMIT:
            raise ValueError(f"token id {t} is outside [0, 2**32)")
    return arr.astype(np.int64)


def _refuse_bools(tokens: Any, ids: npt.NDArray[Any]) -> None:
    """A bool is an int to Python, never a token id: refused as a numpy bool array is."""
    at = bool_position(tokens, ids)
    if at is not None:
        raise ValueError(f"token ids must be integers, got {tokens[at]!r} at position {at}")


def as_token_array(tokens: Any) -> TokenArray:
    """Return ``tokens`` as a 1-D ``uint32`` array, or raise ``ValueError`` naming the bad id.

    Accepts lists/tuples of ints, numpy integer arrays and torch tensors. A uint32 numpy input
    is returned as is (no copy).
    """
    tokens = _torch_to_numpy(tokens)
    is_sequence = isinstance(tokens, (list, tuple))
    if is_sequence and _UINT32_ARRAY_CODE:
        try:  # array('I') range-checks every element in C, faster than np.asarray(list)
            ids = np.frombuffer(array(_UINT32_ARRAY_CODE, tokens), dtype=np.uint32)
        except (OverflowError, TypeError):
            pass  # fall through for a precise error message
        else:
            _refuse_bools(tokens, ids)  # array('I') takes True as 1
            return ids
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.dtype == object:
        arr = _from_python_ints(arr)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if is_sequence and arr.dtype.kind in "iu":
        _refuse_bools(tokens, arr)  # numpy takes np.True_ among ints as 1
    if arr.dtype == np.uint32:
        return arr
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if arr.size == 0:
            return np.empty(0, dtype=np.uint32)
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= TOKEN_LIMIT:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside [0, 2**32)")
    return arr.astype(np.uint32)


def tokens_be_bytes(tokens: TokenArray) -> bytes:
    """Pack validated tokens as unsigned 32-bit big-endian, the hashing wire format."""
    return tokens.astype(">u4", copy=False).tobytes()
