"""BlendIndex against a brute-force oracle: random workloads, forced fingerprint collisions,
recall at scale, concurrent writers and readers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import (
    AddColumns,
    AddOp,
    BlendIndex,
    BlendMatch,
    BlendOp,
    RemoveChunkOp,
    RemoveClaimOp,
)
from kvatlas.directory.blend import index as blend_module
from kvatlas.keys import BlendNamespace

OPS = {"add": AddOp, "remove_claim": RemoveClaimOp, "remove_chunk": RemoveChunkOp}

SPACES = [
    BlendNamespace("m1"),
    BlendNamespace("m1", cache_salt="s"),
    BlendNamespace("m1", world_size=2),
    BlendNamespace("m2"),
    BlendNamespace("m2", cache_salt="s", world_size=4),
]


@dataclass
class Oracle:
    """The contract, naively: every live (content, chunk_hash) with its offset and claims."""

    chunk_size: int
    stride: int = 1
    entries: dict[tuple[tuple[int, ...], bytes], tuple[int, set[BlendNamespace]]] = field(
        default_factory=dict
    )

    def add(self, tokens: Sequence[int], ch: bytes, offset: int, ns: BlendNamespace) -> None:
        if len(tokens) != self.chunk_size:
            return
        key = (tuple(tokens), ch)
        claims = self.entries[key][1] if key in self.entries else set()
        self.entries[key] = (offset, claims | {ns})

    def remove_claim(self, tokens: Sequence[int], ch: bytes, ns: BlendNamespace) -> None:
        key = (tuple(tokens), ch)
        if key in self.entries:
            self.entries[key][1].discard(ns)
            if not self.entries[key][1]:
                del self.entries[key]

    def remove_chunk(self, tokens: Sequence[int], ch: bytes) -> None:
        self.entries.pop((tuple(tokens), ch), None)

    def match(self, query: Sequence[int], ns: BlendNamespace) -> list[BlendMatch]:
        out, seen = [], set()
        q = [int(t) for t in query]
        entries = sorted(self.entries.items())  # the same for every window
        for pos in range(0, len(q) - self.chunk_size + 1, self.stride):
            window = tuple(q[pos : pos + self.chunk_size])
            for (content, ch), (offset, claims) in entries:
                if content == window and ns in claims and ch not in seen:
                    seen.add(ch)
                    out.append(BlendMatch(ch, offset, pos))
        return out


def canonical(matches: list[BlendMatch]) -> list[tuple[int, bytes, int]]:
    """Order among matches at the same cur_st is unspecified; everything else is pinned."""
    return sorted((m.cur_st, m.chunk_hash, m.old_st) for m in matches)


def assert_ascending(matches: list[BlendMatch]) -> None:
    starts = [m.cur_st for m in matches]
    assert starts == sorted(starts)
    assert len({m.chunk_hash for m in matches}) == len(matches)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, int | None, list[list[int]], list[tuple]]:
    chunk_size = draw(st.integers(2, 6))
    stride = draw(st.sampled_from([1, 1, 2, 3, chunk_size]))
    bits = draw(st.sampled_from([None, None, 1, 3]))  # narrow fingerprints force collisions
    vocab = draw(st.integers(2, 3))
    token = st.integers(0, vocab - 1)
    pool = draw(
        st.lists(st.lists(token, min_size=chunk_size, max_size=chunk_size), min_size=1, max_size=8)
    )
    content = st.sampled_from(pool)
    chash = st.sampled_from([b"a", b"b", b"c" * 32, b"d" * 32])
    ns = st.sampled_from(SPACES)
    op = st.one_of(
        st.tuples(st.just("add"), content, chash, st.integers(0, 9), ns),
        st.tuples(st.just("remove_claim"), content, chash, ns),
        st.tuples(st.just("remove_chunk"), content, chash),
        st.tuples(
            st.just("match"),
            st.lists(st.one_of(content, st.lists(token, max_size=3)), max_size=8),
            ns,
        ),
    )
    ops = draw(st.lists(op, min_size=1, max_size=40))
    return chunk_size, stride, bits, pool, ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_match_equals_brute_force_oracle(
    workload: tuple[int, int, int | None, list[list[int]], list[tuple]],
) -> None:
    chunk_size, stride, bits, pool, ops = workload
    kwargs = {} if bits is None else {"_fingerprint_bits": bits}
    index = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)  # type: ignore[arg-type]
    oracle = Oracle(chunk_size, stride)
    for op in ops:
        if op[0] == "match":
            query = [t for piece in op[1] for t in piece]
            got = index.match(np.array(query, dtype=np.int64), op[2])
            assert_ascending(got)
            assert canonical(got) == canonical(oracle.match(query, op[2]))
        else:
            getattr(index, op[0])(*op[1:])
            getattr(oracle, op[0])(*op[1:])
    stats = index.stats()
    assert stats.occupants == len(oracle.entries)
    assert stats.claims == sum(len(c) for _, c in oracle.entries.values())
    assert stats.contents == len({content for content, _ in oracle.entries})
    for ns in SPACES:  # every live claimed chunk is found in a query made of the whole pool
        query = [t for c in pool for t in c]
        assert canonical(index.match(query, ns)) == canonical(oracle.match(query, ns))


@pytest.mark.parametrize("hook", [{"_fingerprint_bits": 1}, {"_fingerprint_base": 1}])
def test_forced_collisions_never_confuse_contents(hook: dict[str, int]) -> None:
    """With one fingerprint bit (or base 1: the fingerprint is the token sum, so every
    permutation collides) distinct contents share fingerprints; each must stay findable and
    never be returned for another's text."""
    index = BlendIndex(chunk_size=4, **hook)  # type: ignore[arg-type]
    ns = SPACES[0]
    contents = [[1, 2, 3, 4], [4, 3, 2, 1], [2, 1, 4, 3], [1, 2, 4, 3], [3, 4, 1, 2]]
    for i, c in enumerate(contents):
        index.add(c, bytes([i]), 10 * i, ns)
    for i, c in enumerate(contents):
        assert index.match(c, ns) == [BlendMatch(bytes([i]), 10 * i, 0)]
    assert index.match([4, 1, 2, 3], ns) == []  # same sum, not stored
    index.remove_chunk(contents[0], bytes([0]))  # removing one colliding entry keeps the rest
    assert index.match(contents[0], ns) == []
    for i, c in enumerate(contents[1:], start=1):
        assert index.match(c, ns) == [BlendMatch(bytes([i]), 10 * i, 0)]
    assert index.stats().contents == len(contents) - 1


def test_collision_with_near_miss_windows_returns_only_the_genuine_content() -> None:
    index = BlendIndex(chunk_size=8, _fingerprint_base=1)
    ns = SPACES[0]
    genuine = np.arange(1, 9, dtype=np.uint32)
    index.add(genuine, b"g", 0, ns)
    rng = np.random.default_rng(3)
    decoys = [rng.permutation(genuine) for _ in range(50)]  # same fingerprint, other order
    decoys = [d for d in decoys if not np.array_equal(d, genuine)]
    query = np.concatenate([*decoys, genuine, *decoys])
    assert index.match(query, ns) == [BlendMatch(b"g", 0, 8 * len(decoys))]


def test_default_fingerprint_is_keyed_per_instance() -> None:
    a, b = BlendIndex(), BlendIndex()
    assert a._base != b._base  # per-process secret: no fixed public base


def test_full_recall_at_scale() -> None:
    """100k stored chunks (two namespaces, shared content, repeated content), a query holding
    a sample of them at arbitrary offsets: every one is found, nothing else."""
    chunk_size, n = 16, 100_000
    rng = np.random.default_rng(11)
    contents = rng.integers(0, 1 << 20, (n, chunk_size), dtype=np.uint32)
    contents[n // 2 :: 97] = contents[: len(contents[n // 2 :: 97])]  # repeated content
    index = BlendIndex(chunk_size=chunk_size)
    spaces = [SPACES[0], SPACES[1]]
    for i in range(n):
        index.add(contents[i], i.to_bytes(32, "little"), i * chunk_size, spaces[i % 2])
    picked = rng.choice(n, 3000, replace=False)
    pieces, expected = [], {}
    pos = 0
    for i in picked:
        gap = rng.integers(1 << 21, 1 << 22, int(rng.integers(0, 5)), dtype=np.uint32)
        pieces += [gap, contents[i]]
        pos += len(gap)
        expected.setdefault(bytes(contents[i]), pos)
        pos += chunk_size
    query = np.concatenate(pieces)
    for ns_i, ns in enumerate(spaces):
        got = {m.chunk_hash: m for m in index.match(query, ns)}
        want = {
            j: expected[bytes(contents[j])]
            for j in range(n)
            if j % 2 == ns_i and bytes(contents[j]) in expected
        }
        assert len(got) == len(want)
        for j, cur in want.items():
            m = got[j.to_bytes(32, "little")]
            assert (m.cur_st, m.old_st) == (cur, j * chunk_size)


def test_segmented_match_equals_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long query is probed in lock-sized segments; first-occurrence dedup must span them."""
    index = BlendIndex(chunk_size=4)
    ns = SPACES[0]
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 6, (30, 4), dtype=np.uint32)
    for i, c in enumerate(pool):
        index.add(c, bytes([i]), i, ns)
    query = rng.integers(0, 6, 3000, dtype=np.uint32)
    whole = index.match(query, ns)
    monkeypatch.setattr(blend_module, "_SEGMENT_WINDOWS", 7)
    assert index.match(query, ns) == whole
    oracle = Oracle(4)
    for i, c in enumerate(pool):
        oracle.add(c.tolist(), bytes([i]), i, ns)
    assert canonical(whole) == canonical(oracle.match(query.tolist(), ns))


def test_segmented_match_full_width_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments joined by the hashes' bytes: 32-byte hashes that share their first 8 bytes
    (the join's set key) are told apart, one hash stored with two contents is answered once,
    at its first hit across segments, and a hash with a zero last byte keeps it."""
    index = BlendIndex(chunk_size=4)
    ns = SPACES[0]
    rng = np.random.default_rng(5)
    pool = rng.integers(0, 6, (30, 4), dtype=np.uint32)
    hashes = [b"shared-8" + bytes([i % 12]) * 23 + bytes(1) for i in range(len(pool))]
    for i, c in enumerate(pool):  # i and i + 12 share a hash: two contents, one hash
        index.add(c, hashes[i], i, ns)
    query = rng.integers(0, 6, 3000, dtype=np.uint32)
    whole = index.match(query, ns)
    assert len(whole) > 1 and all(len(m.chunk_hash) == 32 for m in whole)
    monkeypatch.setattr(blend_module, "_SEGMENT_WINDOWS", 7)
    assert index.match(query, ns) == whole
    assert index.match_columns(query, ns).matches() == whole
    oracle = Oracle(4)
    for i, c in enumerate(pool):
        oracle.add(c.tolist(), hashes[i], i, ns)
    assert canonical(whole) == canonical(oracle.match(query.tolist(), ns))


def test_concurrent_add_remove_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blend_module, "_SEGMENT_WINDOWS", 64)  # many lock hand-offs per query
    chunk_size = 4
    index = BlendIndex(chunk_size=chunk_size)
    rng = np.random.default_rng(7)
    pool = rng.integers(0, 5, (40, chunk_size), dtype=np.uint32)
    query = np.concatenate([pool.reshape(-1), rng.integers(0, 5, 2000, dtype=np.uint32)])
    oracles = [Oracle(chunk_size) for _ in range(3)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        local = np.random.default_rng(100 + w)
        try:
            for _ in range(1500):
                c = pool[int(local.integers(len(pool)))]
                ch = bytes([w, int(local.integers(6))])  # disjoint chunk_hashes per writer
                ns = SPACES[int(local.integers(3))]
                kind = int(local.integers(4))
                if kind < 2:
                    index.add(c, ch, int(local.integers(100)), ns)
                    oracles[w].add(c.tolist(), ch, 0, ns)
                elif kind == 2:
                    index.remove_claim(c, ch, ns)
                    oracles[w].remove_claim(c.tolist(), ch, ns)
                else:
                    index.remove_chunk(c, ch)
                    oracles[w].remove_chunk(c.tolist(), ch)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                for ns in SPACES[:3]:
                    result = index.match(query, ns)
                    assert_ascending(result)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    stop.set()
    for t in readers:
        t.join(timeout=120)
    assert not errors, errors
    merged = Oracle(chunk_size)
    for o in oracles:
        merged.entries.update(o.entries)
    for ns in SPACES[:3]:
        got = [(m.cur_st, m.chunk_hash) for m in index.match(query, ns)]
        want = [(m.cur_st, m.chunk_hash) for m in merged.match(query.tolist(), ns)]
        assert sorted(got) == sorted(want)
    assert index.stats().occupants == len(merged.entries)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.lists(st.integers(1, 6), min_size=1, max_size=10))
def test_batched_writes_equal_the_oracle(
    workload: tuple[int, int, int | None, list[list[int]], list[tuple]], cuts: list[int]
) -> None:
    """The same ops as the single-call oracle test, writes grouped into ``apply`` batches."""
    chunk_size, stride, bits, pool, ops = workload
    kwargs = {} if bits is None else {"_fingerprint_bits": bits}
    index = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)  # type: ignore[arg-type]
    oracle = Oracle(chunk_size, stride)
    pending: list[BlendOp] = []
    sizes = iter(cuts * 40)
    size = next(sizes)
    for op in ops:
        if op[0] == "match":
            index.apply(pending)
            pending = []
            query = [t for piece in op[1] for t in piece]
            got = index.match(np.array(query, dtype=np.int64), op[2])
            assert_ascending(got)
            assert canonical(got) == canonical(oracle.match(query, op[2]))
            continue
        pending.append(OPS[op[0]](*op[1:]))
        getattr(oracle, op[0])(*op[1:])
        if len(pending) >= size:
            index.apply(pending)
            pending, size = [], next(sizes)
    index.apply(pending)
    stats = index.stats()
    assert stats.occupants == len(oracle.entries)
    assert stats.claims == sum(len(c) for _, c in oracle.entries.values())
    assert stats.contents == len({content for content, _ in oracle.entries})
    assert stats.namespaces == len({ns for _, c in oracle.entries.values() for ns in c})
    for ns in SPACES:
        query = [t for c in pool for t in c]
        assert canonical(index.match(query, ns)) == canonical(oracle.match(query, ns))


def _as_columns(ops: list[BlendOp], kept: bool) -> list[BlendOp]:
    """Runs of adds as :class:`AddColumns` (``kept``: their tokens as arrays the index keeps
    as they are, read-only and owning, the columnar fast path; else as lists, its fallback)."""
    out: list[BlendOp] = []
    run: list[AddOp] = []
    for op in [*ops, None]:
        if isinstance(op, AddOp):
            run.append(op)
            continue
        if run:
            spaces = list(dict.fromkeys(a.namespace for a in run))
            tokens = [_kept(a.tokens) if kept else list(a.tokens) for a in run]
            out.append(
                AddColumns(
                    tokens,
                    [a.chunk_hash for a in run],
                    np.array([a.token_offset for a in run], np.int64),
                    spaces,
                    np.array([spaces.index(a.namespace) for a in run]),
                )
            )
            run = []
        if op is not None:
            out.append(op)
    return out


def _kept(tokens: Sequence[int]) -> np.ndarray:
    arr = np.array(tokens, np.uint16 if max(tokens) % 2 else np.uint32)  # both widths
    arr.flags.writeable = False
    return arr


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.lists(st.integers(1, 12), min_size=1, max_size=10), st.booleans())
def test_add_columns_equal_the_oracle_and_single_adds(
    workload: tuple[int, int, int | None, list[list[int]], list[tuple]],
    cuts: list[int],
    kept: bool,
) -> None:
    """Batches whose runs of adds are :class:`AddColumns` (prepared column-wise, without
    Python per entry, when the arrays are kept as they are) give the oracle's matches and the
    same stats as the same ops applied as single ops."""
    chunk_size, stride, bits, pool, ops = workload
    kwargs = {} if bits is None else {"_fingerprint_bits": bits}
    index = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)  # type: ignore[arg-type]
    twin = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)  # type: ignore[arg-type]
    oracle = Oracle(chunk_size, stride)
    pending: list[BlendOp] = []
    sizes = iter(cuts * 40)
    size = next(sizes)

    def flush() -> None:
        index.apply(_as_columns(pending, kept))
        for one in pending:
            twin.apply([one])
        pending.clear()

    for op in ops:
        if op[0] == "match":
            flush()
            query = [t for piece in op[1] for t in piece]
            got = index.match(np.array(query, dtype=np.int64), op[2])
            assert canonical(got) == canonical(oracle.match(query, op[2]))
            continue
        pending.append(OPS[op[0]](*op[1:]))
        getattr(oracle, op[0])(*op[1:])
        if len(pending) >= size:
            flush()
            size = next(sizes)
    flush()
    stats, twin_stats = index.stats(), twin.stats()
    assert stats.occupants == len(oracle.entries)
    assert stats.claims == sum(len(c) for _, c in oracle.entries.values())
    assert stats.namespaces == len({ns for _, c in oracle.entries.values() for ns in c})
    assert (stats.contents, stats.occupants, stats.claims, stats.namespaces) == (
        twin_stats.contents,
        twin_stats.occupants,
        twin_stats.claims,
        twin_stats.namespaces,
    )
    if not kept:  # lists are copied, as single adds copy them
        assert stats.token_bytes_owned == twin_stats.token_bytes_owned
    for ns in SPACES:
        query = [t for c in pool for t in c]
        assert canonical(index.match(query, ns)) == canonical(oracle.match(query, ns))


def test_add_columns_take_the_arrays_as_they_are_or_validate_like_single_adds() -> None:
    """Kept arrays are referenced, not copied; anything else is validated as ``AddOp``s are:
    a wrong-length content is skipped, a negative offset or a long hash raises, and nothing
    of a refused batch is applied."""
    ns = SPACES[0]
    a, b = _kept([1, 2, 3, 4]), _kept([5, 6, 7, 9])
    index = BlendIndex(chunk_size=4)
    index.apply([AddColumns([a, b], [b"a", b"b"], np.array([0, 4]), [ns])])
    stats = index.stats()
    assert (stats.contents, stats.token_bytes_owned) == (2, 0)
    assert canonical(index.match([1, 2, 3, 4, 5, 6, 7, 9], ns)) == [(0, b"a", 0), (4, b"b", 4)]
    index.apply([AddColumns([[1, 2, 3], [2, 2, 2, 2]], [b"c", b"d"], [1, 2], [ns])])
    assert index.stats().contents == 3  # the 3-token content is not indexed
    for bad in (
        AddColumns([[3, 3, 3, 3]], [b"e"], np.array([-1]), [ns]),
        AddColumns([_kept([3, 3, 3, 3])], [b"e" * 33], [0], [ns]),
        AddColumns([_kept([3, 3, 3, 3])], [b"e"], [0, 1], [ns]),
    ):
        with pytest.raises(ValueError):
            index.apply([AddOp([4, 4, 4, 4], b"f", 0, ns), bad])
    assert index.stats().contents == 3


def test_restore_as_one_batch_has_no_window() -> None:
    """A reader never sees a re-stored chunk between its ``remove_chunk`` and its re-``add``:
    exactly one of the two contents is matchable at every moment."""
    index = BlendIndex(chunk_size=4)
    ns = SPACES[0]
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    index.add(a, b"h", 0, ns)
    query = np.array(a + b, dtype=np.uint32)
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            cur, new = a, b
            for i in range(3000):
                index.apply([RemoveChunkOp(cur, b"h"), AddOp(new, b"h", i, ns)])
                cur, new = new, cur
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                assert len(index.match(query, ns)) == 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
