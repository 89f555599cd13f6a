"""Chunk hashes by value: a column of 32-byte hashes in one buffer (a snapshot's), which reads
as a sequence of ``bytes`` one at a time and gives the index their addresses all at once, so a
restore's bulk build copies each hash from the column without a ``bytes`` object per chunk."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from kvatlas.directory.blend.kernels.layout import HASH_WIDTH

_ROW = np.dtype(f"V{HASH_WIDTH}")


class HashWords(Sequence[bytes]):
    """Hash ``i`` is bytes ``32 i .. 32 i + 32`` (``HASH_WIDTH``) of ``column`` (any buffer of
    32-byte rows, or a 1-D array of them); the buffer is kept, never copied (but by
    :meth:`take`, which gathers rows)."""

    __slots__ = ("_rows",)

    def __init__(self, column: Any) -> None:
        rows: npt.NDArray[Any] = (
            column if isinstance(column, np.ndarray) else np.frombuffer(column, np.uint8)
        )
        if rows.dtype != _ROW:
            if rows.ndim != 1 or rows.itemsize != 1 or len(rows) % HASH_WIDTH:
                raise ValueError(f"not a column of {HASH_WIDTH}-byte hashes")
            rows = np.ascontiguousarray(rows).view(_ROW)
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> HashWords: ...

    def __getitem__(self, i: int | slice) -> bytes | HashWords:
        if isinstance(i, slice):
            return HashWords(self._rows[i])
        return bytes(self._rows[i].tobytes())

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._rows.tolist())  # (each a ``bytes``, made by one C-level pass)

    def take(self, rows: npt.NDArray[np.intp] | Sequence[int]) -> HashWords:
        """The hashes of ``rows``, in that order (a copy of those rows)."""
        return HashWords(self._rows[np.asarray(rows, np.intp)])

    def addresses(self) -> npt.NDArray[np.int64]:
        """Where each hash's 32 bytes are (valid while this lives)."""
        rows = self._rows
        return rows.ctypes.data + rows.strides[0] * np.arange(len(rows), dtype=np.int64)
