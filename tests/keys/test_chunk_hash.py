"""Chunk hashes: bit-exact against known LMCache vectors (formula in docs/keys.md), chaining,
incremental extension, determinism."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.keys import NONE_HASH, ChunkHashChain, chunk_hashes, segment_hashes
from tests.torch_support import require_torch

VECTOR_600 = [
    "084547b6c40ed5b05ba8cd0305db5bf74d5617673948d9ed193ab7d6cbc484d4",
    "e5ffee45c2b9db326814c9692dc594369887ba3b0df5761817820b60f864c8e0",
]
VECTOR_C4 = "6309ed506b8721905753f5c73c070bb21c3aafbd9b474b1e231f41368b71123c"


def naive_chunk_hashes(tokens: list[int], chunk_size: int) -> list[bytes]:
    """Oracle: per-token big-endian packing, straight from the formula in docs/keys.md."""
    out, prev = [], NONE_HASH
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        prev = blake3(prev + b"".join(t.to_bytes(4, "big") for t in chunk)).digest()
        out.append(prev)
    return out


def test_none_hash_vector() -> None:
    assert NONE_HASH.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"


@pytest.mark.parametrize(
    "tokens",
    [
        list(range(600)),
        np.arange(600, dtype=np.int64),
        np.arange(600, dtype=np.uint32),
        tuple(range(600)),
    ],
    ids=["list", "int64", "uint32", "tuple"],
)
def test_vector_600_tokens_any_container(tokens: object) -> None:
    assert [h.hex() for h in chunk_hashes(tokens, 256)] == VECTOR_600


def test_vector_torch_tensor() -> None:
    torch = require_torch()
    assert [h.hex() for h in chunk_hashes(torch.arange(600), 256)] == VECTOR_600


def test_vector_chunk_size_4() -> None:
    assert [h.hex() for h in chunk_hashes([1, 2, 3, 4, 5], 4)] == [VECTOR_C4]


def test_default_chunk_size_is_256() -> None:
    assert [h.hex() for h in chunk_hashes(list(range(600)))] == VECTOR_600


def test_partial_chunk_has_no_hash() -> None:
    assert chunk_hashes(list(range(255)), 256) == []
    assert chunk_hashes([], 256) == []
    assert len(chunk_hashes(list(range(512)), 256)) == 2


@pytest.mark.parametrize("bad", [-1, 1 << 32, 1 << 70])
def test_out_of_range_token_is_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        chunk_hashes([1, 2, bad, 4], 4)


def test_out_of_range_numpy_is_value_error() -> None:
    with pytest.raises(ValueError, match="outside"):
        chunk_hashes(np.array([1, -5, 3, 4], dtype=np.int32), 4)


@pytest.mark.parametrize("bad", [[1.5, 2.0], ["a", "b"], np.zeros((2, 2), dtype=np.int64)])
def test_non_integer_tokens_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        chunk_hashes(bad, 1)


@pytest.mark.parametrize(
    "tokens",
    [[True, False, True, False], [np.bool_(True), 2, 3, 4], [1, 2, True, 4], (5, 6, 7, False)],
    ids=["bools", "numpy-bool-first", "bool-among-ints", "tuple"],
)
def test_bool_tokens_in_a_list_are_refused_as_numpy_bool_arrays_are(tokens: object) -> None:
    """``True`` is the int 1 to Python, never a token id to kvatlas: a list or tuple holding a
    bool is refused as a numpy bool array is (it used to hash as the ids 0/1)."""
    with pytest.raises(ValueError, match="integers"):
        chunk_hashes(np.array([True, False, True, False]), 4)
    with pytest.raises(ValueError, match="integers"):
        chunk_hashes(tokens, 4)
    with pytest.raises(ValueError, match="integers"):
        ChunkHashChain(4).update(tokens)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_chunk_size(size: object) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_hashes([1, 2], size)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, (1 << 32) - 1), max_size=70),
    chunk_size=st.integers(1, 9),
)
def test_matches_naive_oracle(tokens: list[int], chunk_size: int) -> None:
    assert chunk_hashes(tokens, chunk_size) == naive_chunk_hashes(tokens, chunk_size)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=60),
    cut=st.integers(0, 60),
    chunk_size=st.integers(1, 8),
)
def test_prefix_chain_property(tokens: list[int], cut: int, chunk_size: int) -> None:
    """Hashes of a prefix are a prefix of the hashes: the chain extends, it never restarts."""
    full = chunk_hashes(tokens, chunk_size)
    assert chunk_hashes(tokens[:cut], chunk_size) == full[: min(cut, len(tokens)) // chunk_size]


def test_chain_depends_on_prefix() -> None:
    a = chunk_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = chunk_hashes([1, 2, 3, 5, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


def test_incremental_chain_extends_without_rehashing() -> None:
    tokens = np.arange(10 * 16, dtype=np.uint32)
    chain = ChunkHashChain(16)
    assert chain.update(tokens[:40]) == chunk_hashes(tokens[:40], 16)
    assert chain.chunks_hashed == 2
    assert chain.update(tokens) == chunk_hashes(tokens, 16)
    assert chain.chunks_hashed == 10  # 2 + 8: the first two were not recomputed
    assert chain.update(tokens) == chunk_hashes(tokens, 16)
    assert chain.chunks_hashed == 10


def test_incremental_chain_recomputes_from_first_changed_chunk() -> None:
    tokens = np.arange(8 * 16, dtype=np.uint32)
    chain = ChunkHashChain(16)
    chain.update(tokens)
    edited = tokens.copy()
    edited[5 * 16 + 3] = 999_999
    assert chain.update(edited) == chunk_hashes(edited, 16)
    assert chain.chunks_hashed == 8 + 3  # chunks 5, 6, 7 again
    assert chain.update(edited[: 3 * 16]) == chunk_hashes(edited[:48], 16)


def test_segment_hashing_is_position_independent() -> None:
    doc = list(range(100, 132))
    other = list(range(500, 516))
    first = segment_hashes([doc, other], 16)
    second = segment_hashes([other, doc], 16)
    assert first[0] == second[1] == chunk_hashes(doc, 16)
    assert first[1] == second[0]


def test_identical_in_fresh_subprocess() -> None:
    """No per-process state (Python hash(), random seeds) may enter a key."""
    code = (
        "from kvatlas.keys import chunk_hashes, mm_hash_to_token_values\n"
        "print(chunk_hashes(list(range(1000)), 256)[-1].hex())\n"
        "print(mm_hash_to_token_values(('img', 7), 20))\n"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout
        for seed in (1, 2)
    }
    from kvatlas.keys import mm_hash_to_token_values

    here = f"{chunk_hashes(list(range(1000)), 256)[-1].hex()}\n{mm_hash_to_token_values(('img', 7), 20)}\n"
    assert runs == {here}


def test_incremental_chain_is_not_fooled_by_a_read_only_view_of_a_writable_buffer() -> None:
    """The chain keeps a view only of truly immutable tokens; a read-only view whose buffer
    is later edited must still be re-verified against a private copy."""
    buffer = np.arange(4 * 16, dtype=np.uint32)
    view = buffer[:]
    view.setflags(write=False)
    chain = ChunkHashChain(16)
    chain.update(view)
    buffer[20] = 777_777  # edits chunk 1 behind the view's back
    assert chain.update(view) == chunk_hashes(buffer, 16)
