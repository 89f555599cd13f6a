"""Fencing by columns (``RemovalRules._fence_plain``): the chunks an instance alone holds in
L1 under one key are fenced without a record built per chunk, their index claims dropped as
one ``RemoveClaimColumns`` and settled as columns (``blend/drops.py``); every other chunk
one by one. Held to the one-by-one paths (the reference: the same steps with both columns
paths turned off) and to the op-by-op index."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

import kvatlas.directory.blend.state as state_module
from kvatlas.directory import BlendIndex, KeyDirectory, RemoveClaimColumns, RemoveClaimOp
from kvatlas.directory.blend.kernels import REMOVE_CLAIM
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import (
    CS,
    Emitter,
    entry,
    key,
    live_records,
    occupant_hashes,
    records_built,
    toks,
)
from tests.directory.test_l1_owners import INSTANCES, PLACES, Fleet, check, program, run
from tests.directory.test_snapshot_capture import restored_from

NS = BlendNamespace("m", "", 1)


_REFERENCE: weakref.WeakSet[Any] = weakref.WeakSet()  # index states settling op by op


def one_by_one(d: KeyDirectory) -> KeyDirectory:
    """``d`` with the columns paths turned off: every chunk fenced one by one, every dropped
    claim of its index settled op by op (:func:`_reference_drops_one_by_one`)."""

    def none_plain(inst: str, hashes: list[bytes], rows: list[int]) -> tuple[int, list[bytes]]:
        return 0, hashes

    d._chunks.removals._fence_plain = none_plain  # type: ignore[method-assign]
    if d._index is not None:
        _REFERENCE.add(d._index._state)
    return d


@pytest.fixture(autouse=True)
def _reference_drops_one_by_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = state_module.settle_drops

    def settle(st: Any, flags: Any, contents: Any, occupants: Any, nss: Any) -> None:
        if st in _REFERENCE:  # (ns0, the results' last column, is read by chunk removals only)
            results = zip(
                flags.tolist(), contents.tolist(), occupants.tolist(), nss.tolist(), strict=True
            )
            for flag, cid, occ, ns in results:
                st._settle_removal(REMOVE_CLAIM, flag, cid, occ, -1, ns)
        else:
            real(st, flags, contents, occupants, nss)

    monkeypatch.setattr(state_module, "settle_drops", settle)
    (tmp_path / "fast").mkdir()
    (tmp_path / "slow").mkdir()


def state(d: KeyDirectory) -> tuple[Any, ...]:
    """What a reader can see of ``d``: records, statistics, usage, digests, blend matches."""
    digests = {
        (inst, tier): d.digest(inst, tier) for inst in INSTANCES for tier in ("l1", "gpu", "l2")
    }
    query = np.concatenate([toks(n, n, n, n) for n in range(1, 25)])
    matches = sorted((m.chunk_hash, m.cur_st, m.old_st) for m in d.blend_match(query, NS))
    return live_records(d), d.stats(), d.usage(), digests, matches, index_state(d)


def index_state(d: KeyDirectory) -> tuple[Any, ...]:
    """What the blend index keeps beside its arrays, whatever ids it handed out: the live
    contents and hashes it holds alive, its counters, each namespace's claims."""
    assert d._index is not None
    s = d._index._state
    ns = s.namespaces
    return (
        sorted(t for t in s.tokens if t is not None),
        sorted(h for h in occupant_hashes(s) if h is not None),
        (s.contents, s.occupants, s.claims, s.token_bytes, s.owned_bytes, s.n_extra),
        {name: ns.claims[i] for name, i in ns._ids.items()},
    )


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=program())
@example(  # chunks in L1 and L2 of one instance, their placements shared after a restore
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3]),
        ("move", "a", [1, 2, 3]),
        ("store", "a", PLACES[0], [1, 2, 3]),
        ("snapshot",),
        ("fence", "a"),
    ]
)
@example(  # a batch's chunks in L1 and L2 of one instance
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3]),
        ("store", "a", PLACES[2], [2, 3]),
        ("store", "b", PLACES[1], [3, 4]),
        ("fence", "a"),
        ("store", "a", PLACES[0], [5, 6, 1]),
    ]
)
def test_fencing_by_columns_equals_fencing_one_by_one(
    steps: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    fast, fleets = KeyDirectory(CS, enable_blend_lookup=True), (Fleet(), Fleet())
    slow = one_by_one(KeyDirectory(CS, enable_blend_lookup=True))
    for step in [*steps, *(("fence", inst) for inst in INSTANCES)]:
        fast = run(fast, fleets[0], step, tmp_path / "fast")
        slow = one_by_one(run(slow, fleets[1], step, tmp_path / "slow"))
        assert state(fast) == state(slow), step
        check(fast)
    again = ("store", "a", PLACES[0], list(range(1, 25)))  # freed rows reused
    assert state(run(fast, fleets[0], again, tmp_path)) == state(
        run(slow, fleets[1], again, tmp_path)
    )


def test_a_fence_builds_no_record_of_the_chunks_the_instance_alone_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, a, b = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a"), Emitter("b")
    d.consume(a.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 31)]))
    d.consume(a.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(31, 41)]))
    d.consume(a.batch("store", [entry(key(n)) for n in range(1, 4)], tier="l2", backend="fs"))
    d.consume(b.batch("store", [entry(key(n)) for n in range(38, 41)]))  # two L1 owners
    built = records_built(monkeypatch)
    assert d.fence_instance("a") == 40
    assert len(built) == 3  # the chunks b also holds in L1, one by one; none of the others
    monkeypatch.undo()
    assert d.stats().chunks == 6 and d.stats().keys == 6  # L2 copies and b's stay
    assert [len(kp.placements) for kp in d.lookup([key(n) for n in (1, 4, 38)])] == [1, 0, 1]
    query = np.concatenate([toks(n, n, n, n) for n in range(1, 41)])
    assert sorted(m.chunk_hash[0] for m in d.blend_match(query, NS)) == [1, 2, 3, 38, 39, 40]


def test_removed_claims_as_columns_equal_the_ops_they_stand_for() -> None:
    contents = [toks(n, n + 1, n + 2, n + 3) for n in range(0, 40, 4)]
    hashes = [bytes([n]) * 32 for n in range(10)]
    other = BlendNamespace("m", "t", 1)
    built = []
    for removals in (
        [
            RemoveClaimOp(t, h, ns)
            for t, h, ns in zip(contents, hashes, [NS, other] * 5, strict=True)
        ],
        [RemoveClaimColumns(contents, hashes, [NS, other], [0, 1] * 5)],
        [RemoveClaimColumns(contents, hashes, [NS, other], np.array([0, 1] * 5), vouched=True)],
    ):
        index = BlendIndex(4)
        index.add_many(
            [(t, h, 0, ns) for t, h in zip(contents, hashes, strict=True) for ns in (NS, other)]
        )
        index.apply(removals)
        query = np.concatenate(contents)
        built.append(
            (
                index.stats(),
                sorted((m.chunk_hash, m.cur_st) for m in index.match(query, NS)),
                sorted((m.chunk_hash, m.cur_st) for m in index.match(query, other)),
            )
        )
    assert built[0] == built[1] == built[2]
    assert len(built[0][1]) == 5 and len(built[0][2]) == 5  # each kept the other claim


def test_unvouched_removed_claims_are_checked_and_apply_nothing_when_one_is_invalid() -> None:
    index = BlendIndex(4)
    index.add_many([(toks(1, 2, 3, 4), b"h" * 32, 0, NS)])
    before = index.stats()
    with pytest.raises(ValueError):
        index.apply(
            [RemoveClaimColumns([toks(1, 2, 3, 4), toks(5, 6, 7, 8)], [b"h" * 32, b"x" * 33], [NS])]
        )
    with pytest.raises(ValueError):  # columns of different lengths
        index.apply([RemoveClaimColumns([toks(1, 2, 3, 4)], [b"h" * 32, b"g" * 32], [NS])])
    assert index.stats() == before


def test_placements_several_chunks_share_are_kept_for_each_of_them() -> None:
    """A group of chunks sharing one placements value with copies that survive the fence
    (what a restore may hand the table: records are adopted as they are)."""
    d, a = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    d.consume(a.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 6)]))
    d.consume(a.batch("store", [entry(key(n)) for n in range(1, 6)], tier="l2", backend="fs"))
    restored = restored_from(d)
    shared: dict[Any, Any] = {}
    for part in restored.parts:
        for h, rec in part.items():
            part[h] = (*rec[:4], shared.setdefault(rec[4], rec[4]))
    assert len(shared) == 1  # one value, five chunks
    fast, slow = (
        KeyDirectory(CS, enable_blend_lookup=True),
        KeyDirectory(CS, enable_blend_lookup=True),
    )
    fast.install(restored)
    one_by_one(slow).install(restored_from(fast))
    assert fast.fence_instance("a") == slow.fence_instance("a") == 5
    assert state(fast) == state(slow)
    assert [len(kp.placements) for kp in fast.lookup([key(n) for n in range(1, 6)])] == [1] * 5
