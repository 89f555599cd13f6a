"""The CPython-layout shortcuts of the blend index (``kvatlas/directory/blend/_cpython.py``):
the fast ``BlendMatch`` construction equals the real one, and every located offset reads back
what it claims to."""

from __future__ import annotations

import ctypes
import dataclasses
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory.blend import _cpython, op_checks
from kvatlas.directory.blend.kernels.objects import payload_addresses
from kvatlas.directory.token_store import stored_one
from kvatlas.keys import BlendMatch

CASES = [(b"", 0, 0), (b"x" * 32, 5, 7), (bytes(range(32)), 1 << 40, 3), (b"\x00short", 256, 1)]


@pytest.mark.parametrize(("chunk_hash", "old_st", "cur_st"), CASES)
def test_fast_match_equals_blend_match(chunk_hash: bytes, old_st: int, cur_st: int) -> None:
    fast = _cpython.make_match(chunk_hash, old_st, cur_st)
    real = BlendMatch(chunk_hash, old_st, cur_st)
    assert type(fast) is BlendMatch
    assert fast == real and hash(fast) == hash(real) and repr(fast) == repr(real)
    assert dataclasses.astuple(fast) == (chunk_hash, old_st, cur_st)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.cur_st = 1  # type: ignore[misc]


def test_fast_matches_equal_blend_matches() -> None:
    hashes, offsets, starts = (list(column) for column in zip(*CASES, strict=True))
    assert _cpython.make_matches(hashes, offsets, starts) == [BlendMatch(*c) for c in CASES]
    assert _cpython.make_matches([], [], []) == []


def test_located_offsets_read_back() -> None:
    raw = b"a chunk hash, kept by reference"
    assert ctypes.string_at(_cpython.bytes_address(raw), len(raw)) == raw
    raws = [raw, b"", b"x" * 32]
    assert payload_addresses(raws).tolist() == [_cpython.bytes_address(r) for r in raws]
    assert payload_addresses([]).tolist() == []
    arr = np.arange(8, dtype=np.uint32)
    assert _cpython.ARRAY_DATA_OFFSET >= 0  # CPython + numpy: located, no fallback
    data = ctypes.c_int64.from_address(_cpython.array_handle(arr) + _cpython.ARRAY_DATA_OFFSET)
    assert data.value == arr.ctypes.data


def test_field_search_reports_an_unrecognised_layout() -> None:
    assert _cpython.find_field(np.zeros(4), lambda value: False) == -1


def test_fast_construction_is_refused_if_blend_match_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _cpython.check_fast_match()  # what the import ran
    monkeypatch.setattr(BlendMatch, "__post_init__", lambda self: None, raising=False)
    with pytest.raises(RuntimeError):
        _cpython.check_fast_match()


def _token_object(kind: str, chunk: int, dtype: str, writeable: bool) -> object:
    """One of the objects an add batch may hold for a content (``kind``)."""
    if kind == "list":
        return list(range(chunk))
    if kind.startswith("content"):  # the directory's contents (kernels/contents.py)
        top = {"uint16": 1 << 16, "uint32": 1 << 32, "uint8": 1 << 17, "int64": 1 << 24}
        ids = np.arange(chunk, dtype=np.uint64) * 7919 % top.get(dtype, 1 << 20)
        content = stored_one(ids.astype(np.uint32))
        if kind == "content-short":
            return stored_one(ids[:-1].astype(np.uint32))
        if kind == "content-bad":  # a header no content has
            return bytes([9 if writeable else 0, 3]) + content[2:]
        if kind == "content-cut":  # a byte short
            return content[:-1]
        return _Bytes(content) if kind == "content-subclass" else content
    if kind == "subclass":  # an ndarray, but not exactly
        arr: np.ndarray = np.zeros(chunk, dtype).view(np.recarray)
    elif kind == "2-D":
        arr = np.zeros((chunk, 1), dtype)
    elif kind == "0-D":
        arr = np.array(1, dtype)
    elif kind == "short":
        arr = np.zeros(chunk - 1, dtype)
    elif kind == "strided":
        arr = np.zeros(2 * chunk, dtype)[::2]
    elif kind == "view":  # contiguous, not owning: never kept by reference
        arr = np.zeros(2 * chunk, dtype)[:chunk]
    elif kind == "swapped":  # an equal-width dtype of the other byte order
        arr = np.zeros(chunk, np.dtype(dtype).newbyteorder())
    else:
        arr = np.zeros(chunk, dtype)
    arr.flags.writeable = writeable
    return arr


class _Bytes(bytes):
    """A ``bytes`` subclass: its length and payload are whatever it says."""


TOKEN_KINDS = (
    ["array"] * 6
    + ["content"] * 6
    + [
        "content-short",
        "content-bad",
        "content-cut",
        "content-subclass",
        "list",
        "subclass",
        "2-D",
        "0-D",
        "short",
        "strided",
        "view",
        "swapped",
    ]
)
HASH_OBJECTS = [b"", b"x", b"y" * 32, b"z" * 33, bytearray(b"w"), "text", 7, _Bytes(b"v")]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(TOKEN_KINDS),
            st.sampled_from(["uint16", "uint32", "uint8", "int64", "float32"]),
            st.booleans(),
            st.sampled_from(HASH_OBJECTS[:3] * 4 + HASH_OBJECTS[3:]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([1, 4, 256]),
)
def test_compiled_column_check_equals_the_python_one(
    entries: list[tuple[str, str, bool, object]], chunk: int
) -> None:
    """``checked_objects`` (objects read through their CPython layout, compiled) decides as
    ``checked_in_python`` does and gives the same widths and lengths, on every kind of object
    an add batch may hold: exact arrays of each width and of other dtypes, read-only or not,
    views, strided, 2-D, 0-D, short, a subclass, a swapped byte order, lists, the directory's
    contents (every form; short, malformed, a subclass), hashes that are not exact
    ``bytes``."""
    assert _cpython.OBJECT_LAYOUT is not None  # CPython + numpy: located
    tokens = [_token_object(kind, chunk, dtype, w) for kind, dtype, w, _ in entries]
    hashes = [h for *_, h in entries]
    fast = op_checks.checked_objects(tokens, hashes, chunk)
    slow = op_checks.checked_in_python(tokens, hashes, chunk)
    if slow is None:
        assert fast is None
        return
    assert fast is not None
    assert fast[0] is tokens and fast[2] is hashes
    assert fast[1].tolist() == slow[1].tolist() and fast[3].tolist() == slow[3].tolist()


def test_column_check_never_keeps_views() -> None:
    """A view may pin a larger buffer (a 1M-token request): never kept by reference."""
    base = np.zeros(16, np.uint16)
    view = base[4:8]
    view.flags.writeable = False
    assert op_checks.checked_objects([view], [b"h"], 4) is None
    assert op_checks.checked_in_python([view], [b"h"], 4) is None
    content = stored_one(np.arange(4, dtype=np.uint32))
    checked = op_checks.checked_objects([content], [b"h"], 4)
    assert checked is not None and checked[1].tolist() == [2]


class _Listed(list):  # type: ignore[type-arg]
    """A list subclass: not an exact list, so handles come the ``map(id, ...)`` way."""


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=40), st.integers(), st.none()), max_size=300))
def test_object_handles_are_the_ids(items: list[object]) -> None:
    """The handles copied from a list's or tuple's item pointers are the items' ``id``s, in
    order, for any length (resized lists included); other sequences give the same by
    ``map``; the located item arrays read back."""
    from kvatlas.directory.blend.kernels.objects import object_handles

    assert _cpython.ITEM_ARRAYS is not None
    grown = list(items)
    grown += [object()] * 3  # (a list whose item array was reallocated)
    for seq in (items, tuple(items), grown, _Listed(items), deque(items)):
        ids = list(map(id, seq))
        got = object_handles(seq)  # type: ignore[arg-type]
        assert got.dtype == np.int64 and got.tolist() == ids
        assert object_handles(seq, 24).tolist() == [i + 24 for i in ids]  # type: ignore[arg-type]
