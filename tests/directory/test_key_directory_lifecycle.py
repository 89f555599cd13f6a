"""The token-binding / blend-index lifecycle table (docs/directory.md), row by row."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest

from kvatlas.directory import (
    AddColumns,
    AddOp,
    BlendIndex,
    KeyDirectory,
    RemoveChunkOp,
    RemoveClaimColumns,
    RemoveClaimOp,
)
from kvatlas.directory.records import record_stored_tokens, record_tokens
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks

NS_A = BlendNamespace("m", "", 1)
NS_B = BlendNamespace("m", "tenant-b", 1)  # another tenant: its binding is its own
NS_X = BlendNamespace("x", "", 1)  # another namespace of NS_A's salt: one binding with it
A = toks(1, 2, 3, 4)
B = toks(5, 6, 7, 8)


class SpyIndex(BlendIndex):
    """A real index that also records the directory's calls (name, chunk hash, extra)."""

    instances: ClassVar[list[SpyIndex]] = []

    def __init__(self, chunk_size: int = 256, probe_stride: int = 1) -> None:
        super().__init__(chunk_size, probe_stride)
        self.calls: list[tuple[Any, ...]] = []
        SpyIndex.instances.append(self)

    def apply(self, ops: Any) -> None:
        """Every write (the single-op methods go through ``apply`` too), recorded per op (an
        ``AddColumns`` or ``RemoveClaimColumns`` as the ops it stands for)."""
        ops = list(ops)
        columns = AddColumns | RemoveClaimColumns
        for op in [one for o in ops for one in (o.ops() if isinstance(o, columns) else [o])]:
            if isinstance(op, AddOp):
                self.calls.append(
                    ("add", op.chunk_hash[0], op.token_offset, op.namespace, id(op.tokens))
                )
            elif isinstance(op, RemoveClaimOp):
                self.calls.append(("remove_claim", op.chunk_hash[0], op.namespace))
            else:
                assert isinstance(op, RemoveChunkOp)
                self.calls.append(("remove_chunk", op.chunk_hash[0]))
        super().apply(ops)


@pytest.fixture
def spy() -> type[SpyIndex]:
    SpyIndex.instances = []
    return SpyIndex


def calls(d: KeyDirectory) -> list[tuple[Any, ...]]:
    """The index writes since the last call (each test builds one directory with a spy)."""
    assert d.blend_lookup_enabled
    (index,) = SpyIndex.instances
    out = list(index.calls)
    index.calls.clear()
    return out


def names(d: KeyDirectory) -> list[str]:
    return [c[0] for c in calls(d)]


def found(d: KeyDirectory, tokens: Any, ns: BlendNamespace = NS_A) -> list[tuple[int, int]]:
    query = np.concatenate([toks(0, 0), tokens])
    return [(m.chunk_hash[0], m.old_st) for m in d.blend_match(query, ns) if m.cur_st == 2]


def blend_dir() -> KeyDirectory:
    return KeyDirectory(CS, enable_blend_lookup=True, blend_index_factory=SpyIndex)


def blend_stat(d: KeyDirectory, name: str) -> Any:
    stats = d.stats().blend
    assert stats is not None
    return getattr(stats, name)


def test_first_content_binds_and_adds(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    e = entry(key(1), A, 8)
    d.consume(em.batch("store", [e]))
    (call,) = calls(d)
    assert call[:4] == ("add", 1, 8, NS_A)
    rec = captured(d)[key(1).chunk_hash]
    # one array per content: the binding's (stored compactly) is the index's
    assert call[4] == id(record_stored_tokens(rec))
    assert np.array_equal(record_tokens(rec), e.token_ids)  # type: ignore[arg-type]
    assert found(d, A) == [(1, 8)]


def test_first_content_for_existing_keys_adds_every_namespace_of_its_salt(
    spy: type[SpyIndex],
) -> None:
    d, em = blend_dir(), Emitter()
    keys = [entry(key(1)), entry(key(1, model="x")), entry(key(1, salt="tenant-b"))]
    d.consume(em.batch("store", keys))
    assert calls(d) == []
    d.consume(em.batch("store", [entry(key(1), A, 0)], tier="l2", backend="fs"))
    assert sorted(c[3].model_name for c in calls(d)) == ["m", "x"]
    assert found(d, A, NS_A) == [(1, 0)] and found(d, A, NS_X) == [(1, 0)]
    assert found(d, A, NS_B) == []  # tenant-b stored no ids: it matches nothing


def test_different_content_is_retired_then_readded(spy: type[SpyIndex]) -> None:
    """Within the one namespace that holds the chunk (two nodes' copies): the last writer
    rebinds, the old content retired before the new one is added."""
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0)]))
    d.consume(Emitter("b").batch("store", [entry(key(1), A, 0)]))
    calls(d)
    d.consume(em.batch("store", [entry(key(1), B, 4)]))
    got = calls(d)
    assert got[0] == ("remove_chunk", 1)
    assert [(c[0], c[2], c[3].cache_salt) for c in got[1:]] == [("add", 4, "")]
    assert found(d, A) == [] and found(d, B) == [(1, 4)]


def test_different_content_leaves_another_namespaces_binding(spy: type[SpyIndex]) -> None:
    """Held under two namespaces of one salt (two models), a store of other ids under one of
    them changes nothing: not model x's matches, not the writer's own (the chunk's content is
    the namespaces' together), counted as a content conflict."""
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0), entry(key(1, model="x"), A, 0)]))
    calls(d)
    d.consume(em.batch("store", [entry(key(1), B, 4)]))
    assert calls(d) == []
    assert found(d, A) == [(1, 0)] and found(d, A, NS_X) == [(1, 0)] and found(d, B) == []
    assert d.stats().content_conflicts == 1


def test_another_salts_other_content_is_its_own_binding(spy: type[SpyIndex]) -> None:
    """Held under two salts (tenants), a store of other ids under one of them binds that
    salt's own content: the other's binding and matches are untouched, no conflict."""
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0), entry(key(1, salt="tenant-b"), A, 0)]))
    calls(d)
    d.consume(em.batch("store", [entry(key(1, salt="tenant-b"), B, 4)]))
    got = calls(d)  # (under tenant-b's own occupant hash: tenant_bindings.py)
    assert [c[0] for c in got] == ["remove_claim", "add"]
    assert got[0][2] == NS_B and got[1][2:4] == (4, NS_B)
    assert found(d, A) == [(1, 0)] and found(d, B, NS_B) == [(1, 4)]
    assert found(d, A, NS_B) == [] and found(d, B) == []
    assert d.stats().content_conflicts == 0


def test_tokenless_store_claims_known_content_at_once(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0)]))
    assert found(d, A, NS_B) == []
    calls(d)
    d.consume(Emitter("b").batch("store", [entry(key(1, model="x"))]))
    assert [c[:4] for c in calls(d)] == [("add", 1, 0, NS_X)]
    assert found(d, A, NS_X) == [(1, 0)]
    d.consume(Emitter("b").batch("store", [entry(key(1, salt="tenant-b"))]))
    assert calls(d) == []  # another salt's key claims nothing of this salt's binding
    assert found(d, A, NS_B) == [] and d.lookup([key(1, salt="tenant-b")])[0].content is None


def test_tokenless_unknown_content_is_not_indexed_until_repaired(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1))]))
    assert calls(d) == [] and found(d, A) == []
    d.consume(em.batch("store", [entry(key(1), A, 0)]))
    assert names(d) == ["add"] and found(d, A) == [(1, 0)]


def test_wrong_length_content_is_bound_not_indexed(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), toks(1, 2, 3), 0)]))
    assert calls(d) == []
    assert d.stats().bound_chunks == 1
    assert blend_stat(d, "occupants") == 0


def test_unknown_offset_is_bound_never_indexed_until_a_real_offset(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, -1)]))
    assert calls(d) == [] and found(d, A) == [] and d.stats().bound_chunks == 1
    d.consume(em.batch("store", [entry(key(1, model="x"))]))
    assert calls(d) == []  # a claim on unindexable content indexes nothing either
    d.consume(em.batch("store", [entry(key(1), A, 12)]))
    assert sorted(c[3].model_name for c in calls(d)) == ["m", "x"]
    assert found(d, A) == [(1, 12)]
    d.consume(em.batch("store", [entry(key(1), A, -1)]))  # unknown never erases a known offset
    assert calls(d) == [] and found(d, A) == [(1, 12)]


def test_last_key_of_a_namespace_removes_its_claim(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    both = [entry(key(1), A, 0), entry(key(1, model="x"), A, 0)]
    d.consume(em.batch("store", both))
    calls(d)
    d.consume(em.batch("delete", [entry(key(1, model="x"))]))
    assert calls(d) == [("remove_claim", 1, NS_X)]
    assert found(d, A, NS_X) == [] and found(d, A) == [(1, 0)]


def test_last_key_of_another_salt_leaves_the_chunk_to_the_first(spy: type[SpyIndex]) -> None:
    """Its claim goes, and the first salt's binding is indexed under the chunk hash again."""
    d, em = blend_dir(), Emitter()
    both = [entry(key(1), A, 0), entry(key(1, salt="tenant-b"), A, 0)]
    d.consume(em.batch("store", both))
    calls(d)
    d.consume(em.batch("delete", [entry(key(1, salt="tenant-b"))]))
    got = calls(d)
    removed = sorted((c[2] for c in got if c[0] == "remove_claim"), key=str)
    assert removed == sorted([NS_A, NS_B], key=str)
    assert [c[1:4] for c in got if c[0] == "add"] == [(1, 0, NS_A)]
    assert found(d, A, NS_B) == [] and found(d, A) == [(1, 0)]
    assert blend_stat(d, "occupants") == 1


def test_namespace_claim_stays_while_another_rank_lives(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    ranks = [entry(key(1, ws=2, rank=r), A, 0) for r in (0, 1)]
    d.consume(em.batch("store", ranks))
    calls(d)
    ns2 = BlendNamespace("m", "", 2)
    d.consume(em.batch("delete", [ranks[0]]))
    assert calls(d) == [] and found(d, A, ns2) == [(1, 0)]
    d.consume(em.batch("delete", [ranks[1]]))
    assert calls(d) == [("remove_claim", 1, ns2)]


def test_last_placement_removes_claim_and_binding(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0)]))
    d.consume(em.batch("store", [entry(key(1), A, 0)], tier="l2", backend="fs"))
    calls(d)
    d.consume(em.batch("delete", [entry(key(1))]))
    assert calls(d) == [] and found(d, A) == [(1, 0)]  # an L2 copy still holds it
    d.consume(em.batch("delete", [entry(key(1))], tier="l2", backend="fs"))
    assert calls(d) == [("remove_claim", 1, NS_A)]
    assert d.stats().bound_chunks == 0 and blend_stat(d, "occupants") == 0
    d.consume(em.batch("store", [entry(key(1))]))  # binding went with its last key
    assert calls(d) == [] and found(d, A) == []


@pytest.mark.parametrize("how", ["fence", "deregister", "restart"])
def test_fence_deregister_restart_remove_lost_claims(spy: type[SpyIndex], how: str) -> None:
    d, em = blend_dir(), Emitter("a")
    d.consume(em.batch("store", [entry(key(1), A, 0), entry(key(2), B, 4)]))
    d.consume(em.batch("store", [entry(key(2), B, 4)], tier="l2", backend="fs"))
    calls(d)
    if how == "fence":
        assert d.fence_instance("a") == 2
    elif how == "deregister":
        d.deregister("a")
    else:
        em.restart()
        d.consume(em.batch("access"))
    assert calls(d) == [("remove_claim", 1, NS_A)]
    assert found(d, A) == [] and found(d, B) == [(2, 4)]  # L2 survives fencing
    assert [len(kp.placements) for kp in d.lookup([key(1), key(2)])] == [0, 1]


def test_blend_off_does_nothing_and_enabling_is_not_retroactive(spy: type[SpyIndex]) -> None:
    d, em = KeyDirectory(CS, blend_index_factory=SpyIndex), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0), entry(key(2), B, 4)]))
    assert spy.instances == [] and d.blend_match(np.concatenate([A, B]), NS_A) == []
    assert d.stats().blend is None
    d.enable_blend_lookup(CS, 1)
    assert found(d, A) == [] and calls(d) == []
    d.consume(em.batch("store", [entry(key(2), B, 4)]))  # a fresh report indexes it
    assert found(d, B) == [(2, 4)] and found(d, A) == []


def test_same_store_again_is_idempotent(spy: type[SpyIndex]) -> None:
    d, em = blend_dir(), Emitter()
    e = [entry(key(1), A, 0), entry(key(1, salt="tenant-b"), A.copy(), 0)]
    d.consume(em.batch("store", e))
    before = (d.lookup([key(1)]), d.stats())
    calls(d)
    d.consume(em.batch("store", e))
    assert calls(d) == []
    after = (d.lookup([key(1)]), d.stats())
    assert before[0] == after[0]
    assert before[1].keys == after[1].keys and before[1].placements == after[1].placements


def test_blend_match_does_not_take_the_directory_lock() -> None:
    applying, release = threading.Event(), threading.Event()
    timed_out: list[bool] = []
    hold = False

    class HoldingIndex(BlendIndex):
        """Holds a batch's index writes (so the directory lock) until released."""

        def apply(self, ops: Any) -> None:
            if hold:
                applying.set()
                timed_out.append(not release.wait(30))
            super().apply(ops)

    d, em = KeyDirectory(CS, enable_blend_lookup=True, blend_index_factory=HoldingIndex), Emitter()
    d.consume(em.batch("store", [entry(key(1), A, 0)]))
    hold = True
    worker = threading.Thread(target=d.consume, args=(em.batch("store", [entry(key(2), B, 4)]),))
    worker.start()
    try:
        assert applying.wait(30)  # event application in progress, directory lock held
        assert [m.old_st for m in d.blend_match(A, NS_A)] == [0]
    finally:
        release.set()
        worker.join()
    assert timed_out == [False]  # blend_match answered while the directory lock was held
