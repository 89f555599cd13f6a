"""Placements, reads, listing and capacity declarations of the KeyDirectory."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory, KeyFilter, PrefixHolder
from kvatlas.keys import ObjectKey, chunk_hashes, expand_prefix_keys, pack_kv_rank
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks


def test_placements_upsert_delete_and_sorting() -> None:
    d = KeyDirectory(CS)
    b, a = Emitter("b"), Emitter("a")
    d.consume(b.batch("store", [entry(key(1), size=5)]))
    d.consume(a.batch("store", [entry(key(1), size=6)], tier="l2", backend="fs", ts=3.0))
    d.consume(a.batch("store", [entry(key(1), size=7)]))
    d.consume(a.batch("store", [entry(key(1), size=8)]))  # upsert: same (instance, tier, backend)
    (kp,) = d.lookup([key(1)])
    assert [(p.instance_id, p.tier, p.backend, p.size_bytes) for p in kp.placements] == [
        ("a", "l1", "dram", 8),
        ("a", "l2", "fs", 6),
        ("b", "l1", "dram", 5),
    ]
    assert d.stats().placements == 3 and d.stats().bytes_by_tier == {"l1": 13, "l2": 6}
    d.consume(a.batch("delete", [entry(key(9))]))  # absent: no-op
    d.consume(a.batch("delete", [entry(key(1))], tier="l2", backend="other"))
    assert len(d.lookup([key(1)])[0].placements) == 3
    d.consume(a.batch("delete", [entry(key(1))]))
    d.consume(a.batch("delete", [entry(key(1))], tier="l2", backend="fs"))
    d.consume(b.batch("delete", [entry(key(1))]))
    assert d.lookup([key(1)])[0].placements == () and d.stats().keys == 0


def test_shared_backend_is_one_placement_fleet_wide_and_survives_fencing() -> None:
    d = KeyDirectory(CS)
    a, b = Emitter("a"), Emitter("b")
    d.consume(a.batch("store", [entry(key(1), size=1)], tier="l2", backend="pool", shared=True))
    d.consume(b.batch("store", [entry(key(1), size=2)], tier="l2", backend="pool", shared=True))
    (p,) = d.lookup([key(1)])[0].placements
    assert (p.instance_id, p.size_bytes, p.shared) == ("b", 2, True)  # last reporter wins
    d.consume(b.batch("store", [entry(key(1))], tier="l2", backend="pool"))  # b's own, not shared
    assert len(d.lookup([key(1)])[0].placements) == 2
    d.fence_instance("b")
    d.deregister("a")
    assert len(d.lookup([key(1)])[0].placements) == 2
    d.consume(a.batch("delete", [entry(key(1))], tier="l2", backend="pool", shared=True))
    (left,) = d.lookup([key(1)])[0].placements
    assert not left.shared


def test_fencing_drops_only_that_instances_l1() -> None:
    d = KeyDirectory(CS)
    a, b = Emitter("a"), Emitter("b")
    d.consume(a.batch("store", [entry(key(1)), entry(key(2))]))
    d.consume(a.batch("store", [entry(key(2))], tier="l2", backend="fs"))
    d.consume(b.batch("store", [entry(key(1))]))
    assert d.stats().l1_placements_by_instance == {"a": 2, "b": 1}
    assert d.fence_instance("a") == 2
    assert [len(kp.placements) for kp in d.lookup([key(1), key(2)])] == [1, 1]
    assert d.stats().l1_placements_by_instance == {"b": 1}
    assert d.fence_instance("a") == 0


def test_access_updates_recency_only() -> None:
    d = KeyDirectory(CS)
    a = Emitter("a")
    d.consume(a.batch("store", [entry(key(1))], ts=1.0))
    d.consume(a.batch("store", [entry(key(1))], tier="l2", backend="fs", ts=1.0))
    d.consume(a.batch("access", [entry(key(1)), entry(key(7))], backend="", ts=5.0))
    got = {p.tier: p.last_access for p in d.lookup([key(1)])[0].placements}
    assert got == {"l1": 5.0, "l2": 1.0}
    assert d.lookup([key(7)])[0].placements == ()
    d.consume(a.batch("access", [entry(key(1))], backend="", ts=2.0))
    assert {p.tier: p.last_access for p in d.lookup([key(1)])[0].placements}["l1"] == 5.0


def test_lookup_tokens_longest_prefix_summary() -> None:
    d = KeyDirectory(CS)
    tokens = np.arange(5 * CS, dtype=np.uint32)
    ks = expand_prefix_keys(chunk_hashes(tokens, CS), "m", 2)  # 5 chunks x 2 ranks
    a, b, pool = Emitter("a"), Emitter("b"), Emitter("p")
    d.consume(a.batch("store", [entry(k) for k in ks[:6]]))  # chunks 0-2 on both ranks
    d.consume(a.batch("store", [entry(k) for k in ks[8:]]))  # chunk 4: not a prefix
    d.consume(b.batch("store", [entry(k) for k in ks[:3]]))  # chunk 0, and rank 0 of chunk 1
    d.consume(pool.batch("store", [entry(k) for k in ks], tier="l2", backend="redis", shared=True))
    got = d.lookup_tokens([*tokens.tolist(), 1, 2], "m", 2)
    assert got.chunks == 5 and len(got.results) == 10
    assert got.prefix == [
        PrefixHolder(None, "l2", "redis", True, 5),
        PrefixHolder("a", "l1", "dram", False, 3),
        PrefixHolder("b", "l1", "dram", False, 1),
    ]
    assert d.lookup_tokens(tokens, "other", 2).prefix == []
    assert d.lookup_tokens(tokens[:3], "m").chunks == 0


def test_list_keys_pages_cover_everything_once_under_churn() -> None:
    d = KeyDirectory(CS)
    a = Emitter("a")
    keys = [key(n, rank=r, ws=2) for n in range(200) for r in (0, 1)]
    d.consume(a.batch("store", [entry(k) for k in keys]))
    d.consume(a.batch("store", [entry(k) for k in keys[::3]], tier="l2", backend="fs"))
    seen = []
    cursor = None
    pages = 0
    while True:
        page = d.list_keys(cursor=cursor, limit=7)
        seen += [kp.key for kp in page.items]
        pages += 1
        if pages == 5:  # churn during the listing: new and deleted keys
            d.consume(a.batch("store", [entry(key(250)), entry(key(251))]))
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    present_throughout = set(keys)
    assert len(seen) == len(set(seen))
    assert present_throughout <= set(seen)
    assert [kp.key.chunk_hash for kp in d.list_keys(limit=1000).items] == sorted(
        kp.key.chunk_hash for kp in d.list_keys(limit=1000).items
    )
    l2 = d.list_keys(KeyFilter(tier="l2"), limit=1000)
    assert {kp.key for kp in l2.items} == set(keys[::3]) and l2.next_cursor is None
    assert d.list_keys(KeyFilter(instance_id="nobody"), limit=10).items == []
    short = d.list_keys(KeyFilter(backend="fs"), limit=1000, max_scan=10)
    assert short.next_cursor is not None and len(short.items) <= 10
    with pytest.raises(ValueError):
        d.list_keys(cursor="zz")


def test_config_capacity_newest_revision_wins() -> None:
    d = KeyDirectory(CS)
    a = Emitter("a")

    def cfg(em: Emitter, tier: str, n: int, rev: int) -> None:
        d.consume(
            em.batch("config", tier=tier, backend="", capacity_bytes=n, capacity_revision=rev)
        )

    cfg(a, "l1", 100, 1)
    cfg(a, "l2", 500, 1)  # same revision: merged
    assert d.capacities()["a"].capacities == {("l1", ""): 100, ("l2", ""): 500}
    cfg(a, "l1", 50, 0)  # older revision: ignored
    assert d.stats().capacity_bytes_by_instance == {"a": 600}
    cfg(a, "l1", 70, 2)  # newer: replaces
    assert d.capacities()["a"].capacities == {("l1", ""): 70}
    a.restart()
    cfg(a, "l2", 9, 0)  # newer incarnation beats any older revision
    assert d.capacities()["a"].capacities == {("l2", ""): 9}
    d.deregister("a")
    assert d.capacities() == {}


def test_a_deregistered_instances_private_declarations_are_forgotten() -> None:
    """Departed emitters must not accumulate: each private (``shared: false``) declaration
    the usage view keeps its instance's goes with the instance."""
    d = KeyDirectory(CS)
    for i in range(50):
        em = Emitter(f"e{i}")
        d.consume(em.batch("config", tier="l2", backend="fs", capacity_bytes=1 << 20,
                           capacity_revision=1))  # fmt: skip
        d.deregister(em.instance_id)
    assert d.capacities() == {} and d.usage().modules == []
    assert not d._private  # (the set the usage view reads; it kept all 50)


def test_blend_lookup_chunk_size_must_match() -> None:
    with pytest.raises(ValueError):
        KeyDirectory(CS).enable_blend_lookup(CS + 1)
    with pytest.raises(ValueError):
        KeyDirectory(0)
    with pytest.raises(TypeError):
        KeyDirectory(CS).consume("not a batch")  # type: ignore[arg-type]


def test_chunk_records_are_invisible_to_the_cyclic_gc() -> None:
    """Millions of chunks must not lengthen full-collection pauses: a record holds only
    untracked values (ints, strs, arrays, tuples of those), so CPython untracks it."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 9)]))
    d.consume(em.batch("store", [entry(key(n, rank=1, ws=2)) for n in range(1, 5)], tier="l2"))
    d.consume(em.batch("access", [entry(key(1))], ts=5.0))
    gc.collect()  # untracks the placement rows, then (next pass) the records holding them
    gc.collect()
    records = list(captured(d).values())  # built now (the table and a capture keep columns)
    gc.collect(0)  # a young collection untracks them: they hold nothing tracked
    assert len(records) == 8 and not any(gc.is_tracked(r) for r in records)
    assert d.lookup([key(1)])[0].placements[0].last_access == 5.0


class _CountingReads(list[Any]):
    """A column that counts the rows read from it."""

    reads = 0

    def __getitem__(self, i: Any) -> Any:
        self.reads += 1
        return super().__getitem__(i)


def test_stats_visit_no_chunk() -> None:
    """``GET /directory/stats``, the status page and every ``/metrics`` scrape read the
    statistics under the directory's lock: counting the chunks with known content by a pass
    over them held it ≈0.4 µs a chunk (84 ms at 200,000 chunks; a scrape stalled ingest and
    lookups for that long). The count is kept as chunks change, and equals a pass."""
    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter()
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 0) for n in range(40)]))
    d.consume(em.batch("store", [entry(key(n)) for n in range(40, 50)]))  # content unknown
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 0) for n in range(45, 48)]))
    d.consume(em.batch("delete", [entry(key(n)) for n in (0, 1, 41)]))  # chunks gone
    d.consume(em.batch("store", [entry(key(n), toks(n, 1, n, 1), 0) for n in (100, 101)]))
    parts = d._chunks.parts
    cols = parts[0].cols
    reads = cols.objs = _CountingReads(cols.objs)
    stats = d.stats()
    assert reads.reads == 0
    recs = [rec for p in parts for rec in p.values()]
    assert stats.bound_chunks == sum(rec[0] is not None for rec in recs) == 38 + 3 + 2
    assert stats.chunks == len(recs) == 40 - 2 + 10 - 1 + 2


def test_a_page_is_built_outside_the_directory_lock() -> None:
    """A listing page takes each partition's records under the lock (one partition a hold)
    and builds its items — public placements, keys, widened contents, the filter — after:
    built under it, a page of 10,000 keys held ingest and lookups ≈20 µs a key."""
    d, em = KeyDirectory(CS), Emitter()
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 0) for n in range(60)]))
    held: list[bool] = []

    class Watched(KeyFilter):
        def admits_row(self, row: Any) -> bool:
            held.append(d._lock.locked())
            return bool(super().admits_row(row))

    first = d.list_keys(Watched(tier="l1"), limit=25)
    rest = d.list_keys(Watched(tier="l1"), cursor=first.next_cursor, limit=100)
    assert len(first.items) == 25 and len(rest.items) == 35 and rest.next_cursor is None
    assert held and not any(held)
    every = [kp.key for kp in d.list_keys(limit=100).items]
    assert [kp.key for kp in first.items + rest.items] == every
    assert all(kp.content is not None for kp in first.items)


def _pk(n: int, rank: int) -> ObjectKey:
    """A key of chunk ``n`` in partition ``n % 3`` (many chunks a partition), rank ``rank``."""
    return ObjectKey(bytes([n % 3]) + n.to_bytes(31, "big"), "m", pack_kv_rank(3, rank, 3, rank))


@settings(max_examples=80, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 3), st.booleans()), max_size=40),
    limit=st.integers(1, 6),
    max_scan=st.one_of(st.none(), st.integers(1, 8)),
    l2_only=st.booleans(),
    shrunk=st.lists(st.integers(0, 60), max_size=8),
)
@example(  # the cursor in chunk 0 past its keys: the page takes chunks 0 and 3, fills on 3
    chunks=[(0, 3, False), (3, 1, False), (6, 1, False), (9, 1, False)],
    limit=1, max_scan=None, l2_only=False, shrunk=[0],
)  # fmt: skip
@example(  # the same with the scan budget as the bound
    chunks=[(0, 3, True), (3, 1, True), (6, 1, True), (9, 1, True)],
    limit=5, max_scan=1, l2_only=True, shrunk=[0],
)  # fmt: skip
def test_paging_returns_each_admitted_key_once_in_order(
    chunks: list[tuple[int, int, bool]],
    limit: int,
    max_scan: int | None,
    l2_only: bool,
    shrunk: list[int],
) -> None:
    """Pages from any cursor, limit and scan budget, against a brute-force pass: every key
    the filter admits, once, in (chunk hash, key) order — also when a cursor lands inside a
    chunk whose later keys went since (the page then examines fewer chunks than it took)."""
    d, a = KeyDirectory(CS), Emitter("a")
    for n, ranks, l2 in chunks:  # a chunk with 1-3 keys (ranks), some also in L2
        ks = [_pk(n, r) for r in range(ranks)]
        d.consume(a.batch("store", [entry(k) for k in ks]))
        if l2:
            d.consume(a.batch("store", [entry(k) for k in ks], tier="l2", backend="fs"))
    where = KeyFilter(tier="l2") if l2_only else KeyFilter()
    keys = {_pk(n, r) for n, ranks, _ in chunks for r in range(ranks)}
    held = {kp.key: kp.placements for kp in d.lookup(list(keys))}
    expected = sorted(
        (k for k, pls in held.items() if pls and (not l2_only or any(p.tier == "l2" for p in pls))),
        key=lambda k: (k.chunk_hash, k.kv_rank),
    )
    seen: list[ObjectKey] = []
    cursor, pages = None, 0
    while True:
        page = d.list_keys(where, cursor=cursor, limit=limit, max_scan=max_scan)
        assert len(page.items) <= limit
        seen += [kp.key for kp in page.items]
        if pages == 1:  # chunks lose their later keys between pages (one may hold the cursor)
            gone = [_pk(n, r) for n in shrunk for r in (1, 2)]
            for tier, backend in (("l1", "dram"), ("l2", "fs")):
                d.consume(a.batch("delete", [entry(k) for k in gone], tier=tier, backend=backend))
            expected = [k for k in expected if k not in set(gone) or k in seen]
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == expected


@pytest.mark.parametrize("change", ["earlier key gone", "earlier key added"])
def test_a_cursor_inside_a_chunk_resumes_after_the_last_key_returned(change: str) -> None:
    """A page that ends inside a chunk's keys resumes after the last key it returned, not at
    a position: a key of that chunk that sorts before the cursor going (or coming) between
    pages shifted the positions, so a key present throughout the listing was skipped (or
    returned twice). Found by a concurrency probe's listings under churn (a repeat)."""
    d, a = KeyDirectory(CS), Emitter("a")
    ranks = [1, 2] if change == "earlier key added" else [0, 1, 2]
    d.consume(a.batch("store", [entry(_pk(3, r)) for r in ranks]))
    first = d.list_keys(limit=len(ranks) - 1)
    assert [kp.key for kp in first.items] == [_pk(3, r) for r in ranks[:-1]]
    if change == "earlier key gone":
        d.consume(a.batch("delete", [entry(_pk(3, 0))]))
    else:
        d.consume(a.batch("store", [entry(_pk(3, 0))]))
    rest = d.list_keys(cursor=first.next_cursor, limit=10)
    assert [kp.key for kp in rest.items] == [_pk(3, 2)] and rest.next_cursor is None
