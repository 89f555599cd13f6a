"""Saved content fingerprints (snapshot version 4): a restore that takes them answers blend
matches exactly as the saved directory and the brute-force oracle do, for contents of every
stored form; a column that is corrupt, under another function or bits, or that does not match
the token ids is recomputed or refused (damage, not forgery: docs/directory.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import BlendIndex, KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.blend.fingerprints import FingerprintKey
from kvatlas.directory.blend.kernels.modhash import MERSENNE61, SCHEME
from kvatlas.directory.records import record_indexed
from kvatlas.directory.snapshot.format import PREFIX, Header, SnapshotError
from kvatlas.directory.token_store import stored_batch
from tests.directory.helpers import CS, Emitter, captured, sealed
from tests.directory.test_snapshot_restore import apply, assert_same_answers, view

FORMS = [7, (1 << 16) + 5, (1 << 24) + 3]  # uint16, the planes form, uint32

token_ids = st.one_of(st.integers(0, 40), st.sampled_from(FORMS[1:]))
store_entries = st.lists(
    st.tuples(
        st.integers(1, 12),
        st.sampled_from([("m", ""), ("m", "s"), ("m2", "")]),
        st.one_of(st.none(), st.lists(token_ids, min_size=CS, max_size=CS)),
        st.sampled_from([-1, 0, 8]),
    ),
    max_size=8,
)
ops = st.lists(
    st.tuples(
        st.just("store"),
        st.sampled_from(["a", "b"]),
        st.sampled_from([("l1", False), ("l2", True)]),
        store_entries,
    ),
    max_size=8,
)


def key_of(d: KeyDirectory) -> FingerprintKey:
    index = d._index  # which fingerprints the index uses
    assert index is not None
    return index.fingerprint_key


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(program=ops)
def test_a_restore_from_saved_fingerprints_answers_as_the_saved_directory_and_the_oracle(
    tmp_path: Path, program: list[Any]
) -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    apply([d], {"a": Emitter("a"), "b": Emitter("b")}, program)
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    if any(map(record_indexed, captured(d).values())):  # the saved ones were taken (the
        # records' contents: a chunk of several salts has per-salt bindings instead)
        assert key_of(restored) == key_of(d)
    assert view(restored) == view(d)
    assert_same_answers(restored, d)


def directory_of_every_form(factory: Any = BlendIndex) -> KeyDirectory:
    d = KeyDirectory(CS, enable_blend_lookup=True, blend_index_factory=factory)
    rows = [(n, ("m", ""), [FORMS[n % 3], n, n + 1, 2], 4 * n) for n in range(1, 10)]
    rows.append((10, ("m2", ""), [FORMS[2], 1, 2, 2], 0))  # a content two chunks share
    apply([d], {"a": Emitter("a")}, [("store", "a", ("l1", False), rows)])
    return d


def rewrite(path: Path, **fields: Any) -> None:
    """The file at ``path`` with header ``fields`` replaced (the token section unchanged), its
    checksums made again (:func:`sealed`: the checks tested here are those behind them)."""
    raw = path.read_bytes()
    _, n = PREFIX.unpack_from(raw)
    header = msgspec.msgpack.decode(raw[PREFIX.size : PREFIX.size + n], type=Header[bytes])
    encoded = msgspec.msgpack.encode(msgspec.structs.replace(header, **fields))
    path.write_bytes(sealed(PREFIX.pack(raw[:8], len(encoded)) + encoded + raw[PREFIX.size + n :]))


def header_of(path: Path) -> Header[bytes]:
    raw = path.read_bytes()
    _, n = PREFIX.unpack_from(raw)
    return msgspec.msgpack.decode(raw[PREFIX.size : PREFIX.size + n], type=Header[bytes])


def saved(tmp_path: Path) -> tuple[KeyDirectory, Path, Header[bytes]]:
    d = directory_of_every_form()
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    return d, path, header_of(path)


def test_a_corrupt_fingerprint_column_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    _, path, header = saved(tmp_path)
    column = bytearray(header.chunk_fingerprints)
    column[3] ^= 1
    rewrite(path, chunk_fingerprints=bytes(column))
    target = directory_of_every_form()
    before = view(target)
    with pytest.raises(SnapshotError, match="corrupt fingerprint column"):
        load_snapshot(target, path)
    assert view(target) == before
    rewrite(path, chunk_fingerprints=bytes(column[:-8]))  # one fingerprint short
    with pytest.raises(SnapshotError, match="one fingerprint per chunk"):
        load_snapshot(target, path)


def test_fingerprints_that_are_not_the_contents_are_refused(tmp_path: Path) -> None:
    """A column whose digest holds (written so, or by a faulty writer) but whose values are
    not the contents' fingerprints: a sample recomputed from the token ids shows it."""
    _, path, header = saved(tmp_path)
    scheme, bits, base = header.fingerprint_key or ("", 0, 0)
    fps = np.frombuffer(header.chunk_fingerprints, "<u8").copy()
    live = fps != 0
    fps[live] ^= np.uint64(1)  # every saved value off by one bit
    key = FingerprintKey(scheme, CS, bits, base)
    rewrite(path, chunk_fingerprints=fps.tobytes(), fingerprint_digest=key.digest([fps.tobytes()]))
    target = KeyDirectory(CS, enable_blend_lookup=True)
    with pytest.raises(SnapshotError, match="does not match the token section"):
        load_snapshot(target, path)


@pytest.mark.parametrize("change", ["scheme", "bits", "base", "base 1", "base p-1"])
def test_fingerprints_under_another_key_are_recomputed_not_read(
    tmp_path: Path, change: str
) -> None:
    """Another function's name or an invalid or weak base (one the index never draws): the column is ignored (its values are
    garbage here); other bits (a valid column of a 40-bit index): the index does not take it.
    Either way the fingerprints are computed, and the answers are the oracle's."""
    d, path, header = saved(tmp_path)
    scheme, bits, base = header.fingerprint_key or ("", 0, 0)
    column = np.arange(len(header.chunk_fingerprints) // 8, dtype="<u8")
    if change == "bits":  # the fingerprints under 40 bits: the same residues, masked
        column = np.frombuffer(header.chunk_fingerprints, "<u8") & np.uint64((1 << 40) - 1)
    key = {
        "scheme": ("another-function/1", bits, base),
        "bits": (scheme, 40, base),
        "base": (scheme, bits, MERSENNE61),
        "base 1": (scheme, bits, 1),  # every permutation of a content would collide
        "base p-1": (scheme, bits, MERSENNE61 - 1),
    }[change]
    digest = FingerprintKey(key[0], CS, key[1], key[2]).digest([column.tobytes()])
    rewrite(
        path, fingerprint_key=key, chunk_fingerprints=column.tobytes(), fingerprint_digest=digest
    )
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    assert key_of(restored).base != base  # not adopted: a fresh base, fingerprints computed
    assert view(restored) == view(d)
    assert_same_answers(restored, d)


def test_an_index_of_other_bits_computes_its_own() -> None:
    """``build`` takes a column only under its own bits (a narrow test index here)."""

    def narrow(chunk_size: int, probe_stride: int) -> BlendIndex:
        return BlendIndex(chunk_size, probe_stride, _fingerprint_bits=8)

    target = directory_of_every_form(narrow)
    path = Path(__file__).parent / "data" / "snapshot-v4-fingerprints.snap"
    load_snapshot(target, path)
    assert key_of(target).bits == 8
    assert key_of(target).base != header_of(path).fingerprint_key[2]  # type: ignore[index]


def test_the_fingerprint_function_is_the_named_one() -> None:
    """``SCHEME`` names Σ w[i]·B^(n-1-i) mod 2^61-1, masked: the saved column's meaning.
    Checked against that formula for contents of every form (change it, change SCHEME)."""
    assert SCHEME == "poly-mod-2^61-1/1"
    rng = np.random.default_rng(5)
    for bits in (61, 20):
        for top in (1 << 16, 1 << 20, 1 << 32):
            ids = rng.integers(0, top, (6, 37), dtype=np.uint64).astype(np.uint32)
            base = int(rng.integers(2, MERSENNE61 - 1))
            key = FingerprintKey(SCHEME, 37, bits, base)
            got = key.of(stored_batch(list(ids)))
            for row, fp in zip(ids.tolist(), got.tolist(), strict=True):
                want = sum(t * pow(base, 36 - i, MERSENNE61) for i, t in enumerate(row))
                assert fp == want % MERSENNE61 & ((1 << bits) - 1)
