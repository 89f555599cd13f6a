"""The bulk rebuild of the blend index (a restore with blend on) against building it by single
adds: same answers, same counts, also after chunks are removed and re-added."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import AddColumns, BlendIndex, KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.blend import index as blend_index
from kvatlas.directory.records import record_indexed
from kvatlas.directory.snapshot import reader
from kvatlas.directory.token_store import stored_one
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, change_later, entry, key
from tests.directory.test_blend_index_oracle import SPACES, Oracle, canonical

# shapes over three namespaces; two of them share a namespace (ranks of one world)
SHAPES = [("m", "", 1, 0), ("m", "s", 2, 0), ("m", "s", 2, 1), ("n", "", 1, 0)]
NAMESPACES = [BlendNamespace("m"), BlendNamespace("m", "s", 2), BlendNamespace("n")]
# sizes from the index's own ranks: counts must match exactly, capacities may only be smaller
COUNTS = ("contents", "occupants", "claims", "namespaces", "token_bytes", "token_bytes_shared")


def stored(values: list[int]) -> np.ndarray[Any, Any]:
    """A read-only owning array: one the index keeps as it is (the bulk path)."""
    a = np.array(values, np.uint16 if max(values, default=0) < 1 << 16 else np.uint32)
    a.setflags(write=False)
    return a


items = st.lists(
    st.tuples(
        st.integers(0, 5),  # content
        st.integers(0, 7),  # chunk hash
        st.integers(0, 1000),  # offset
        st.integers(0, len(SPACES) - 1),  # namespace
    ),
    max_size=40,
)


def contents(seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    out = [stored(rng.integers(0, 3, CS).tolist()) for _ in range(5)]
    return [*out, stored([70_000, 1, 2, 3][:CS])]  # one uint32 content


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items, items, st.integers(0, 3), st.sampled_from([1, 3, 1 << 17]))
def test_build_equals_single_adds_also_after_removals_and_re_adds(
    first: list[tuple[int, int, int, int]],
    later: list[tuple[int, int, int, int]],
    seed: int,
    slice_size: int,
) -> None:
    tokens = contents(seed)
    rows = [(tokens[c], bytes([h]) * 32, o, SPACES[s]) for c, h, o, s in first]
    single, bulk, oracle = BlendIndex(CS), BlendIndex(CS), Oracle(CS)
    for t, h, o, ns in rows:
        single.add(t, h, o, ns)
        oracle.add(t.tolist(), h, o, ns)
    with mock.patch.object(blend_index, "BUILD_SLICE", slice_size):
        bulk.build(_columns(rows))
    same(single, bulk, oracle, tokens)
    # then the same removals and re-adds on both
    for c, h, o, s in later:
        t, ch, ns = tokens[c], bytes([h]) * 32, SPACES[s]
        for index in (single, bulk):
            change_later(index, t, ch, o, ns)
        change_later(oracle, t.tolist(), ch, o, ns)
    same(single, bulk, oracle, tokens)


def _columns(rows: list[tuple[Any, bytes, int, BlendNamespace]]) -> AddColumns:
    """``rows`` (tokens, hash, offset, namespace) as one ``AddColumns``."""
    spaces = list(dict.fromkeys(ns for *_, ns in rows))
    return AddColumns(
        [r[0] for r in rows],
        [r[1] for r in rows],
        np.array([r[2] for r in rows], np.int64),
        spaces,
        np.array([spaces.index(r[3]) for r in rows], np.int64),
    )


def same(single: BlendIndex, bulk: BlendIndex, oracle: Oracle, tokens: list[Any]) -> None:
    query = np.concatenate([t.astype(np.uint32) for t in tokens + tokens[::-1]])
    for ns in SPACES:
        want = canonical(oracle.match(query.tolist(), ns))
        assert canonical(single.match(query, ns)) == want
        assert canonical(bulk.match(query, ns)) == want
    a, b = asdict(single.stats()), asdict(bulk.stats())
    assert {k: a[k] for k in COUNTS} == {k: b[k] for k in COUNTS}
    for k in ("table_slots", "extra_claim_slots"):
        assert b[k] == a[k], k
    for k in ("content_capacity", "occupant_capacity", "index_bytes"):
        assert b[k] <= a[k], k


chunks = st.lists(
    st.tuples(
        st.integers(1, 30),  # chunk hash
        st.lists(st.integers(0, len(SHAPES) - 1), min_size=1, max_size=3),  # its keys' shapes
        st.sampled_from(["bound", "unbound", "short", "no offset"]),
        st.integers(0, 2),  # content
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks, st.integers(0, 3), st.booleans())
def test_restore_with_blend_on_answers_as_the_live_directory(
    tmp_path_factory: Any, spec: list[tuple[int, list[int], str, int]], seed: int, marked: bool
) -> None:
    """``marked``: the reader builds the records marked indexed (blend on when it reads),
    else the rebuild marks them (blend turned on between reading and installing)."""
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(0, 4, CS).astype(np.uint32) for _ in range(3)]
    live, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    for n, shapes, kind, c in spec:
        for s in shapes:
            model, salt, ws, rank = SHAPES[s]
            k = key(n, model, salt, ws, rank)
            body = bodies[c] if kind != "short" else bodies[c][:-1]
            if kind == "unbound":
                e = entry(k)
            else:
                e = entry(k, body, -1 if kind == "no offset" else 4 * n)
            live.consume(em.batch("store", [e]))
    path = Path(tmp_path_factory.mktemp("snap")) / "s.snap"
    save_snapshot(live, path, stream_position="0-0")
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    reads = reader.indexable_chunks
    with mock.patch.object(reader, "indexable_chunks", lambda *a: reads(*a) if marked else None):
        load_snapshot(restored, path)
    query = np.concatenate(bodies + bodies[::-1])
    for ns in NAMESPACES:
        assert canonical(restored.blend_match(query, ns)) == canonical(live.blend_match(query, ns))
    a, b = live.stats().blend, restored.stats().blend
    assert a is not None and b is not None
    assert {k: getattr(a, k) for k in COUNTS} == {k: getattr(b, k) for k in COUNTS}
    # the records say what the index holds, as on the live directory
    assert {h: record_indexed(r) for h, r in captured(restored).items()} == {
        h: record_indexed(r) for h, r in captured(live).items()
    }


def test_contents_take_the_columnar_path_and_views_do_not() -> None:
    """The directory's contents (``bytes``, ``kernels/contents.py``) and read-only owning
    arrays are kept as columns, with no per-op validation and no copy; views are not (they
    could pin a larger request), and the per-op gate (``_shareable``) agrees:
    ``_kept_columns`` is the gate of the fast path."""
    from kvatlas.directory.blend.op_columns import _kept_columns, _shareable

    n = 4
    ids = np.arange(n * CS, dtype=np.uint16)
    made = [stored_one(row) for row in ids.reshape(n, CS)]
    hashes = [bytes([i]) * 32 for i in range(n)]
    space = BlendNamespace("m")

    def columns(tokens: list[Any]) -> Any:
        return _kept_columns(AddColumns(tokens, hashes, np.zeros(n, np.int64), [space]), CS)

    kept = columns(made)
    assert kept is not None and all(a is b for a, b in zip(kept.tokens, made, strict=True))
    views = ids.reshape(n, CS)
    views.setflags(write=False)
    assert columns(list(views)) is None and not _shareable(views[0])
    owned = np.array(views[-1])
    assert columns([*views[:-1], owned]) is None  # writeable: the caller could change it
    owned.setflags(write=False)
    assert columns([*made[:-1], owned]) is None  # a batch is contents or arrays
    assert columns([np.array(v) for v in views]) is None  # writeable
    frozen = [np.array(v) for v in views]
    for a in frozen:
        a.setflags(write=False)
    assert columns(frozen) is not None and _shareable(frozen[0])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 7), st.integers(0, 1 << 40)),
        min_size=1,
        max_size=20,
    ),
    st.booleans(),
    st.integers(1, 3),
)
def test_vouched_restore_columns_are_what_the_checked_path_keeps(
    rows: list[tuple[int, int, int]], as_contents: bool, n_spaces: int
) -> None:
    """What a restore hands the index vouched for (``AddColumns.vouched``: unchecked) is,
    column for column, what the checked path makes of the same adds: vouching skips checks,
    never changes an input (the directory's contents or owning arrays, several forms,
    several namespaces)."""
    from kvatlas.directory.blend.op_columns import _kept_columns

    arrays: list[Any] = contents(len(rows))
    if as_contents:  # the same ids as the directory keeps them (a restore makes these)
        arrays = [stored_one(a.astype(np.uint32)) for a in arrays]
    spaces = SPACES[:n_spaces]
    op = AddColumns(
        [arrays[c] for c, _, _ in rows],
        [bytes([h]) * (32 - h) for _, h, _ in rows],
        np.array([o for *_, o in rows], np.int64),
        spaces,
        np.array([o % n_spaces for *_, o in rows], np.int64),
    )
    checked, vouched = _kept_columns(op, CS), _kept_columns(op._replace(vouched=True), CS)
    assert checked is not None and vouched is not None
    for name in ("kinds", "hash_lens", "offsets", "token_bytes", "space_of", "owned", "addrs"):
        assert np.array_equal(getattr(checked, name), getattr(vouched, name)), name
    assert checked.spaces == vouched.spaces
    assert all(a is b for a, b in zip(checked.tokens, vouched.tokens, strict=True))
    assert all(a is b for a, b in zip(checked.hashes, vouched.hashes, strict=True))


@pytest.mark.parametrize("then_one_more", [False, True])
def test_build_sizes_the_extra_claims_as_single_adds_do_when_the_last_add_is_extra(
    then_one_more: bool,
) -> None:
    """One chunk claimed by 9 namespaces: its first claim is inline, the other 8 go to the
    extra-claim set (16 slots hold 8 at load 1/2). Single adds grow the set before an add
    only when that add might not fit, so ending on the 8th extra claim leaves 16 slots (one
    add more: 32); the bulk build must end with the same size either way (it trimmed to
    room for one more add: 32 where single adds have 16; found by the property test above)."""
    tokens = contents(0)
    spaces = [BlendNamespace(f"m{i}") for i in range(9)]
    rows = [(tokens[0], bytes(32), 4, ns) for ns in spaces]
    if then_one_more:
        rows.append((tokens[1], bytes([1]) * 32, 8, spaces[0]))
    single, bulk = BlendIndex(CS), BlendIndex(CS)
    for t, h, o, ns in rows:
        single.add(t, h, o, ns)
    bulk.build(_columns(rows))
    a, b = single.stats(), bulk.stats()
    assert a.extra_claim_slots == (32 if then_one_more else 16)
    assert (b.claims, b.extra_claim_slots) == (a.claims, a.extra_claim_slots)
