"""The blend index kernels against plain-Python references: the keyed fingerprint (direct
and rolling), the extra-claim set's open addressing with its backward-shift delete, and the
id allocator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.bench.fingerprint_floor import scratch_shapes, window_fingerprints
from kvatlas.directory import BlendIndex
from kvatlas.directory.blend import kernels
from kvatlas.directory.blend.fingerprints import FingerprintKey
from kvatlas.directory.blend.kernels import modhash, table
from kvatlas.directory.blend.op_checks import token_widths
from kvatlas.directory.token_store import stored_batch
from kvatlas.keys import BlendNamespace

P = kernels.MERSENNE61


def reference_fingerprint(window: list[int], base: int) -> int:
    h = 0
    for t in window:
        h = (h * base + t) % P
    return h


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 7, 8, 255, 256, 257])
def test_fingerprint_equals_the_polynomial(length: int) -> None:
    rng = np.random.default_rng(length)
    tokens = rng.integers(0, 1 << 32, length + 9, dtype=np.uint64).astype(np.uint32)
    for base in (1, 2, P - 1, int(rng.integers(2, P - 1))):
        for start in (0, 9):
            window = tokens[start : start + length].tolist()
            want = reference_fingerprint(window, base)
            assert kernels.fingerprint(tokens, start, length, base, P) == want
            assert kernels.fingerprint(tokens, start, length, base, 7) == want & 7


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 1000])
def test_the_power_table_holds_each_ids_weight(length: int) -> None:
    rng = np.random.default_rng(length)
    for base in (1, 2, P - 2, P - 1, int(rng.integers(2, P - 1))):
        out = np.full((2, length + 1), 7, np.uint64)  # one more: nothing written past length
        modhash.power_table(base, length, out)
        weights = (out[0, :length] + (out[1, :length] << np.uint64(31))).tolist()
        assert weights == [pow(base, length - 1 - i, P) for i in range(length)]
        assert (out[0, :length] < 1 << 31).all() and (out[1, :length] < 1 << 30).all()
        assert out[:, length].tolist() == [7, 7]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 600),
    st.integers(0, 9),
    st.one_of(st.sampled_from([1, 2, P - 2, P - 1]), st.integers(2, P - 2)),
    st.sampled_from([P, 7, (1 << 40) - 1, 1]),
    st.sampled_from(["random", "largest", "smallest"]),
    st.integers(0, 2**32 - 1),
)
def test_the_fingerprint_by_weights_equals_the_polynomial(
    length: int, start: int, base: int, fmask: int, ids: str, seed: int
) -> None:
    """:func:`fingerprint_at` against the polynomial computed with Python's integers (what
    the rolling scan agrees with: ``test_rolling_lanes_equal_the_direct_fingerprint``): every
    length around the SIMD width, ids from the whole ``uint32`` range (all of them 2^32 - 1:
    the largest products and sums)."""
    rng = np.random.default_rng(seed)
    if ids == "random":
        tokens = rng.integers(0, 1 << 32, start + length, dtype=np.uint64).astype(np.uint32)
    else:
        tokens = np.full(start + length, 0xFFFFFFFF if ids == "largest" else 0, np.uint32)
    powers = np.empty((2, length), np.uint64)
    modhash.power_table(base, length, powers)
    want = reference_fingerprint(tokens[start:].tolist(), base) & fmask
    assert modhash.fingerprint_at(tokens, start, length, powers, fmask) == want


@pytest.mark.parametrize("chunk", [1, 7, 8, 9, 16, 17, 63, 65, 256, 257])
def test_the_fingerprint_of_a_stored_content_is_its_ids_polynomial(chunk: int) -> None:
    """Contents in every stored form (``uint16``, the planes form with 1 to 8 high bits,
    ``uint32``), fingerprinted from their stored bytes as a snapshot's column and a batch's
    writes do (``fingerprints.stored_fingerprint``: the planes form without widening it),
    equal the polynomial of their ids; chunk sizes whose last plane byte is partial."""
    rng = np.random.default_rng(chunk)
    arrays = []
    for top in (1 << 16, 1 << 17, 128_256, 1 << 20, 1 << 24, 1 << 32):
        for _ in range(3):
            ids = rng.integers(0, top, chunk, dtype=np.uint64).astype(np.uint32)
            ids[rng.integers(0, chunk)] = top - 1  # the form's largest id
            ids.flags.writeable = False
            arrays.append(ids)
    stored = stored_batch(arrays)
    forms = {token_widths([c])[0] for c in stored}
    assert len(forms) == (3 if chunk > 2 else 2)  # every form (1 or 2 ids: never planes)
    for base in (2, P - 2, int(rng.integers(2, P - 2))):
        for bits in (61, 20):
            got = FingerprintKey(kernels.modhash.SCHEME, chunk, bits, base).of(stored)
            want = [reference_fingerprint(a.tolist(), base) & ((1 << bits) - 1) for a in arrays]
            assert got.tolist() == want


@pytest.mark.parametrize("batch", [1, 2, 5, 300])
def test_a_writes_fingerprints_are_the_polynomial_alone_or_in_a_batch(batch: int) -> None:
    """A batch of adds (``apply_ops``) and a single add (``apply_op``, the weights through
    the write context) fingerprint by the index's table of weights: the index holds each
    content under its polynomial either way (negative control: a wrong weight fails it)."""
    rng = np.random.default_rng(batch)
    index = BlendIndex(chunk_size=256)
    ns = BlendNamespace("m")
    contents = rng.integers(0, 1 << 32, (batch, 256), dtype=np.uint64).astype(np.uint32)
    index.add_many([(c, i.to_bytes(32, "big"), 0, ns) for i, c in enumerate(contents)])
    state = index._state
    held = state.arrays.c_fp[: state.contents].tolist()
    want = [reference_fingerprint(c.tolist(), index._base) & index._fmask for c in contents]
    assert sorted(held) == sorted(want)


_ID = st.one_of(st.sampled_from([0, 1, (1 << 32) - 1]), st.integers(0, (1 << 32) - 1))
_RESIDUE = st.one_of(st.sampled_from([0, 1, P - 2, P - 1]), st.integers(0, P - 1))


@settings(max_examples=500, deadline=None)
@given(_RESIDUE, _ID, _ID, _RESIDUE, _RESIDUE)
def test_one_roll_step_is_the_polynomials(
    h: int, t_in: int, t_out: int, b: int, b_pow: int
) -> None:
    """A rolling step (the leaving id added times ``P - b^len`` by ``id_product``, two 32-bit
    products, unreduced) is exact at the extremes of every operand: ids up to 2^32 - 1,
    residues up to 2^61 - 2; the product stays within the bound the step's sum relies on."""
    u = np.uint64
    assert modhash.roll(u(h), u(t_in), u(t_out), u(b), u(b_pow)) == (
        (h * b + t_in - t_out * b_pow) % P
    )
    minus = P - b_pow
    product = int(modhash.id_product(u(t_out), u(minus & ((1 << 31) - 1)), u(minus >> 31)))
    assert product % P == t_out * minus % P and product < (1 << 63) + (1 << 61) + (1 << 32)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.sampled_from(
            [0, 1, P - 1, P, P + 1, 1 << 61, (1 << 61) + 6, 2 * P - 1, 2 * P, 1 << 62,
             (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
        ),
        st.integers(0, (1 << 64) - 1),
    )
)  # fmt: skip
def test_fold_is_the_canonical_residue_of_any_word(x: int) -> None:
    """``fold`` (one step of 2^61 = 1 and one conditional subtraction) gives ``x mod P`` for
    every 64-bit ``x``: at the prime, its multiples and around the sign bit, where its
    compare reads the subtraction's sign."""
    assert int(modhash.fold(np.uint64(x))) == x % P


@pytest.mark.parametrize(("n", "chunk"), [(1, 4), (17, 4), (100, 16), (1000, 256)])
def test_rolling_lanes_equal_the_direct_fingerprint(n: int, chunk: int) -> None:
    rng = np.random.default_rng(n)
    q = rng.integers(0, 1 << 32, n + chunk - 1, dtype=np.uint64).astype(np.uint32)
    base = int(rng.integers(2, P - 1))
    qt_shape, out_shape = scratch_shapes(n, chunk)
    fps = window_fingerprints(
        q, 0, n, chunk, base, pow(base, chunk, P), np.empty(qt_shape, np.uint32),
        np.empty(out_shape, np.uint64),
    )  # fmt: skip
    rolled = fps.T.reshape(-1)[:n]  # lane-major -> window order
    direct = [kernels.fingerprint(q, p, chunk, base, P) for p in range(n)]
    assert rolled.tolist() == direct


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 3000),
    st.integers(0, 200),
    st.integers(1, 200),
    st.integers(0, 400),
    st.sampled_from(["contiguous", "strided query", "strided scratch"]),
)
def test_lane_load_equals_the_clamped_transpose(
    m: int, start: int, blk: int, rows: int, layout: str
) -> None:
    """The tiled copy and the clamped rows together are the definition, at every size: rows
    wholly inside the query, rows past its end, tiles cut short; through pointers (both
    arrays contiguous) and by index (either one strided)."""
    wide = np.random.default_rng(m).integers(0, 1 << 32, 2 * m, dtype=np.uint64).astype(np.uint32)
    q = wide[::2] if layout == "strided query" else wide[:m].copy()
    if layout == "strided scratch":
        qt = np.zeros((rows + 1, 2 * kernels.LANES), np.uint32)[:, ::2]
    else:
        qt = np.zeros((rows + 1, kernels.LANES), np.uint32)
    got = kernels.lane_load(q, start, blk, rows, qt)
    r, j = np.meshgrid(np.arange(rows), np.arange(kernels.LANES), indexing="ij")
    want = q[np.minimum(start + j * blk + r, m - 1)]
    assert got.shape == (rows, kernels.LANES)
    assert np.array_equal(got, want)
    assert not qt[rows].any()  # nothing written past rows


def test_lane_load_refuses_a_scratch_too_small() -> None:
    q = np.arange(1000, dtype=np.uint32)
    with pytest.raises(ValueError, match="fewer rows"):
        kernels.lane_load(q, 0, 10, 40, np.zeros((39, kernels.LANES), np.uint32))
    with pytest.raises(ValueError, match="LANES columns"):
        kernels.lane_load(q, 0, 10, 40, np.zeros((40, kernels.LANES - 1), np.uint32))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120))
def test_claim_set_equals_a_python_set(ops: list[tuple[bool, int]]) -> None:
    """Small table, keys crowded into few homes: long probe runs, wrap-around, and every
    delete shifting entries back; every key stays findable."""
    claims = np.full(64, -1, np.int64)
    want: set[int] = set()
    for insert, k in ops:
        key = int(table.claim_key(k % 5, k))
        if insert and len(want) < 32:  # the index keeps the load <= 1/2
            assert table.claims_insert(claims, key) == (key not in want)
            want.add(key)
        elif not insert:
            assert table.claims_delete(claims, key) == (key in want)
            want.discard(key)
        assert {int(k) for k in claims if k != -1} == want
        assert all(table.claims_contains(claims, k) for k in want)


def test_freed_ids_are_reused() -> None:
    index = BlendIndex(chunk_size=4)
    ns = BlendNamespace("m")
    contents = np.arange(4 * 1500, dtype=np.uint32).reshape(-1, 4)
    for round_ in range(3):
        index.add_many(
            [(c, bytes([round_]) + i.to_bytes(4, "big"), 0, ns) for i, c in enumerate(contents)]
        )
        index.remove_claims(
            [(c, bytes([round_]) + i.to_bytes(4, "big"), ns) for i, c in enumerate(contents)]
        )
    stats = index.stats()
    assert (stats.contents, stats.occupants) == (0, 0)
    # one batch of 1,500 adds grows the capacity to exactly what it needs; the next rounds
    # reuse the freed ids instead of growing it
    assert (stats.content_capacity, stats.occupant_capacity) == (1500, 1500)
