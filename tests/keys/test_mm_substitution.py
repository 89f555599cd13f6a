"""apply_mm_hashes_to_token_ids: fill, truncate, skip, multi-item, length mismatch, slices."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvatlas.keys import PlaceholderSpan, apply_mm_hashes_to_token_ids, mm_hash_to_token_values
from tests.torch_support import require_torch

P = 7  # placeholder token id


def prompt(n: int = 20) -> list[int]:
    return [P] * n


def test_span_fill_in_place_and_returns_same_object() -> None:
    tokens = prompt()
    out = apply_mm_hashes_to_token_ids(tokens, ["img"], [(3, 5)])
    assert out is tokens
    assert tokens[3:8] == list(mm_hash_to_token_values("img", 5))
    assert tokens[:3] == [P] * 3 and tokens[8:] == [P] * 12


def test_span_running_past_end_is_truncated() -> None:
    tokens = prompt(10)
    apply_mm_hashes_to_token_ids(tokens, ["img"], [(6, 8)])
    assert tokens[6:] == list(mm_hash_to_token_values("img", 8))[:4]


@pytest.mark.parametrize("offset", [10, 11, 100])
def test_span_starting_at_or_past_end_is_skipped(offset: int) -> None:
    tokens = prompt(10)
    apply_mm_hashes_to_token_ids(tokens, ["img"], [(offset, 4)])
    assert tokens == prompt(10)


def test_multiple_items_and_position_shapes() -> None:
    tokens = np.full(30, P, dtype=np.int64)
    positions = [
        (0, 4),
        {"offset": 10, "length": 3},
        SimpleNamespace(offset=20, length=5),
        PlaceholderSpan(26, 2),
    ]
    apply_mm_hashes_to_token_ids(tokens, ["a", "b", "c", "d"], positions)
    assert tokens[0:4].tolist() == list(mm_hash_to_token_values("a", 4))
    assert tokens[10:13].tolist() == list(mm_hash_to_token_values("b", 3))
    assert tokens[20:25].tolist() == list(mm_hash_to_token_values("c", 5))
    assert tokens[26:28].tolist() == list(mm_hash_to_token_values("d", 2))
    assert (tokens[4:10] == P).all()


@pytest.mark.parametrize(("hashes", "n_positions"), [(["a", "b", "c"], 2), (["a"], 3)])
def test_length_mismatch_pairs_in_order_extras_ignored(hashes: list[str], n_positions: int) -> None:
    positions = [(i * 5, 3) for i in range(n_positions)]
    tokens = prompt()
    apply_mm_hashes_to_token_ids(tokens, hashes, positions)
    paired = min(len(hashes), n_positions)
    for i in range(paired):
        assert tokens[i * 5 : i * 5 + 3] == list(mm_hash_to_token_values(hashes[i], 3))
    for i in range(paired, n_positions):
        assert tokens[i * 5 : i * 5 + 3] == [P] * 3


def test_prefix_input_equals_prefix_of_full_substitution() -> None:
    full = apply_mm_hashes_to_token_ids(prompt(20), ["img"], [(8, 10)])
    prefix = apply_mm_hashes_to_token_ids(prompt(12), ["img"], [(8, 10)])
    assert prefix == full[:12]


def test_numpy_suffix_slice_is_refused() -> None:
    """Offsets are absolute: writing into a suffix slice would hit the wrong positions."""
    tokens = np.full(20, P, dtype=np.int64)
    with pytest.raises(ValueError, match="absolute"):
        apply_mm_hashes_to_token_ids(tokens[5:], ["img"], [(8, 4)])
    assert (tokens == P).all()


def test_explicit_base_offset_writes_the_right_positions() -> None:
    tokens = np.full(20, P, dtype=np.int64)
    apply_mm_hashes_to_token_ids(tokens[5:], ["img"], [(8, 4)], base_offset=5)
    reference = apply_mm_hashes_to_token_ids(np.full(20, P, dtype=np.int64), ["img"], [(8, 4)])
    assert np.array_equal(tokens, reference)


def test_numpy_prefix_view_is_allowed() -> None:
    tokens = np.full(20, P, dtype=np.int64)
    apply_mm_hashes_to_token_ids(tokens[:10], ["img"], [(8, 4)])
    assert tokens[8:10].tolist() == list(mm_hash_to_token_values("img", 4))[:2]
    assert (tokens[10:] == P).all()


def test_row_of_2d_batch_buffer_is_not_mistaken_for_a_slice() -> None:
    batch = np.full((3, 10), P, dtype=np.int64)
    apply_mm_hashes_to_token_ids(batch[1], ["img"], [(2, 3)])
    assert batch[1, 2:5].tolist() == list(mm_hash_to_token_values("img", 3))


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.float32])
def test_narrow_or_float_arrays_refused(dtype: type) -> None:
    with pytest.raises(ValueError, match="31-bit"):
        apply_mm_hashes_to_token_ids(np.zeros(8, dtype=dtype), ["img"], [(0, 2)])


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64])
def test_wide_enough_arrays_accepted(dtype: type) -> None:
    tokens = np.zeros(8, dtype=dtype)
    apply_mm_hashes_to_token_ids(tokens, ["img"], [(1, 2)])
    assert tokens[1:3].tolist() == list(mm_hash_to_token_values("img", 2))


def test_torch_tensor_in_place() -> None:
    torch = require_torch()
    tokens = torch.full((20,), P, dtype=torch.int64)
    out = apply_mm_hashes_to_token_ids(tokens, ["img"], [(3, 5)])
    assert out is tokens
    assert tokens[3:8].tolist() == list(mm_hash_to_token_values("img", 5))
    with pytest.raises(ValueError, match="absolute"):
        apply_mm_hashes_to_token_ids(tokens[4:], ["img"], [(3, 5)])
    int32 = torch.zeros(8, dtype=torch.int32)
    apply_mm_hashes_to_token_ids(int32, ["img"], [(0, 8)])
    assert int32.tolist() == list(mm_hash_to_token_values("img", 8))


@pytest.mark.parametrize(
    "make",
    [tuple, lambda xs: iter(list(xs)), lambda xs: array("l", xs), str],
    ids=["tuple", "iterator", "array.array", "str"],
)
def test_a_container_it_cannot_write_into_is_a_value_error_saying_what_is_taken(
    make: Any,
) -> None:
    """The values are written in place: a tuple, an iterator or an ``array.array`` is refused
    by a ValueError naming what is taken (it was numpy's "data type 'None' not understood")."""
    with pytest.raises(ValueError, match="a list, a numpy array or a torch tensor"):
        apply_mm_hashes_to_token_ids(make(prompt(8)), ["img"], [(2, 4)])


@pytest.mark.parametrize("offset", [1.5, "1", True, -1, np.float64(2.5), np.bool_(True)])
def test_a_base_offset_that_is_not_an_integer_at_least_zero_is_refused_by_name(
    offset: Any,
) -> None:
    with pytest.raises(ValueError, match="base_offset"):
        apply_mm_hashes_to_token_ids(prompt(8), ["img"], [(2, 4)], base_offset=offset)


def test_a_numpy_integer_base_offset_is_taken() -> None:
    tokens = np.full(20, P, dtype=np.int64)
    apply_mm_hashes_to_token_ids(tokens[5:], ["img"], [(8, 4)], base_offset=np.int64(5))
    assert tokens[8:12].tolist() == list(mm_hash_to_token_values("img", 4))


@pytest.mark.parametrize(
    "position", [(-1, 3), (2, -3), "ab", (1,), {"offset": 1}, (np.float64(1.5), 2)]
)
def test_bad_positions_rejected(position: object) -> None:
    with pytest.raises((ValueError, KeyError)):
        apply_mm_hashes_to_token_ids(prompt(), ["img"], [position])
