"""The index's state as the kernels see it: plain numpy arrays, grouped in :class:`BlendArrays`.

The arrays are owned by the index and read or written by the kernels only while the caller
holds the index lock.

- contents: ``c_fp`` (uint64 fingerprint), ``c_addr`` (address of the ids of the content
  (``contents.py``) or read-only token array the index keeps alive, with :data:`TOKENS_U16` set when the array is
  ``uint16`` (every id below 2^16, see ``directory/token_store.py``), :data:`TOKENS_PLANES`
  when it is in the planes form (``planes.py``), neither for ``uint32``; 0 = free id),
  ``c_first`` (first occupant, -1 = none).
- ``table``: the content table (see ``table.py``), a power of two of slots sized by the live
  contents (load <= 1/2), independent of the content capacity: content ids are its values.
- occupants (one chunk_hash stored with one content): ``o_i64[o] = (token_offset, the
  chunk_hash's bytes)``, the bytes by value in the :data:`HASH_WIDTH` bytes of the row from
  column ``O_HASH`` on (zero-padded; copied in by the kernel that links the occupant, so no
  caller's ``bytes`` is referenced after a write), ``o_hlen`` (hash length), ``o_i32[o] =
  (next occupant of the content, inline first claim or -1, number of claims)``: one row per
  occupant, so the namespace test reads one cache line, and a hit's offset and hash another.
- ``claims``: the extra-claim set (see ``table.py``), load <= 1/2.
- ``ids``: the id allocator (``IDS_*``): ids are dense, freed ones are reused (last freed
  first) and a free id's ``c_first`` / ``O_NEXT`` links it to the next free one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvatlas.c_heap import mapped_empty, mapped_resized

TOKENS_U16 = 1 << 62
"""Tag bit of a token address (``c_addr``): the array is ``uint16``. User-space addresses stay
far below 2^62, so the tag never collides with an address bit."""
TOKENS_PLANES = 1 << 61
"""Tag bit of a token address: the array is in the planes form (``planes.py``)."""
ADDRESS_BITS = TOKENS_PLANES - 1
"""Mask that takes the tags off a token address."""

HASH_WIDTH = 32
"""Bytes of the longest chunk_hash the index takes (a blake3 digest: the directory's keys)."""
O_OFF, O_HASH = 0, 1
"""Columns of ``o_i64``: the token offset, then the chunk_hash's bytes from ``O_HASH`` on."""
O_COLUMNS = O_HASH + HASH_WIDTH // 8
"""Columns of ``o_i64`` (int64 words): the offset and the hash's."""
O_NEXT, O_NS0, O_NCLAIMS = 0, 1, 2
"""Columns of ``o_i32``."""
IDS_FREE_CONTENT, IDS_CONTENTS, IDS_FREE_OCCUPANT, IDS_OCCUPANTS = 0, 1, 2, 3
"""Entries of ``ids``: head of the free content ids (-1 = none; linked through ``c_first``),
content ids ever used (the high-water mark); the same for occupants (linked through
``o_i32[:, O_NEXT]``)."""


(
    CTX_CHUNK,
    CTX_WEIGHTS,
    CTX_FMASK,
    CTX_ROW,
    CTX_OUT,
    CTX_BYTES_DATA,
    CTX_BYTES_SIZE,
    CTX_ARRAY_DATA,
    CTX_LIST_ITEMS,
    CTX_TOKEN_LIST,
    CTX_ARRAYS,
) = range(11)
"""Entries of a write context (:func:`write_context`): the write kernel's scalar arguments
(the weights as the address of their ``(2, chunk)`` table), the addresses of a single
write's scratch (a row of ``chunk`` ``uint32`` ids, a report row of 4 ``int64``), the
CPython offsets a single write reads its objects through (a ``bytes``' payload and length, an
ndarray's data pointer, a list's item pointer; -1 if not located: ``_cpython.py``), the ``id``
of the index's list of contents (whose item at an op's content id its caller then settles),
then from ``CTX_ARRAYS`` on, per field of :class:`BlendArrays` in order, its data
address and its number of rows."""


class BlendArrays(NamedTuple):
    """The arrays by name. Kernel entry points take them as a plain ``tuple(arrays)`` and
    name them again inside (``BlendArrays(*arrays)``): numba types a plain tuple argument in
    a fraction of the time a named one takes, a cost paid on every call."""

    table: npt.NDArray[np.int32]
    c_fp: npt.NDArray[np.uint64]
    c_addr: npt.NDArray[np.int64]
    c_first: npt.NDArray[np.int32]
    o_i64: npt.NDArray[np.int64]
    o_i32: npt.NDArray[np.int32]
    o_hlen: npt.NDArray[np.uint8]
    claims: npt.NDArray[np.int64]
    ids: npt.NDArray[np.int64]

    @classmethod
    def empty(cls, capacity: int) -> BlendArrays:
        """Room for ``capacity`` contents and occupants (a power of two >= 8)."""
        return cls(
            table=_table(2 * capacity),
            c_fp=np.zeros(capacity, np.uint64),
            c_addr=np.zeros(capacity, np.int64),
            c_first=np.full(capacity, -1, np.int32),
            o_i64=np.zeros((capacity, O_COLUMNS), np.int64),
            o_i32=np.zeros((capacity, 3), np.int32),  # rows are initialised on first use
            o_hlen=np.zeros(capacity, np.uint8),
            claims=np.full(16, -1, np.int64),
            ids=np.array([-1, 0, -1, 0], np.int64),
        )

    @property
    def content_capacity(self) -> int:
        return int(self.c_fp.shape[0])

    @property
    def occupant_capacity(self) -> int:
        return int(self.o_i64.shape[0])

    @property
    def table_slots(self) -> int:
        return int(self.table.shape[0])

    def with_empty_table(self, slots: int | None = None) -> BlendArrays:
        """A fresh (empty) table of ``slots`` slots (a power of two; default: as many as
        now): to be rebuilt."""
        return self._replace(table=_table(self.table_slots if slots is None else slots))

    def with_content_capacity(self, capacity: int) -> BlendArrays:
        """Content arrays grown to ``capacity`` (the table is unchanged: it holds content
        ids, not positions)."""
        return self._replace(
            c_fp=mapped_resized(self.c_fp, capacity, 0),
            c_addr=mapped_resized(self.c_addr, capacity, 0),
            c_first=mapped_resized(self.c_first, capacity, -1),
        )

    def with_occupant_capacity(self, capacity: int) -> BlendArrays:
        return self._replace(
            o_i64=mapped_resized(self.o_i64, capacity, 0),
            o_i32=mapped_resized(self.o_i32, capacity, 0),
            o_hlen=mapped_resized(self.o_hlen, capacity, 0),
        )


def write_context(
    arrays: BlendArrays,
    chunk: int,
    weights: npt.NDArray[np.uint64],
    fmask: int,
    scratch: tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64]],
    offsets: tuple[int, int, int, int],
    contents: int,
) -> npt.NDArray[np.int64]:
    """``arrays`` and the write kernel's other arguments (``weights``: the fingerprints'
    ``modhash.power_table``; ``scratch``: a row of ``chunk`` ids and a report row of 4;
    ``offsets``: a ``bytes``' payload and length, an ndarray's data pointer and a list's item
    pointer from the object's ``id``; ``contents``: the ``id`` of the list of contents) as
    one int64 array of addresses and sizes (``CTX_*``): a single write passes its address,
    one integer, where passing the arrays would cost numba an unboxing of each on every call
    (``writes.apply_op``). Valid while ``arrays``, ``weights``, ``scratch`` and the list live
    unchanged: the index makes a new one whenever it replaces them."""
    assert weights.flags.c_contiguous and weights.shape == (2, chunk)
    row, out = scratch
    assert row.flags.c_contiguous and row.shape == (chunk,) and row.dtype == np.uint32
    assert out.flags.c_contiguous and out.shape == (4,) and out.dtype == np.int64
    ctx = np.empty(CTX_ARRAYS + 2 * len(arrays), np.int64)
    scalars = chunk, weights.ctypes.data, fmask, row.ctypes.data, out.ctypes.data
    ctx[:CTX_ARRAYS] = *scalars, *offsets, contents
    for k, field in enumerate(BlendArrays._fields):
        arr: npt.NDArray[Any] = getattr(arrays, field)
        assert arr.flags.c_contiguous
        ctx[CTX_ARRAYS + 2 * k] = arr.ctypes.data
        ctx[CTX_ARRAYS + 2 * k + 1] = arr.shape[0]
    return ctx


def _table(slots: int) -> npt.NDArray[np.int32]:
    """An empty table of ``slots`` slots."""
    table = mapped_empty(slots, np.int32)
    table.fill(-1)
    return table
