"""Direct use of CPython object layouts on the blend index's hot paths, checked at import.

Why this exists: once the kernels are compiled, what a lookup or an ingest batch costs is the
Python work per hit and per op. These shortcuts remove most of it:

- ``bytes_address(h)``: the kernels read a chunk_hash through its ``bytes`` object's payload
  address, so the index keeps the caller's ``bytes`` by reference (no copy per occupant); a
  single write hands the kernel the object's ``id`` and the kernel reads its length at
  ``BYTES_SIZE_OFFSET`` (and a content's header, its ids' form) itself.
- ``array_handle`` / ``array_handles``: a write hands the kernel each token array's ``id``;
  the kernel reads the ndarray's data pointer itself at ``ARRAY_DATA_OFFSET`` instead of
  Python asking ``arr.ctypes.data`` per op.
- ``make_match`` / ``make_matches``: :class:`BlendMatch` values built by writing their slots
  directly, without the frozen-dataclass ``__init__`` (which dominates per-hit cost).

Guarantees: every offset is located on a live probe object at import and verified by reading
a known value back. Without the ``bytes`` offsets the index cannot work, so failing to locate
it raises ``RuntimeError`` at import; the ndarray offset falls back (data addresses computed
in Python). The fast construction is checked at import to produce a
value equal to ``BlendMatch(...)``, and refused loudly if ``BlendMatch`` stops being a plain
slotted dataclass (e.g. gains a ``__post_init__`` the shortcut would skip). Tested in
``tests/directory/test_blend_cpython.py``.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvatlas.keys import BlendMatch


def find_field(obj: object, holds: Callable[[int], bool]) -> int:
    """Offset from ``id(obj)`` of the first 8-byte field (offsets 8..56) whose value
    satisfies ``holds``; -1 if none does."""
    for off in range(8, 64, 8):
        if holds(ctypes.c_int64.from_address(id(obj) + off).value):
            return off
    return -1


def _bytes_data_offset() -> int:
    """Offset of a ``bytes`` object's payload from its ``id`` (the object header size)."""
    offsets = set()
    for probe in (b"kvatlas-blend-probe", bytes(range(32))):
        addr = ctypes.cast(ctypes.c_char_p(probe), ctypes.c_void_p).value
        if addr is None:  # pragma: no cover - not CPython
            raise RuntimeError("cannot locate the payload of bytes objects")
        off = addr - id(probe)
        if ctypes.string_at(id(probe) + off, len(probe)) != probe:  # pragma: no cover
            raise RuntimeError("cannot locate the payload of bytes objects")
        offsets.add(off)
    if len(offsets) != 1:  # pragma: no cover - not CPython
        raise RuntimeError("bytes payload offset is not constant")
    return offsets.pop()


def _array_data_offset() -> int:
    """Offset of an ndarray's ``data`` pointer field from its ``id`` (-1: not found)."""
    probe = np.zeros(4, np.uint32)
    return find_field(probe, lambda value: value == probe.ctypes.data)


def _bytes_size_offset() -> int:
    """Offset of a ``bytes`` object's length (``ob_size``) from its ``id``."""
    offsets = {find_field(probe, len(probe).__eq__) for probe in (b"x" * 37, bytes(83))}
    if len(offsets) != 1 or -1 in offsets:  # pragma: no cover - not CPython
        raise RuntimeError("cannot locate the length of bytes objects")
    return offsets.pop()


BYTES_DATA_OFFSET = _bytes_data_offset()
BYTES_SIZE_OFFSET = _bytes_size_offset()
ARRAY_DATA_OFFSET = _array_data_offset()


class ObjectLayout(NamedTuple):
    """Offsets from an object's ``id`` that the column check of an add batch reads
    (``kernels/objects.py``): any object's type pointer; a ``bytes``' length; an ndarray's
    ``nd`` (int32), ``dimensions`` pointer, ``descr`` (its dtype) and ``flags`` (int32)."""

    ob_type: int
    size: int
    nd: int
    dimensions: int
    descr: int
    flags: int


def _object_layout() -> ObjectLayout | None:
    """numpy's array fields after ``data`` (nd, dimensions, strides, base, descr, flags) and
    the object header, each read back on probes of every kind the check meets; ``None`` (the
    check falls back to Python) when one does not read back."""
    if ARRAY_DATA_OFFSET < 0:  # pragma: no cover - not CPython + numpy
        return None
    d = ARRAY_DATA_OFFSET
    layout = ObjectLayout(8, 16, d + 8, d + 16, d + 40, d + 48)
    grid = np.zeros((6, 4), np.uint16)
    frozen = np.zeros(7, np.uint32)
    frozen.setflags(write=False)
    i64, i32 = ctypes.c_int64.from_address, ctypes.c_int32.from_address
    for a in (frozen, grid, grid[1:3], grid.T, np.zeros(9, np.int64)[::2]):
        at = id(a)
        if (
            i64(at + layout.ob_type).value != id(np.ndarray)
            or i32(at + layout.nd).value != a.ndim
            or i64(i64(at + layout.dimensions).value).value != a.shape[0]
            or i64(at + layout.descr).value != id(a.dtype)
            or i32(at + layout.flags).value != a.flags.num
        ):
            return None  # pragma: no cover - another numpy layout
    for raw in (b"", b"x" * 33):
        if i64(id(raw) + layout.ob_type).value != id(bytes):
            return None  # pragma: no cover - another object header
        if i64(id(raw) + layout.size).value != len(raw):
            return None  # pragma: no cover - another bytes layout
    return layout


OBJECT_LAYOUT = _object_layout()


class ItemArrays(NamedTuple):
    """Where a ``list``'s and a ``tuple``'s items are, from their ``id``: the offset of their
    length (``ob_size``), of a list's ``ob_item`` pointer (its items are where it points) and
    of a tuple's first item (its items are inline)."""

    size: int
    list_items: int
    tuple_items: int


def _item_arrays() -> ItemArrays | None:
    """CPython's ``PyListObject``/``PyTupleObject`` item arrays, located after the variable
    object header and read back on probes of several lengths; ``None`` (callers fall back to
    ``map(id, ...)``) when one does not read back."""
    i64 = ctypes.c_int64.from_address
    at = ItemArrays(16, 24, 24)
    for n in (1, 3, 17):
        items = [object() for _ in range(n)]
        for probe in (items, tuple(items)):
            # the header first (type, length): the item pointer is read only behind one
            if i64(id(probe) + 8).value != id(type(probe)) or i64(id(probe) + at.size).value != n:
                return None  # pragma: no cover - another object header
            first = id(probe) + at.tuple_items
            if type(probe) is list:
                first = i64(id(probe) + at.list_items).value
            if [i64(first + 8 * k).value for k in range(n)] != list(map(id, items)):
                return None  # pragma: no cover - another list or tuple layout
    return at


ITEM_ARRAYS = _item_arrays()

WRITE_OFFSETS = (
    BYTES_DATA_OFFSET,
    BYTES_SIZE_OFFSET,
    ARRAY_DATA_OFFSET,
    -1 if ITEM_ARRAYS is None else ITEM_ARRAYS.list_items,
)
"""Where a single write's kernel reads its objects from their ``id`` (a ``bytes``' payload
and length, an ndarray's data pointer, a list's item pointer; -1: not located):
``kernels.layout.write_context``."""


def bytes_address(raw: bytes) -> int:
    """Address of the payload of ``raw`` (an exact ``bytes``; valid while it is alive)."""
    return id(raw) + BYTES_DATA_OFFSET


def array_handle(array: npt.NDArray[Any]) -> int:
    """What the write kernel reads the array through (pass ``ARRAY_DATA_OFFSET`` with it):
    its ``id``, or its data address when the offset was not located."""
    return id(array) if ARRAY_DATA_OFFSET >= 0 else int(array.ctypes.data)


def array_handles(arrays: list[npt.NDArray[Any]]) -> list[int]:
    """What the write kernel reads the arrays through (pass ``ARRAY_DATA_OFFSET`` with it):
    ``id``s, or the data addresses when the offset was not located."""
    if ARRAY_DATA_OFFSET >= 0:
        return list(map(id, arrays))
    return [a.ctypes.data for a in arrays]  # pragma: no cover


def _slot_setter(name: str) -> Callable[[BlendMatch, Any], None]:
    descriptor = vars(BlendMatch).get(name)
    if type(descriptor).__name__ != "member_descriptor":
        raise RuntimeError(f"BlendMatch.{name} is not a slot: the fast construction is invalid")
    setter: Callable[[BlendMatch, Any], None] = descriptor.__set__  # type: ignore[union-attr]
    return setter


_new_object = object.__new__
_set_hash = _slot_setter("chunk_hash")
_set_old = _slot_setter("old_st")
_set_cur = _slot_setter("cur_st")


def make_match(chunk_hash: bytes, old_st: int, cur_st: int) -> BlendMatch:
    """``BlendMatch(chunk_hash, old_st, cur_st)``, without the dataclass ``__init__``."""
    m: BlendMatch = _new_object(BlendMatch)
    _set_hash(m, chunk_hash)
    _set_old(m, old_st)
    _set_cur(m, cur_st)
    return m


def make_matches(hashes: list[bytes], offsets: list[int], starts: list[int]) -> list[BlendMatch]:
    """``[make_match(h, o, s) ...]`` field by field: each step is one C-level ``map``, no
    Python frame per match."""
    out: list[BlendMatch] = list(map(_new_object, repeat(BlendMatch, len(hashes))))
    deque(map(_set_hash, out, hashes), 0)
    deque(map(_set_old, out, offsets), 0)
    deque(map(_set_cur, out, starts), 0)
    return out


def check_fast_match() -> None:
    """Raise ``RuntimeError`` unless the fast construction is valid for ``BlendMatch``."""
    names = [f.name for f in dataclasses.fields(BlendMatch)]
    if names != ["chunk_hash", "old_st", "cur_st"] or hasattr(BlendMatch, "__post_init__"):
        raise RuntimeError("BlendMatch changed shape: the fast construction is invalid")
    want = BlendMatch(b"probe", 1, 2)
    if make_match(b"probe", 1, 2) != want or make_matches([b"probe"], [1], [2]) != [want]:
        raise RuntimeError("fast BlendMatch construction differs from BlendMatch(...)")


check_fast_match()
