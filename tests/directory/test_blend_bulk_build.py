"""The bulk build of an empty blend index (``blend/bulk.py``, a restore's rebuild) against the
general path it stands in for (``IndexState.apply`` slice by slice): the same state, array for
array and object for object (content, occupant and namespace ids included), the same answers,
and the same state again after removals and re-adds on both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import AddColumns, BlendIndex, KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.blend import bulk, kernels
from kvatlas.directory.blend import index as blend_index
from kvatlas.directory.blend.fingerprints import Fingerprints
from kvatlas.directory.blend.kernels.contents import content_form
from kvatlas.directory.blend.kernels.layout import O_OFF
from kvatlas.directory.blend.kernels.planes import FORM_PLANES, FORM_U16, FORM_U32
from kvatlas.directory.records import record_indexed
from kvatlas.directory.token_store import stored_one
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import (
    CS,
    Emitter,
    captured,
    change_later,
    entry,
    key,
    occupant_hashes,
)
from tests.directory.test_blend_index_oracle import SPACES, canonical

BASE = 1_234_567_891
"""One fingerprint base for both indexes (their arrays hold fingerprints)."""
LOWS = (0, 1 << 16, 1 << 20, 1 << 24)
"""Where a content's ids start: uint16, the planes form (1 and 5 high bits), uint32."""


def pool(seed: int) -> list[bytes]:
    """Contents as the directory keeps them, in every form, each twice: the same ids as two
    objects (duplicates across chunks, as a restore makes them)."""
    rng = np.random.default_rng(seed)
    ids = [low + rng.integers(0, 3, CS) for low in LOWS for _ in range(2)]
    return [stored_one(np.asarray(t, np.uint32)) for t in ids for _ in range(2)]


def test_the_pool_holds_every_form() -> None:
    forms = {content_form(c) for c in pool(0)}
    assert {FORM_U16, FORM_U32} <= forms and any(f > FORM_PLANES for f in forms)


rows_strategy = st.lists(
    st.tuples(
        st.integers(0, 15),  # content (the pool's)
        st.integers(0, 9),  # chunk hash
        st.integers(0, 1 << 40),  # offset
        st.integers(0, len(SPACES) - 1),  # namespace
    ),
    min_size=1,
    max_size=40,
)


def _adds(rows: list[tuple[int, int, int, int]], contents: list[bytes]) -> AddColumns:
    spaces = list(dict.fromkeys(SPACES[s] for *_, s in rows))
    return AddColumns(
        [contents[c] for c, *_ in rows],
        [bytes([h]) * (32 - h % 3) for _, h, _, _ in rows],  # lengths 30..32
        np.array([o for _, _, o, _ in rows], np.int64),
        spaces,
        np.array([spaces.index(SPACES[s]) for *_, s in rows], np.int64),
        vouched=True,
    )


def _general(adds: AddColumns, fps: Fingerprints | None) -> BlendIndex:
    index = BlendIndex(CS, _fingerprint_base=BASE)
    with mock.patch.object(blend_index, "build_empty", lambda *a: False):
        index.build(adds, fps)
    return index


@contextmanager
def bulk_builds() -> Iterator[list[bool]]:
    """What each ``bulk.build_empty`` call returned meanwhile (``True``: the bulk path was
    taken), in order."""
    taken: list[bool] = []

    def build_empty(*args: Any) -> bool:
        taken.append(bulk.build_empty(*args))
        return taken[-1]

    with mock.patch.object(blend_index, "build_empty", build_empty):
        yield taken


def _bulk(adds: AddColumns, fps: Fingerprints | None) -> BlendIndex:
    index = BlendIndex(CS, _fingerprint_base=BASE)
    with bulk_builds() as taken:
        index.build(adds, fps)
    assert taken == [True]  # the bulk path, not the general one
    return index


def state_of(index: BlendIndex) -> dict[str, Any]:
    """Everything an index holds: its arrays, the objects it keeps (by identity), counters,
    namespace ids and free lists."""
    s = index._state
    ns = s.namespaces
    out: dict[str, Any] = {f: getattr(s.arrays, f).tobytes() for f in s.arrays._fields}
    out.update(
        tokens=[None if t is None else id(t) for t in s.tokens],
        hashes=occupant_hashes(s),
        owned=sorted(s.owned),
        extra_claims=list(s.extra_claims.items()),
        counters=(s.contents, s.occupants, s.claims, s.owned_bytes, s.token_bytes, s.n_extra),
        namespaces=(dict(ns._ids), list(ns._names), list(ns.claims), list(ns._free)),
        base=index._base,
    )
    return out


def _same(a: BlendIndex, b: BlendIndex, contents: list[bytes]) -> None:
    assert state_of(a) == state_of(b)
    query = np.concatenate(
        [np.frombuffer(c, np.uint32, offset=4) for c in contents if content_form(c) == FORM_U32]
        + [np.arange(LOWS[1], LOWS[1] + 3 * CS, dtype=np.uint32)]
    )
    for ns in SPACES:
        assert canonical(a.match(query, ns)) == canonical(b.match(query, ns))
    assert a.stats() == b.stats()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows_strategy, rows_strategy, st.integers(0, 3), st.sampled_from([1, 2, 3, 1 << 17]))
@pytest.mark.parametrize("saved", [False, True])
def test_bulk_build_is_the_general_build_also_after_removals_and_re_adds(
    saved: bool,
    rows: list[tuple[int, int, int, int]],
    later: list[tuple[int, int, int, int]],
    seed: int,
    slice_size: int,
) -> None:
    contents = pool(seed)
    adds = _adds(rows, contents)
    fps = None
    if saved:  # a snapshot's column: the fingerprints given
        key = BlendIndex(CS, _fingerprint_base=BASE).fingerprint_key
        fps = Fingerprints(key, key.of(list(adds.tokens)))
    with mock.patch.object(blend_index, "BUILD_SLICE", slice_size):
        general, built = _general(adds, fps), _bulk(adds, fps)
    _same(general, built, contents)
    for c, h, o, s in later:
        t, ch, ns = contents[c], bytes([h]) * (32 - h % 3), SPACES[s]
        for index in (general, built):
            change_later(index, t, ch, o, ns)
    _same(general, built, contents)


def test_bulk_build_takes_the_adds_it_is_given_and_leaves_others() -> None:
    """The bulk path runs for vouched contents on an empty index, not for arrays (then the
    general path, with the same result), nor on an index that holds something."""
    contents = pool(1)
    adds = _adds([(0, 1, 4, 0), (2, 2, 8, 1)], contents)
    for given_adds, expect in (
        (adds, True),
        (
            adds._replace(
                tokens=[np.frombuffer(c, np.uint16, offset=2).copy() for c in adds.tokens]
            ),
            False,
        ),
    ):
        got = bulk.build_empty(BlendIndex(CS)._state, given_adds, None, 1 << 17)
        assert got is expect
    index = BlendIndex(CS)
    index.add(contents[4], bytes(32), 0, SPACES[0])
    assert not bulk.is_empty(index._state)


def test_negative_control_registration_in_namespace_order_is_caught() -> None:
    """The comparison can fail: namespaces registered in ``spaces`` order instead of slice by
    slice give the first slice's namespace another id than the general path does."""
    contents = pool(2)
    adds = _adds([(0, 1, 4, 1), (2, 2, 8, 0), (4, 3, 12, 0)], contents)
    adds = adds._replace(namespaces=adds.namespaces[::-1], namespace_of=1 - adds.namespace_of)

    def in_spaces_order(namespaces: Any, spaces: list[Any], which: Any, bounds: Any) -> Any:
        return np.array([namespaces.register(s) for s in spaces], np.int64)

    with mock.patch.object(blend_index, "BUILD_SLICE", 1):
        general = _general(adds, None)
        with mock.patch.object(bulk, "_registered", in_spaces_order):
            wrong = _bulk(adds, None)
        right = _bulk(adds, None)
    assert state_of(general) == state_of(right)
    assert state_of(general) != state_of(wrong)


def test_negative_control_a_dropped_extra_claim_is_caught() -> None:
    """The comparison can fail: a bulk build that forgot an extra claim's bookkeeping."""
    contents = pool(3)
    adds = _adds([(0, 1, 4, 0), (0, 1, 4, 1), (2, 2, 8, 2)], contents)
    general, built = _general(adds, None), _bulk(adds, None)
    assert state_of(general) == state_of(built)
    built._state.extra_claims.clear()
    assert state_of(general) != state_of(built)


# (model, salt, world size, rank) of keys: three namespaces, two shapes share one
SHAPES = [("m", "", 1, 0), ("m", "s", 2, 0), ("m", "s", 2, 1), ("n", "", 1, 0)]
NAMESPACES = [BlendNamespace("m"), BlendNamespace("m", "s", 2), BlendNamespace("n")]

chunks_strategy = st.lists(
    st.tuples(
        st.integers(1, 40),  # chunk hash
        st.lists(st.integers(0, len(SHAPES) - 1), min_size=1, max_size=3),  # its keys' shapes
        st.sampled_from(["bound", "bound", "unbound", "short", "empty", "no offset"]),
        st.integers(0, 7),  # content
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks_strategy, st.integers(0, 3))
def test_a_restore_builds_the_index_the_general_path_builds(
    tmp_path_factory: Any, spec: list[tuple[int, list[int], str, int]], seed: int
) -> None:
    """A directory restored with blend on (its adds vouched, the saved fingerprints taken)
    holds the index the general path builds from the same snapshot: random directories with
    duplicate contents across chunks, several namespaces, chunks with several keys, every
    token form, empty and short contents, unknown offsets."""
    rng = np.random.default_rng(seed)
    bodies = [(low + rng.integers(0, 3, CS)).astype(np.uint32) for low in LOWS for _ in range(2)]
    live, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    for n, shapes, kind, c in spec:
        body = {"short": bodies[c][:-1], "empty": bodies[c][:0]}.get(kind, bodies[c])
        for s in shapes:
            k = key(n, *SHAPES[s])
            e = (
                entry(k)
                if kind == "unbound"
                else entry(k, body, -1 if kind == "no offset" else 4 * n)
            )
            live.consume(em.batch("store", [e]))
    path = Path(tmp_path_factory.mktemp("snap")) / "s.snap"
    save_snapshot(live, path, stream_position="0-0")
    built = KeyDirectory(CS, enable_blend_lookup=True)
    with bulk_builds() as taken:
        load_snapshot(built, path)
    general = KeyDirectory(CS, enable_blend_lookup=True)
    with mock.patch.object(blend_index, "build_empty", lambda *a: False):
        load_snapshot(general, path)
    a, b = general._index, built._index
    assert a is not None and b is not None
    indexed = any(map(record_indexed, captured(built).values()))
    assert taken == ([True] if indexed else [])  # the bulk path, not the general one
    if indexed or not b.stats().contents:  # (else the index holds only the per-salt bindings
        # of chunks of several salts, added after the build, each index under its own base)
        sa, sb = state_of(a), state_of(b)
        # the two restores made their own contents: the same ones, other objects
        for name in ("tokens", "c_addr"):
            assert len(sa.pop(name)) == len(sb.pop(name))
        if not indexed:  # (each empty index has its own base)
            del sa["base"], sb["base"]
        assert sa == sb
        assert [bytes(t) for t in a._state.tokens] == [bytes(t) for t in b._state.tokens]  # type: ignore[arg-type]
        assert occupant_hashes(a._state) == occupant_hashes(b._state)
        assert np.array_equal(a._state.arrays.o_i64[:, O_OFF], b._state.arrays.o_i64[:, O_OFF])
    query = np.concatenate(bodies + bodies[::-1])
    for ns in NAMESPACES:
        assert canonical(general.blend_match(query, ns)) == canonical(built.blend_match(query, ns))
        assert canonical(built.blend_match(query, ns)) == canonical(live.blend_match(query, ns))
    assert general.stats().blend == built.stats().blend


def test_a_bulk_build_failing_midway_leaves_the_index_empty() -> None:
    """The kernel fails on the second slice: the slices written so far are dropped (the index
    is empty again, as it was), and a build afterwards is the general build."""
    contents = pool(2)
    rows = [(c, h, 8 * h, h % 2) for c, h in ((0, 1), (5, 2), (9, 3), (12, 4))]
    adds = _adds(rows, contents)
    index = BlendIndex(CS, _fingerprint_base=BASE)
    calls: list[int] = []
    real = kernels.apply_ops

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("the second slice")
        return real(*args)

    with (
        mock.patch.object(blend_index, "BUILD_SLICE", 1),
        mock.patch.object(kernels, "apply_ops", failing),
        pytest.raises(MemoryError),
    ):
        index.build(adds)
    assert len(calls) == 2
    assert bulk.is_empty(index._state) and index.stats() == BlendIndex(CS).stats()
    index.build(adds)
    _same(_general(adds, None), index, contents)


def test_columns_of_another_length_are_left_to_the_general_path() -> None:
    adds = _adds([(0, 1, 4, 0), (2, 2, 8, 1)], pool(3))
    state = BlendIndex(CS)._state
    assert adds.namespace_of is not None
    assert not bulk.build_empty(state, adds._replace(namespace_of=adds.namespace_of[:1]), None, 8)
    assert bulk.is_empty(state)


@pytest.mark.parametrize("spaces", [1, 3])
def test_a_bulk_build_past_the_first_capacity_and_the_releasing_kernel(spaces: int) -> None:
    """9,000 adds (the arrays and table grow past their first size; slices of 5,000 take the
    kernel that releases the GIL) build the general path's state."""
    rng = np.random.default_rng(spaces)
    contents = [
        stored_one(np.asarray(low + rng.integers(0, 1 << 15, CS), np.uint32))
        for low in LOWS
        for _ in range(500)
    ]
    n = 9_000
    pick = rng.integers(0, len(contents), n)
    adds = AddColumns(
        [contents[i] for i in pick.tolist()],
        [int(i).to_bytes(32, "little") for i in range(n)],
        np.arange(n, dtype=np.int64) * CS,
        list(SPACES[:spaces]),
        rng.integers(0, spaces, n).astype(np.int64),
        vouched=True,
    )
    assert n > kernels.RELEASE_OPS
    with mock.patch.object(blend_index, "BUILD_SLICE", 5_000):
        _same(_general(adds, None), _bulk(adds, None), contents)


@pytest.mark.parametrize("saved", [False, True])
@pytest.mark.parametrize("spaces", [1, 3])
def test_a_build_into_the_room_reserved_before_is_the_same_build(saved: bool, spaces: int) -> None:
    """``reserve(n)`` (a restore's thread, while the records are built) makes the room a
    build of ``n`` adds would make, faulted in: the build then writes into those very arrays
    (also when it adopts a snapshot's fingerprint base: ``_rekey`` keeps an empty state's
    arrays) and leaves the state the build without it leaves."""
    rng = np.random.default_rng(spaces)
    contents = pool(spaces)
    n = 3_000
    adds = AddColumns(
        [contents[i] for i in rng.integers(0, len(contents), n).tolist()],
        [int(i).to_bytes(32, "little") for i in range(n)],
        np.arange(n, dtype=np.int64) * CS,
        list(SPACES[:spaces]),
        rng.integers(0, spaces, n).astype(np.int64),
        vouched=True,
    )
    key = BlendIndex(CS, _fingerprint_base=BASE).fingerprint_key
    fps = Fingerprints(key, key.of(list(adds.tokens))) if saved else None
    reserved = BlendIndex(CS, _fingerprint_base=None if saved else BASE)
    faulted: list[int] = []
    with mock.patch.object(blend_index, "fault_in", lambda arrays: faulted.extend(map(id, arrays))):
        reserved.reserve(n)
    room = reserved._state.arrays
    assert room.content_capacity >= n and room.occupant_capacity >= n
    assert faulted == list(map(id, room))
    with bulk_builds() as taken:
        reserved.build(adds, fps)
    assert taken == [True]
    after = reserved._state.arrays
    assert all(getattr(after, f) is getattr(room, f) for f in ("c_fp", "c_addr", "o_i64", "o_i32"))
    _same(_bulk(adds, fps), reserved, contents)
