"""Deletes, accesses and re-stores by columns (``directory/key_groups.py``): the entries of a
``delete``, ``access`` or ``store`` batch whose chunk is held under one key (a store's: that
key, the content unchanged) are applied without a record built per chunk (grouped by that
key's placements; on a delete, the chunks left without placements removed in bulk); the
others entry by entry. Held to the entry-by-entry paths (the reference: the same steps with
the columns paths turned off), whatever the batch holds: repeats, other shapes, absent
chunks, shared copies, a capture in progress."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory
from kvatlas.directory.gate import Outcome
from kvatlas.directory.key_groups import KeyGroups
from kvatlas.events import EventBatch
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, entry, key, records_built, toks
from tests.directory.test_fence_columns import state as fence_state
from tests.directory.test_l1_owners import INSTANCES, PLACES, Fleet, check, run

VARIANTS = ("same", "same", "bigger", "no tokens", "offset unknown", "other offset",
            "other tokens", "shorter")  # fmt: skip
"""How a store entry of a chunk again differs from its first (:func:`restored_entry`)."""
NS = BlendNamespace("m", "", 1)
SALTS = ("", "x", "never-stored")
"""Key shapes a delete names: the L1 one, the L2 one (a chunk's second key), one never
interned."""


def state(d: KeyDirectory) -> tuple[Any, ...]:
    """What a reader can see of ``d`` (the fence tests' view) and its L2 bytes by salt."""
    return (*fence_state(d), d.bytes_by_salt())


def entry_by_entry(d: KeyDirectory) -> KeyDirectory:
    """``d`` deleting, accessing and storing again entry by entry (the columns paths off)."""

    def none_plain(batch: Any, ident: Any, hashes: list[bytes], sids: Any) -> list[int]:
        return list(range(len(hashes)))

    def no_groups(kg: KeyGroups, accessed: Any) -> list[int]:
        return kg.held  # (every entry that names a held chunk, in order)

    def each(batch: Any, cols: Any, *rest: Any) -> tuple[range, int, int]:
        return range(len(cols)), 0, 0

    d._chunks.removals._delete_plain = none_plain  # type: ignore[method-assign]
    d._chunks._access_groups = no_groups  # type: ignore[method-assign]
    d._chunks.stores._store_plain = each  # type: ignore[method-assign]
    return d


@st.composite
def program(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Stores (one or two keys a chunk: the L2 copies are under another salt), moves, fences,
    snapshots, stores again that differ in every way (:data:`VARIANTS`), and deletes and
    accesses of any entries: repeats, other shapes, absent chunks."""
    chunks = st.lists(st.integers(1, 24), min_size=1, max_size=8, unique=True)
    doomed = st.lists(st.tuples(st.integers(1, 26), st.sampled_from(SALTS)), max_size=10)
    op = st.one_of(
        st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.sampled_from(PLACES), chunks),
        st.tuples(st.just("remove"), st.sampled_from(INSTANCES), st.sampled_from(PLACES), doomed),
        st.tuples(st.just("move"), st.sampled_from(INSTANCES), chunks),
        st.tuples(
            st.just("again"),
            st.sampled_from(INSTANCES),
            st.sampled_from(PLACES),
            st.lists(
                st.tuples(
                    st.integers(1, 26), st.sampled_from(VARIANTS), st.sampled_from(SALTS[:2])
                ),
                max_size=10,
            ),
        ),
        st.tuples(st.just("fence"), st.sampled_from(INSTANCES)),
        st.tuples(st.just("install")),
        st.tuples(st.just("snapshot")),
    )
    return draw(st.lists(op, min_size=1, max_size=25))


def restored_entry(n: int, variant: str, salt: str = "") -> Any:
    """A store entry of chunk ``n`` (its key of ``salt``) as a report of it again may differ
    from its first."""
    tokens: Any = toks(n, n, n, n)
    offset, size = 4 * n, 10
    if variant == "bigger":
        size = 20
    elif variant == "no tokens":
        tokens, offset = None, -1
    elif variant == "offset unknown":
        offset = -1
    elif variant == "other offset":
        offset = 4 * n + 1
    elif variant == "other tokens":
        tokens = toks(n, n, n, n + 1)
    elif variant == "shorter":
        tokens = toks(n, n, n)
    return entry(key(n, salt=salt), tokens, offset, size)


def step_on(d: KeyDirectory, fleet: Fleet, step: tuple[Any, ...], tmp: Path) -> KeyDirectory:
    if step[0] == "again":  # the same key of chunks reported again, as reports may differ
        _, inst, place, named = step
        es = [restored_entry(*e) for e in named]
        d.consume(fleet.batch(inst, "store", place, es))
        return d
    if step[0] not in ("remove", "touch"):
        return run(d, fleet, step, tmp)
    inst, place, named = step[1:4]
    es = [entry(key(n, salt=salt), toks(n, n, n, n), 4 * n) for n, salt in named]
    if step[0] == "remove":
        d.consume(fleet.batch(inst, "delete", place, es))
    else:
        fleet.seq[inst] += 1
        tier, backend, shared = place
        ts = float(step[4])
        d.consume(EventBatch(inst, fleet.inc[inst], fleet.seq[inst], "access", tier, backend,
                             shared, ts, tuple(es)))  # fmt: skip
    return d


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=program())
@example(  # one chunk named twice, then under a shape it is not held under
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3]),
        ("remove", "a", PLACES[0], [(1, ""), (1, ""), (2, "x"), (3, "never-stored")]),
    ]
)
@example(  # chunks in L1 and L2 (two keys), some of them only in L1, then shared copies
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3, 4]),
        ("move", "a", [1, 2]),
        ("store", "b", PLACES[3], [3, 4, 5]),
        ("remove", "a", PLACES[0], [(1, ""), (3, ""), (4, ""), (2, "x")]),
        ("remove", "b", PLACES[3], [(3, ""), (5, ""), (9, "")]),
        ("remove", "a", PLACES[2], [(1, "x"), (2, "x")]),
    ]
)
@example(  # restored records share one placements value among chunks
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3]),
        ("store", "b", PLACES[0], [2, 3]),
        ("snapshot",),
        ("remove", "a", PLACES[0], [(3, ""), (2, ""), (1, "")]),
        ("remove", "b", PLACES[0], [(2, "")]),
    ]
)
@example(  # accesses of one batch's chunks, repeated, then later, then of L2 copies
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3]),
        ("move", "a", [3]),
        ("touch", "a", PLACES[0], [(1, ""), (2, ""), (1, ""), (3, "")], 2),
        ("touch", "a", PLACES[0], [(2, ""), (9, "")], 1),
        ("touch", "a", PLACES[0], [(2, ""), (3, "x")], 3),
        ("touch", "a", ("l2", "", False), [(3, "x")], 4),
    ]
)
@example(  # chunks stored again: the same, bigger, by another, in L2, with other content
    steps=[
        ("store", "a", PLACES[0], [1, 2, 3, 4]),
        ("again", "a", PLACES[0], [(1, "same"), (2, "bigger"), (3, "no tokens"), (5, "same")]),
        ("again", "b", PLACES[0], [(1, "same"), (2, "same"), (4, "other tokens")]),
        ("again", "a", PLACES[2], [(1, "offset unknown"), (2, "other offset"), (1, "same")]),
        ("again", "c", PLACES[3], [(3, "shorter"), (2, "bigger"), (4, "same")]),
        ("remove", "a", PLACES[0], [(1, ""), (2, "")]),
    ]
)
@example(  # an L2 batch of two shapes stored again, bigger: L2 bytes counted per shape
    steps=[
        ("store", "a", PLACES[2], [1, 2]),
        ("store", "a", PLACES[0], [3]),
        ("move", "a", [3]),
        ("again", "a", PLACES[2], [(1, "bigger", "x"), (3, "bigger", ""), (2, "same", "x")]),
    ]
)
@example(  # one key's copies of two instances and two tiers: only the reporter's are touched
    steps=[
        ("store", "a", PLACES[0], [1, 2]),
        ("store", "b", PLACES[0], [1, 2]),
        ("store", "a", PLACES[1], [2]),
        ("touch", "a", PLACES[0], [(1, ""), (2, "")], 2),
        ("touch", "b", PLACES[3], [(1, "")], 3),
    ]
)
def test_deletes_accesses_and_restores_by_columns_equal_them_entry_by_entry(
    steps: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    (tmp_path / "fast").mkdir(exist_ok=True)
    (tmp_path / "slow").mkdir(exist_ok=True)
    fast, fleets = KeyDirectory(CS, enable_blend_lookup=True), (Fleet(), Fleet())
    slow = entry_by_entry(KeyDirectory(CS, enable_blend_lookup=True))
    for step in steps:
        fast = step_on(fast, fleets[0], step, tmp_path / "fast")
        slow = entry_by_entry(step_on(slow, fleets[1], step, tmp_path / "slow"))
        assert state(fast) == state(slow), step
        check(fast)
    again = ("store", "a", PLACES[0], list(range(1, 25)))  # freed rows reused
    assert state(run(fast, fleets[0], again, tmp_path)) == state(
        run(slow, fleets[1], again, tmp_path)
    )


def unbatched(seen: tuple[Any, ...]) -> tuple[Any, ...]:
    """:func:`state` but for the count of batches applied."""
    return (seen[0], replace(seen[1], batches={}), *seen[2:])


def _stored(d: KeyDirectory, a: Emitter) -> None:
    d.consume(a.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 31)]))
    d.consume(a.batch("store", [entry(key(n, salt="x")) for n in range(1, 4)], tier="l2"))


def test_a_delete_builds_no_record_of_the_chunks_held_under_one_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, a = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    _stored(d, a)
    built = records_built(monkeypatch)
    d.consume(a.batch("delete", [entry(key(n)) for n in range(1, 31)]))
    assert len(built) == 3  # the chunks under two keys (an L2 copy under salt "x")
    monkeypatch.undo()
    stats = d.stats()
    assert (stats.chunks, stats.keys, stats.placements) == (3, 3, 3)
    assert [len(kp.placements) for kp in d.lookup([key(n, salt="x") for n in (1, 2, 3)])] == [1] * 3


def test_a_delete_while_a_capture_is_open_saves_each_record_first() -> None:
    d, a = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    _stored(d, a)
    before = {h: rec for part in d._chunks.parts for h, rec in part.items()}
    with d.capture() as capture:
        d.consume(a.batch("delete", [entry(key(n)) for n in range(1, 31)]))
        taken = {h: rec for part in capture.parts() for h, rec in part.records()}
    assert taken == before  # the capture sees the directory as it was when it began
    assert d.stats().chunks == 3


def test_a_delete_batch_of_unknown_shapes_and_absent_chunks_changes_nothing() -> None:
    d, a = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    _stored(d, a)
    before = unbatched(state(d))
    es = [entry(key(n, salt="never-stored")) for n in range(1, 5)] + [entry(key(40))]
    d.consume(a.batch("delete", es))
    d.consume(a.batch("delete", [entry(key(1))], tier="l2"))  # a copy it does not hold there
    assert d.consume(a.batch("delete", [])) is Outcome.APPLIED  # (no entries)
    assert unbatched(state(d)) == before


def test_an_access_builds_no_record_and_leaves_a_batch_sharing_one_placements_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entry by entry, an access gave every chunk a placements value of its own (≈100 B
    each); by groups, the chunks a batch stored share the accessed one as they shared the
    stored one."""
    d, a = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    _stored(d, a)
    built = records_built(monkeypatch)
    d.consume(a.batch("access", [entry(key(n)) for n in range(1, 31)], ts=5.0))
    assert len(built) == 3  # the chunks under two keys
    monkeypatch.undo()
    cols = d._chunks.parts[0].cols
    rows = [d._chunks.parts[n].row[bytes([n]) * 32] for n in range(4, 31)]
    values = {id(v) for v in cols.fields(rows)[2]}
    assert len(values) == 1
    looked = d.lookup([key(n) for n in range(1, 31)])
    assert {p.last_access for kp in looked for p in kp.placements} == {5.0}


def test_a_store_again_indexes_what_was_bound_before_blend_was_on() -> None:
    """A re-store that binds nothing new stays on the columns path, but one that indexes a
    chunk bound before blend was on takes the entry-by-entry path (which queues its add)."""
    built = []
    for d in (KeyDirectory(CS), entry_by_entry(KeyDirectory(CS))):
        a = Emitter("a")
        es = [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 9)]
        d.consume(a.batch("store", es))
        d.enable_blend_lookup()
        d.consume(a.batch("store", es[:4], tier="l2", backend="fs"))
        d.consume(a.batch("store", [entry(key(n)) for n in range(5, 9)], tier="l2", backend="fs"))
        query = np.concatenate([toks(n, n, n, n) for n in range(1, 9)])
        matches = sorted(m.chunk_hash[0] for m in d.blend_match(query, NS))
        assert matches == [1, 2, 3, 4]  # (a store without tokens binds nothing)
        built.append(state(d))
    assert built[0] == built[1]
