"""Token storage of a batch of arrays: the compiled layout check (every array an exact, 1-D,
C-contiguous ``uint32`` ndarray, none twice) against the general path it skips (the
reference: the same stored contents, forms and sharing), on batches that
mix what the check takes with what it must hand over (views, strided, big-endian, other
dtypes, subclasses, arrays shared by entries, entries without tokens)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.directory import token_store
from kvatlas.directory.token_store import stored_batch


class Sub(np.ndarray):  # type: ignore[type-arg]
    pass


def _array(kind: str, values: list[int]) -> Any:
    base = np.array(values, dtype=np.uint32)
    if kind == "u32":
        return base
    if kind == "view":
        return np.concatenate([base, base])[: len(values)]
    if kind == "strided":
        return np.repeat(base, 2)[::2]
    if kind == "big-endian":
        return base.astype(">u4")
    if kind == "int64":
        return base.astype(np.int64)
    return base.view(Sub)


ids = st.one_of(st.integers(0, 65_535), st.integers(0, 128_255), st.integers(0, (1 << 32) - 1))
kinds = st.sampled_from(["u32", "u32", "u32", "view", "strided", "big-endian", "int64", "sub"])


def _general(arrays: list[Any]) -> list[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(token_store, "_u32_rows", lambda srcs: None)
        return stored_batch(arrays)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.one_of(st.none(), st.tuples(kinds, st.lists(ids, max_size=40))), max_size=8),
    share=st.booleans(),
    frozen=st.booleans(),
)
def test_compiled_check_stores_as_the_general_path(
    rows: list[tuple[str, list[int]] | None], share: bool, frozen: bool
) -> None:
    arrays = [None if r is None else _array(*r) for r in rows]
    for a in arrays:
        if a is not None and frozen:
            a.flags.writeable = False
    if share and len(arrays) > 1 and arrays[0] is not None:
        arrays[-1] = arrays[0]  # ranks of one chunk share their input array
    fast = stored_batch(arrays)
    slow = _general(arrays)
    assert all(s is None or type(s) is bytes for s in fast + slow)
    assert fast == slow  # the same contents, byte for byte (the header names the form)
    # the same sharing: entries given one array get one stored array, others their own
    assert [[x is y for y in fast] for x in fast] == [[x is y for y in slow] for x in slow]
    for a, s in zip(arrays, fast, strict=True):
        assert s is None or s is not a  # a copy: never the caller's array


def test_the_check_takes_plain_arrays_and_hands_over_the_others() -> None:
    """Negative control: the compiled check answers for the usual batch and refuses every
    kind it does not take (so the test above exercises both paths)."""
    plain = [np.arange(4, dtype=np.uint32), np.arange(3, dtype=np.uint32)]
    assert token_store._u32_rows(plain) is not None
    for kind in ("strided", "big-endian", "int64", "sub"):
        assert token_store._u32_rows([plain[0], _array(kind, [1, 2, 3])]) is None, kind
    assert token_store._u32_rows([plain[0], plain[0]]) is None  # shared: stored once
