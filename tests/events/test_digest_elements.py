"""``inventory.xor_elements`` (the directory's batch step, compiled) against the element of
each hash XORed into its bucket one by one in Python (``inventory.element``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.events.inventory import BUCKETS, element, xor_elements

hashes = st.lists(st.binary(min_size=32, max_size=32), max_size=40)
multipliers = st.integers(1, (1 << 64) - 1).map(lambda m: m | 1)  # (tags' multipliers are odd)


@settings(max_examples=200, deadline=None)
@given(hs=hashes, multiplier=multipliers, kept=st.none() | st.binary(min_size=256, max_size=256))
def test_xor_elements_is_each_element_xored_into_its_bucket(
    hs: list[bytes], multiplier: int, kept: bytes | None
) -> None:
    start = np.arange(BUCKETS, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    want = [int(v) for v in start]
    for h in hs:
        if kept is None or kept[h[0]] % 2:
            want[h[0]] ^= element(h, multiplier)
    got = start.copy()
    flags = None if kept is None else np.frombuffer(bytes(b % 2 for b in kept), np.uint8)
    xor_elements(got, hs, multiplier, flags)
    assert got.tolist() == want
