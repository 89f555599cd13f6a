"""Write multimodal identities into placeholder spans before hashing.

Engines emit the same placeholder token ids for every image, so keys from raw token ids let
"text A + image 1" hit the KV of "text A + image 2". Offsets are **absolute in the full
prompt**: substituting into a suffix or middle slice silently writes the wrong positions. A
1-D numpy or torch view that starts inside a larger 1-D buffer is therefore refused unless the
caller says where it starts (``base_offset``); lists cannot be checked, which is why engines go
through :class:`~kvatlas.keys.tracker.RequestTracker`, which always passes the full prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvatlas.checks import is_plain_int
from kvatlas.keys.mm_values import mm_hash_values

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PlaceholderSpan:
    """``[offset, offset + length)`` in absolute prompt positions."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        for name in ("offset", "length"):
            value = getattr(self, name)
            if not is_plain_int(value) or value < 0:
                raise ValueError(f"placeholder {name} must be an integer >= 0, got {value!r}")

    @property
    def end(self) -> int:
        return self.offset + self.length


def as_span(position: Any) -> PlaceholderSpan:
    """Accept the engines' shapes: objects with ``offset``/``length``, mappings, or pairs."""
    if isinstance(position, PlaceholderSpan):
        return position
    if isinstance(position, Mapping):
        if "offset" not in position or "length" not in position:
            raise ValueError(f"placeholder position needs 'offset' and 'length': {position!r:.80}")
        return PlaceholderSpan(_as_int(position["offset"]), _as_int(position["length"]))
    if hasattr(position, "offset") and hasattr(position, "length"):
        return PlaceholderSpan(_as_int(position.offset), _as_int(position.length))
    if isinstance(position, Sequence) and len(position) == 2:
        return PlaceholderSpan(_as_int(position[0]), _as_int(position[1]))
    raise ValueError(f"cannot read a placeholder span (offset, length) from {position!r:.80}")


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy / torch scalar
        item = value.item()
        if is_plain_int(item):  # (not a float's or a bool's item)
            return item
    raise ValueError(f"expected an integer, got {value!r:.80}")


def _view_start(token_ids: Any) -> int:
    """Element offset of a 1-D view inside its 1-D base buffer (0 when not detectably a slice)."""
    if isinstance(token_ids, np.ndarray):
        base = token_ids.base
        if isinstance(base, np.ndarray) and base.ndim == 1 and base.dtype == token_ids.dtype:
            start = token_ids.__array_interface__["data"][0]
            origin = base.__array_interface__["data"][0]
            return int(start - origin) // token_ids.itemsize
        return 0
    base = getattr(token_ids, "_base", None)  # torch view
    if base is not None and getattr(base, "dim", lambda: 0)() == 1:
        return int(token_ids.storage_offset() - base.storage_offset())
    return 0


def _is_torch_tensor(token_ids: object) -> bool:
    """Without importing torch (an optional dependency)."""
    return type(token_ids).__module__.startswith("torch") and hasattr(token_ids, "dtype")


def _base_offset(base_offset: object) -> int:
    if base_offset is None:
        return 0
    try:
        start = _as_int(base_offset)
    except ValueError:
        raise ValueError(f"base_offset must be an integer >= 0, got {base_offset!r:.80}") from None
    if start < 0:
        raise ValueError(f"base_offset must be >= 0, got {start}")
    return start


def _check_writable_dtype(dtype: Any) -> None:
    np_dtype = np.dtype(str(dtype).removeprefix("torch."))
    if not np.issubdtype(np_dtype, np.integer) or np.iinfo(np_dtype).max < (1 << 31) - 1:
        raise ValueError(f"token ids of dtype {dtype} cannot hold 31-bit identity values")


def apply_mm_hashes_to_token_ids(
    token_ids: T,
    mm_hashes: Sequence[object],
    mm_positions: Sequence[Any],
    *,
    base_offset: int | None = None,
) -> T:
    """Substitute each item's identity values into its span of ``token_ids``, in place.

    ``token_ids`` is the full prompt or a prefix of it (list, numpy array or torch tensor). A
    span running past the end is truncated; one starting at or past the end is skipped.
    Hashes and positions pair in order; extras on either side are ignored. Pass
    ``base_offset=k`` only when ``token_ids`` deliberately starts at absolute position ``k``.
    """
    is_list = isinstance(token_ids, list)
    if not (is_list or isinstance(token_ids, np.ndarray) or _is_torch_tensor(token_ids)):
        raise ValueError(
            "token_ids must be a list, a numpy array or a torch tensor (the values are written "
            f"in place), got {type(token_ids).__name__}"
        )
    if not is_list:
        _check_writable_dtype(getattr(token_ids, "dtype", None))
        detected = _view_start(token_ids)
        if base_offset is None and detected:
            raise ValueError(
                f"token_ids is a slice starting at element {detected} of a larger buffer, but "
                "placeholder offsets are absolute in the full prompt: pass the full prompt "
                "(or base_offset= if the slice is intended)"
            )
    start = _base_offset(base_offset)
    n = len(token_ids)  # type: ignore[arg-type]
    for identifier, position in zip(mm_hashes, mm_positions, strict=False):
        span = as_span(position)
        lo = span.offset - start
        hi = min(span.end - start, n)
        if lo < 0:
            raise ValueError(f"placeholder span at {span.offset} begins before base_offset {start}")
        if lo >= hi:
            continue
        values = mm_hash_values(identifier, span.length)[: hi - lo]
        _write(token_ids, lo, hi, values)
    return token_ids


def _write(token_ids: Any, lo: int, hi: int, values: np.ndarray[Any, Any]) -> None:
    if isinstance(token_ids, list):
        token_ids[lo:hi] = values.tolist()
    elif isinstance(token_ids, np.ndarray):
        token_ids[lo:hi] = values
    else:  # torch tensor: imported lazily, torch is optional
        import torch

        token_ids[lo:hi] = torch.from_numpy(values.astype(np.int64)).to(token_ids.dtype)
