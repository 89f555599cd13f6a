"""A column of chunk hashes by value (``blend/hash_words.py``, a restore's): it reads as the
list of ``bytes`` it stands for, and an empty index built from it in bulk is the index built
from those ``bytes``."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import AddColumns
from kvatlas.directory.blend.hash_words import HashWords
from tests.directory.test_blend_bulk_build import _bulk, _general, _same, pool, state_of
from tests.directory.test_blend_index_oracle import SPACES


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=32, max_size=32), max_size=20), st.data())
def test_a_column_reads_as_its_list_of_bytes(hashes: list[bytes], data: st.DataObject) -> None:
    words = HashWords(b"".join(hashes))
    assert len(words) == len(hashes) and list(words) == hashes
    assert [words[i] for i in range(-len(hashes), len(hashes))] == hashes + hashes
    assert all(type(h) is bytes for h in words)
    cut = data.draw(st.slices(len(hashes)))
    assert list(words[cut]) == hashes[cut]
    rows = data.draw(st.lists(st.integers(0, max(len(hashes) - 1, 0)), max_size=8))
    if hashes:
        taken = words.take(rows)
        assert list(taken) == [hashes[r] for r in rows]
        for part in (words, words[cut], taken):  # each hash where its address says
            got = [ctypes.string_at(int(a), 32) for a in part.addresses()]
            assert got == list(part)


@pytest.mark.parametrize("column", [b"x" * 33, np.zeros((2, 32), np.uint8), np.zeros(3)])
def test_anything_but_a_column_of_32_byte_rows_is_refused(column: object) -> None:
    with pytest.raises(ValueError):
        HashWords(column)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 15), st.integers(0, 9), st.integers(0, 1 << 40)),
        min_size=1,
        max_size=40,
    )
)
def test_a_bulk_build_from_a_column_is_the_build_from_its_bytes(
    rows: list[tuple[int, int, int]],
) -> None:
    """The same adds (hashes of 32 bytes, some twice), their hashes once as ``bytes`` and once
    as a :class:`HashWords` column: the same index, through the bulk path and the general
    one (which reads the column as ``bytes``); a negative control: other hashes differ."""
    contents = pool(1)
    hashes = [bytes([h]) * 31 + bytes([h * 7 % 256]) for _, h, _ in rows]

    def adds(chunk_hashes: object) -> AddColumns:
        return AddColumns(
            [contents[c] for c, _, _ in rows],
            chunk_hashes,  # type: ignore[arg-type]
            np.array([o for *_, o in rows], np.int64),
            [SPACES[0]],
            vouched=True,
        )

    column = HashWords(b"".join(hashes))
    reference = _bulk(adds(hashes), None)
    _same(_bulk(adds(column), None), reference, contents)
    _same(_general(adds(column), None), reference, contents)
    other = HashWords(b"".join(bytes([200]) + h[1:] for h in hashes))
    assert state_of(_bulk(adds(other), None)) != state_of(reference)
