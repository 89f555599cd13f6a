"""The blend index's token verification (``kernels/table.equal_at``: ``uint16``, ``uint32`` and
the planes form, ``kernels/planes.planes_equal``) against a brute-force comparison of the
widened ids, for every chunk size's whole and partial blocks of 64: a wrong ``True`` would
return another chunk's KV, a wrong ``False`` lose a match. Also the bit gathering the planes
comparison is built on (``pointers.bit_column``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory.blend._cpython import BYTES_DATA_OFFSET
from kvatlas.directory.blend.kernels.contents import data_offset
from kvatlas.directory.blend.kernels.layout import TOKENS_PLANES, TOKENS_U16
from kvatlas.directory.blend.kernels.planes import FORM_U16, FORM_U32
from kvatlas.directory.blend.kernels.pointers import BIT_COLUMN, bit_column, jit
from kvatlas.directory.blend.kernels.table import equal_at
from kvatlas.directory.token_store import stored_form, stored_one, stored_view

_WIDTHS = [16, 17, 18, 20, 24, 25, 32]
"""Bit lengths of a content's largest id: uint16, the planes form with 1 to 8 high bits, and
uint32 (both past the planes' reach and because the planes form would not be smaller)."""


def tagged_address(stored: bytes) -> int:
    """The token address the index keeps for ``stored`` (``layout.py``: the address of its
    ids, ``kernels/contents.py``, tagged by form)."""
    form = stored_form(stored)
    at = id(stored) + BYTES_DATA_OFFSET + data_offset(form)
    if form == FORM_U16:
        return at | TOKENS_U16
    if form == FORM_U32:
        return at
    return at | TOKENS_PLANES


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, bytes, int, np.ndarray]:
    """(content, its stored form, a position, a query holding the content or a near miss at
    that position)."""
    chunk = draw(st.sampled_from([1, 15, 16, 63, 64, 65, 100, 128, 191, 256, 300]))
    width = draw(st.sampled_from(_WIDTHS))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    content = rng.integers(0, 1 << width, chunk, dtype=np.uint64).astype(np.uint32)
    content[rng.integers(chunk)] = (1 << width) - 1  # the largest id sets the form
    before, after = draw(st.integers(0, 70)), draw(st.integers(0, 70))
    query = rng.integers(0, 1 << 32, before + chunk + after, dtype=np.uint64).astype(np.uint32)
    query[before : before + chunk] = content
    change = draw(st.sampled_from(["none", "bit", "value"]))
    if change != "none":
        at = before + draw(st.integers(0, chunk - 1))
        if change == "bit":  # a near miss: one bit of one id, any of the 32
            query[at] ^= np.uint32(1 << draw(st.integers(0, 31)))
        else:
            query[at] = np.uint32(draw(st.integers(0, 2**32 - 1)))
    return content, stored_one(content), before, query


@settings(max_examples=400, deadline=None)
@given(cases())
def test_equal_at_is_exact(case: tuple[np.ndarray, bytes, int, np.ndarray]) -> None:
    content, stored, pos, query = case
    chunk = len(content)
    expected = bool(np.array_equal(query[pos : pos + chunk], content))
    assert equal_at(query, pos, tagged_address(stored), chunk) is expected


def test_every_form_and_block_boundary_is_exercised() -> None:
    """Negative control of the generator: the three forms, and a differing id in a whole
    block and in a partial one, each caught."""
    rng = np.random.default_rng(7)
    forms = set()
    for width in _WIDTHS:
        content = rng.integers(0, 1 << width, 100, dtype=np.uint64).astype(np.uint32)
        content[0] = (1 << width) - 1
        stored = stored_one(content)
        forms.add(str(stored_view(stored).dtype))
        query = np.concatenate([content, content[:3]])
        addr = tagged_address(stored)
        assert equal_at(query, 0, addr, 100)
        for at in (0, 63, 64, 99):  # whole block, its last id, the partial block
            for bit in range(32):
                near = query.copy()
                near[at] ^= np.uint32(1 << bit)
                assert not equal_at(near, 0, addr, 100), (width, at, bit)
    assert forms == {"uint16", "uint32", "|V1"}


def test_a_strided_query_is_refused() -> None:
    """The kernels read the query through its address: a view with another stride would be
    misread, so it is refused rather than compared."""
    content = np.arange(70_000, 70_064, dtype=np.uint32)
    stored = stored_one(content)
    spaced = np.repeat(content, 2)[::2]  # equal ids, stride 8
    with pytest.raises(ValueError, match="contiguous"):
        equal_at(spaced, 0, tagged_address(stored), 64)


@jit
def _column(ids: np.ndarray, start: int, shift: int) -> np.uint64:
    return bit_column(ids.ctypes.data + 4 * start, np.uint32(shift))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 31), st.integers(0, 5))
def test_bit_column_gathers_one_bit_per_id(seed: int, shift: int, start: int) -> None:
    ids = np.random.default_rng(seed).integers(0, 1 << 32, BIT_COLUMN + 5, dtype=np.uint64)
    ids = ids.astype(np.uint32)
    expected = sum(((int(v) >> shift) & 1) << k for k, v in enumerate(ids[start : start + 64]))
    assert int(_column(ids, start, shift)) == expected
