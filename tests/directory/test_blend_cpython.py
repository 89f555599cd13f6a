"""The CPython-layout shortcuts of the blend index (``kvatlas/directory/blend/_cpython.py``):
the fast ``BlendMatch`` construction equals the real one, and every located offset reads back
what it claims to."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from kvatlas.directory.blend import _cpython
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
    assert _cpython.bytes_addresses(raws) == [_cpython.bytes_address(r) for r in raws]
    assert _cpython.bytes_addresses([]) == []
    arr = np.arange(8, dtype=np.uint32)
    assert _cpython.ARRAY_DATA_OFFSET >= 0  # CPython + numpy: located, no fallback
    data = ctypes.c_int64.from_address(_cpython.array_handle(arr) + _cpython.ARRAY_DATA_OFFSET)
    assert data.value == arr.ctypes.data
    items = [object(), object()]
    first = ctypes.c_int64.from_address(_cpython.list_items_address(items))
    assert first.value == id(items[0])


def test_field_search_reports_an_unrecognised_layout() -> None:
    assert _cpython.find_field(np.zeros(4), lambda value: False) == -1


def test_fast_construction_is_refused_if_blend_match_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _cpython.check_fast_match()  # what the import ran
    monkeypatch.setattr(BlendMatch, "__post_init__", lambda self: None, raising=False)
    with pytest.raises(RuntimeError):
        _cpython.check_fast_match()
