"""The compiled blend-lookup reply writer against the one definition of the wire shape
(``wire.blend_to_wire`` encoded by the service's JSON encoder): byte for byte."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator._blend_reply import blend_reply
from kvatlas.coordinator.wire import blend_to_wire
from kvatlas.directory import BlendIndex, MatchColumns
from kvatlas.keys import BlendMatch, BlendNamespace
from kvatlas.web import json_encoder

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)


def _check(rows: list[tuple[bytes, int, int]], enabled: bool) -> None:
    """The reply of ``rows`` (hash, old_st, cur_st) as columns is the encoded wire shape."""
    columns = MatchColumns.of(
        [h for h, _, _ in rows],
        np.array([o for _, o, _ in rows], np.int64),
        np.array([c for _, _, c in rows], np.int64),
    )
    matches = [BlendMatch(h, o, c) for h, o, c in rows]
    assert blend_reply(columns, enabled) == json_encoder.encode(blend_to_wire(matches, enabled))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=32), INT64, INT64), max_size=20), st.booleans())
def test_reply_is_the_encoded_wire_shape(rows: list[tuple[bytes, int, int]], enabled: bool) -> None:
    """Any hash of up to 32 bytes and any int64 (large values: digits from unsigned
    arithmetic, not floats)."""
    _check(rows, enabled)


def test_reply_of_an_index_match() -> None:
    """The columns an index returns (arrays and hashes as the match makes them) encode alike."""
    index = BlendIndex(chunk_size=4)
    ns = BlendNamespace("m")
    for i in range(5):
        index.add([i, i + 1, i + 2, i + 3], bytes([i]) * 32, 1000 + i, ns)
    query = np.arange(0, 12, dtype=np.uint32)
    columns = index.match_columns(query, ns)
    assert columns.n_matches == 5
    assert columns.matches() == index.match(query, ns)
    assert blend_reply(columns, True) == json_encoder.encode(
        blend_to_wire(index.match(query, ns), True)
    )


def test_reply_of_a_match_with_short_and_shared_hashes() -> None:
    """Hashes shorter than 32 bytes come out of the scan with their lengths, and a hash two
    contents carry comes out once (at its first hit)."""
    index = BlendIndex(chunk_size=4)
    ns = BlendNamespace("m")
    hashes = [b"a", b"bb" * 8, bytes(32), b"a", b"c" * 31]
    for i, h in enumerate(hashes):
        index.add([i, i + 1, i + 2, i + 3], h, 1000 + i, ns)
    query = np.arange(0, 12, dtype=np.uint32)
    columns = index.match_columns(query, ns)
    assert columns.chunk_hashes() == [b"a", b"bb" * 8, bytes(32), b"c" * 31]
    assert columns.cur_st.tolist() == [0, 1, 2, 4]
    assert blend_reply(columns, True) == json_encoder.encode(
        blend_to_wire(index.match(query, ns), True)
    )


EDGES = sorted(
    {10**p + d for p in range(19) for d in (-1, 0, 1)}
    | {(1 << 32) + d for d in (-1, 0, 1)}
    | {0, (1 << 63) - 1}
)
"""Each side of every power of ten and of 2^32 (where the fast digits give way to the loop)."""


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.binary(min_size=32, max_size=32),
            st.one_of(st.sampled_from(EDGES), INT64),
            st.one_of(st.sampled_from(EDGES), st.integers(0, 1 << 33)),
        ),
        max_size=20,
    ),
    st.booleans(),
)
def test_reply_of_full_width_hashes(rows: list[tuple[bytes, int, int]], enabled: bool) -> None:
    """Hashes all of 32 bytes (every chunk hash: written without a length each) and offsets at
    the digit counts' edges."""
    _check(rows, enabled)


def test_reply_of_many_offsets() -> None:
    """A hundred thousand random offsets below 2^32 and every one up to 10^5 (what the digits
    without a division must get right for each value, not only at the edges)."""
    rng = np.random.default_rng(0)
    old = np.concatenate([rng.integers(0, 1 << 32, 100_000), np.arange(100_000)])
    cur = rng.permutation(old)
    hashes = [bytes(32)] * len(old)
    matches = [
        BlendMatch(h, o, c) for h, o, c in zip(hashes, old.tolist(), cur.tolist(), strict=True)
    ]
    columns = MatchColumns.of(hashes, old, cur)
    assert blend_reply(columns, True) == json_encoder.encode(blend_to_wire(matches, True))


def test_reply_of_every_byte_value_at_every_place() -> None:
    """Every byte value at each of the four places of a word the hex digits are written from
    (and in a hash's tail of fewer than four bytes): each hex digit from one table read
    against the words' arithmetic."""
    values = np.arange(256, dtype=np.uint8)
    hashes = [bytes(np.roll(values, shift)[:32]) for shift in range(0, 256, 7)]
    hashes += [bytes(values[i : i + n]) for n in (1, 2, 3, 5, 31) for i in range(0, 256 - n, n)]
    _check([(h, i, 2 * i) for i, h in enumerate(hashes)], True)
