"""The blend index keeps its occupants' chunk_hashes by value (``kernels/layout.py``: the
``o_i64`` row from ``O_HASH`` on), not as references to the writers' ``bytes``: after a
write returns, the index holds no reference to the hash it was given (its reference count is
what it was before), and matches return the right hashes after the writers' objects are
freed and their memory reused. Each write path: a single write (``apply_one``), a batch as
columns (``AddColumns``), a batch of ops, a bulk build (a restore's) and the general build.
"""

from __future__ import annotations

import gc
import inspect
import os
import sys
from collections.abc import Callable

import numpy as np
import pytest

from kvatlas.directory import AddColumns, AddOp, BlendIndex, RemoveChunkOp
from kvatlas.directory.blend.kernels.layout import HASH_WIDTH, IDS_OCCUPANTS, O_HASH
from kvatlas.keys import BlendMatch, BlendNamespace
from tests.directory.test_blend_bulk_build import bulk_builds

C = 8
NS = BlendNamespace("model-a")
LENGTHS = (32, 31, 9, 8, 1)
"""Hash lengths the tests write: full width, one short of it, around one word, one byte."""


def contents(n: int) -> list[np.ndarray]:
    """``n`` distinct chunks (read-only, owning: kept as they are), ids that fit no 16 bits."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        a = rng.integers(70_000, 128_256, C, dtype=np.uint32)
        a.flags.writeable = False
        out.append(a)
    return out


def fresh_hashes(n: int) -> list[bytes]:
    """``n`` distinct hashes, each a new object (never interned or shared), of lengths
    cycling through :data:`LENGTHS` (drawn again on a repeat: two random one-byte hashes are
    equal one time in 256, and a match reports each hash once)."""
    out: list[bytes] = []
    while len(out) < n:
        h = os.urandom(LENGTHS[len(out) % len(LENGTHS)])
        if h not in out:
            out.append(h)
    return out


def _single(index: BlendIndex, rows: list[np.ndarray], hashes: list[bytes]) -> None:
    for i, (r, hh) in enumerate(zip(rows, hashes, strict=True)):
        index.add(r, hh, C * i, NS)


def _columns(index: BlendIndex, rows: list[np.ndarray], hashes: list[bytes]) -> None:
    offsets = np.arange(len(rows), dtype=np.int64) * C
    index.apply([AddColumns(rows, hashes, offsets, [NS])])


def _ops(index: BlendIndex, rows: list[np.ndarray], hashes: list[bytes]) -> None:
    index.apply(
        [AddOp(r, hh, C * i, NS) for i, (r, hh) in enumerate(zip(rows, hashes, strict=True))]
    )


def _bulk(index: BlendIndex, rows: list[np.ndarray], hashes: list[bytes]) -> None:
    from kvatlas.directory.token_store import stored_one

    stored = [stored_one(r) for r in rows]  # (the bulk path takes the directory's contents)
    offsets = np.arange(len(rows), dtype=np.int64) * C
    with bulk_builds() as taken:
        index.build(AddColumns(stored, hashes, offsets, [NS], vouched=True))
    assert taken == [True]  # the bulk path


def _general_build(index: BlendIndex, rows: list[np.ndarray], hashes: list[bytes]) -> None:
    offsets = np.arange(len(rows), dtype=np.int64) * C
    index.build(AddColumns(rows, hashes, offsets, [NS]))


WRITES: dict[str, Callable[[BlendIndex, list[np.ndarray], list[bytes]], None]] = {
    "single": _single,
    "columns": _columns,
    "ops": _ops,
    "bulk build": _bulk,
    "general build": _general_build,
}


@pytest.mark.parametrize("path", WRITES)
def test_a_write_keeps_no_reference_to_the_callers_hashes(path: str) -> None:
    n = 3 * len(LENGTHS)
    rows, hashes = contents(n), fresh_hashes(n)
    before = [sys.getrefcount(hh) for hh in hashes]
    index = BlendIndex(chunk_size=C)
    WRITES[path](index, rows, hashes)
    assert index.stats().occupants == n
    assert [sys.getrefcount(hh) for hh in hashes] == before
    for hh in hashes:  # nothing but the test's list (and this frame) refers to it
        held = [r for r in gc.get_referrers(hh) if r is not hashes and not inspect.isframe(r)]
        assert held == []


@pytest.mark.parametrize("path", WRITES)
def test_matches_return_the_hashes_after_the_callers_objects_are_gone(path: str) -> None:
    n = 4 * len(LENGTHS)
    rows, hashes = contents(n), fresh_hashes(n)
    expected = [bytes(bytearray(hh)) for hh in hashes]  # equal values, other objects
    index = BlendIndex(chunk_size=C)
    WRITES[path](index, rows, hashes)
    del hashes
    gc.collect()
    # the freed objects' memory taken by others of the same sizes, other bytes
    reuse = [bytes([0xA5]) * LENGTHS[i % len(LENGTHS)] for i in range(4 * n)]
    query = np.concatenate(rows)
    got = {(m.chunk_hash, m.cur_st, m.old_st) for m in index.match(query, NS)}
    assert got == {(hh, C * i, C * i) for i, hh in enumerate(expected)}
    assert sorted(index.match_columns(query, NS).chunk_hashes()) == sorted(expected)
    assert len(reuse) == 4 * n


@pytest.mark.parametrize("path", ["single", "columns"])
def test_removals_find_the_occupants_by_the_stored_hashes(path: str) -> None:
    """A removal is given a new ``bytes`` equal to the stored hash (the one written is
    gone): the occupant is found by value and removed; one that differs in its last byte,
    or is a zero byte longer (the row's padding), finds nothing."""
    n = 2 * len(LENGTHS)
    rows, hashes = contents(n), fresh_hashes(n)
    equal = [bytes(bytearray(hh)) for hh in hashes]
    index = BlendIndex(chunk_size=C)
    WRITES[path](index, rows, hashes)
    del hashes
    gc.collect()
    for row, hh in zip(rows, equal, strict=True):
        near = [hh[:-1] + bytes([hh[-1] ^ 1])] + ([hh + bytes(1)] if len(hh) < HASH_WIDTH else [])
        index.apply([RemoveChunkOp(row, other) for other in near])
    assert index.stats().occupants == n
    for k in range(0, n, 2):
        index.remove_chunk(rows[k], bytes(bytearray(equal[k])))
    kept = {m.chunk_hash for m in index.match(np.concatenate(rows), NS)}
    assert kept == {equal[k] for k in range(1, n, 2)}
    assert index.stats().occupants == n // 2


def test_a_reused_occupant_row_keeps_nothing_of_its_last_hash() -> None:
    """An occupant id freed by a removal and taken by a shorter hash: the row is zero past
    the new hash (nothing of the longer one left), and the match returns the short one."""
    index = BlendIndex(chunk_size=C)
    (a,) = contents(1)
    long, short = b"\xff" * HASH_WIDTH, b"\xff" * 5
    index.add(a, long, 0, NS)
    index.remove_chunk(a, long)
    index.add(a, short, 8, NS)
    assert index.match(a, NS) == [BlendMatch(short, 8, 0)]
    arrays = index._state.arrays
    assert int(arrays.ids[IDS_OCCUPANTS]) == 1  # the one id, reused
    assert arrays.o_hlen[0] == len(short)
    assert arrays.o_i64[0, O_HASH:].tobytes() == short + bytes(HASH_WIDTH - len(short))
