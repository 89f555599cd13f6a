"""Runs of store batches stored at once (``directory/store_runs.py``) against the same batches
applied one by one (differential): bodies of several batches, mostly one emitter's next
stores of new chunks (what a node posts), sometimes broken by a gap, a duplicate, another
emitter, tier or incarnation, a delete, a chunk held already or named twice, applied with
``apply_columns`` as objects and as a decoded JSON body (one arena), leave the directory that
``consume`` of each batch in turn leaves: records (placements with their own batch's
timestamp), digests, counters, cursors, blend answers, and the observer told the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory
from kvatlas.directory import chunk_stores as stores_module
from kvatlas.directory.gate import Outcome
from kvatlas.directory.store_runs import run_length
from kvatlas.events import (
    CacheEntry,
    ColumnBatch,
    EventBatch,
    decode_json_columns,
    decode_msgpack_columns,
    encode_json,
    encode_msgpack,
)
from kvatlas.keys import ObjectKey
from tests.directory.test_columnar_ingest import CHUNK, CONTENTS, SHAPES, _state
from tests.directory.test_fresh_chunks import _inside

HASHES = [bytes([i % 251 + 1, i // 251]) + bytes(29) + bytes([i % 7]) for i in range(600)]
_HASH = st.integers(0, len(HASHES) - 1).map(HASHES.__getitem__)
_HOT_HASH = st.sampled_from(HASHES[:4])  # held already, or named twice, now and then
_WHOLE = st.sampled_from(CONTENTS[:3])
_ODD_CONTENT = st.sampled_from([None, CONTENTS[3]])
_OFFSET = st.sampled_from([0, CHUNK, 2 * CHUNK])


@st.composite
def entry_st(draw: st.DrawFn, plain: bool) -> CacheEntry:
    """A chunk of the first shape, whole, its offset known, likely new (what a bulk store
    takes); unless ``plain``, one of them changed now and then."""
    odd = 9 if plain else draw(st.integers(0, 9))
    shape = SHAPES[1] if odd == 0 else SHAPES[0]
    tokens = draw(_ODD_CONTENT) if odd == 1 else draw(_WHOLE)
    offset = -1 if odd == 2 else draw(_OFFSET)
    h = draw(_HOT_HASH) if odd == 3 else draw(_HASH)
    return CacheEntry(ObjectKey(h, *shape), draw(st.sampled_from([1, 9])), tokens, offset)


@st.composite
def body_st(draw: st.DrawFn, seqs: dict[str, int]) -> list[EventBatch]:
    """One body's batches: mostly the next stores of emitter ``a``; ``seqs`` the last seq
    each emitter sent (drawn on from body to body)."""
    batches = []
    for _ in range(draw(st.integers(1, 5))):
        odd = draw(st.integers(0, 11))
        inst = "b" if odd == 0 else "a"
        last = seqs.get(inst, 0)
        seq = last + (2 if odd == 1 else 0 if odd == 2 and last else 1)
        seqs[inst] = max(last, seq)
        kind = "delete" if odd == 3 else "store"
        plain = draw(st.integers(0, 3)) > 0
        size = (0 if odd == 4 else 1, 6)
        entries = tuple(draw(st.lists(entry_st(plain), min_size=size[0], max_size=size[1])))
        batches.append(
            EventBatch(
                inst,
                2 if odd == 5 else 1,
                seq,
                kind,
                "l2" if odd == 6 else "l1",
                "disk" if odd == 7 else "dram",
                odd == 8,
                ts=float(seq) + 0.5 * odd,
                entries=entries,
                dropped_events=3 if odd == 9 else 0,
            )
        )
    return batches


class Told:
    """An observer that keeps what it is told."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def applied(self, batch: ColumnBatch, fenced_first: bool) -> None:
        self.calls.append(("applied", batch.batch(), fenced_first))

    def fenced(self, instance_id: str) -> None:
        self.calls.append(("fenced", instance_id))


def _directory() -> tuple[KeyDirectory, Told]:
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    d.observer = told = Told()
    return d, told


def _same(a: KeyDirectory, b: KeyDirectory) -> None:
    assert _inside(a) == _inside(b)
    assert _state(a) == _state(b)
    keys = [ObjectKey(h, *s) for h in HASHES for s in SHAPES[:2]]

    def held(d: KeyDirectory) -> list[Any]:
        return [(r.placements, r.content is None or r.content.tolist()) for r in d.lookup(keys)]

    assert held(a) == held(b)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_runs_stored_at_once_equal_batches_one_by_one(data: st.DataObject) -> None:
    one, told_one = _directory()
    objects, told_objects = _directory()
    decoded, told_decoded = _directory()
    seqs: dict[str, int] = {}
    for _ in range(data.draw(st.integers(1, 4))):
        body = data.draw(body_st(seqs))
        outcomes = [one.consume(b) for b in body]
        assert objects.apply_columns([ColumnBatch.of(b) for b in body]) == outcomes
        assert decoded.apply_columns(decode_json_columns(encode_json(body))) == outcomes
        _same(objects, one)
        _same(decoded, one)
    assert told_objects.calls == told_one.calls
    assert told_decoded.calls == told_one.calls


def _fresh_body(n_batches: int, per_batch: int) -> list[EventBatch]:
    """One emitter's next stores of new chunks, each batch its own timestamp."""
    hashes = iter(HASHES)
    body = []
    for seq in range(1, n_batches + 1):
        entries = tuple(
            CacheEntry(ObjectKey(next(hashes), *SHAPES[0]), 9, CONTENTS[k % 3], k * CHUNK)
            for k in range(per_batch)
        )
        body.append(EventBatch("a", 1, seq, "store", "l1", "dram", ts=100.0 + seq, entries=entries))
    return body


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which store path each call took: ``run`` (a run at once), ``one`` (a batch's store)."""
    taken: list[str] = []
    store, store_run = stores_module.StoreRules.store, stores_module.StoreRules.store_run

    def one(self: Any, *args: Any) -> None:
        taken.append("one")
        store(self, *args)

    def run(self: Any, *args: Any) -> bool:
        done = store_run(self, *args)
        taken.append("run" if done else "run refused")
        return done

    monkeypatch.setattr(stores_module.StoreRules, "store", one)
    monkeypatch.setattr(stores_module.StoreRules, "store_run", run)
    return taken


@pytest.mark.parametrize(
    "decode", [decode_json_columns, decode_msgpack_columns], ids=["json", "msgpack"]
)
def test_a_bodys_batches_of_new_chunks_are_stored_at_once(stores: list[str], decode: Any) -> None:
    """The usual body (one emitter's next batches of new chunks) takes one bulk store; each
    chunk is placed with its own batch's timestamp."""
    body = _fresh_body(4, 3)
    d, told = _directory()
    data = (encode_json if decode is decode_json_columns else encode_msgpack)(body)
    assert d.apply_columns(decode(data)) == [Outcome.APPLIED] * 4
    assert stores == ["run"]
    assert [c[1] for c in told.calls] == body
    for b in body:
        for e, r in zip(b.entries, d.lookup([e.key for e in b.entries]), strict=True):
            assert [p.last_access for p in r.placements] == [b.ts]
            assert np.array_equal(r.content, e.token_ids)
    assert d.gap_state("a") is not None and d.gap_state("a").last_seq == 4  # type: ignore[union-attr]


def test_a_run_with_a_chunk_held_is_stored_batch_by_batch(stores: list[str]) -> None:
    """A run whose third batch re-stores a chunk the table holds is refused whole (nothing
    changed) and its batches stored one by one, as ``consume`` would."""
    body = _fresh_body(4, 3)
    held = body[2].entries[1]
    one, _ = _directory()
    d, _ = _directory()
    for x in (one, d):
        x.consume(EventBatch("b", 1, 1, "store", "l1", "dram", entries=(held,)))
    stores.clear()
    assert d.apply_columns([ColumnBatch.of(b) for b in body]) == [Outcome.APPLIED] * 4
    assert stores == ["run refused", "one", "one", "one", "one"]
    for b in body:
        one.consume(b)
    _same(d, one)


@pytest.mark.parametrize(
    ("change", "length"),
    [
        ({}, 4),
        ({"seq": 4}, 2),  # a gap
        ({"seq": 2}, 2),  # a duplicate
        ({"instance_id": "b"}, 2),
        ({"incarnation": 2}, 2),
        ({"tier": "l2"}, 2),
        ({"backend": "disk"}, 2),
        ({"shared": True}, 2),
        ({"event_type": "delete"}, 2),
    ],
)
def test_what_breaks_a_run(change: dict[str, Any], length: int) -> None:
    """The third batch changed: the run stops before it."""
    body = _fresh_body(4, 1)
    third = body[2]
    fields = {f: getattr(third, f) for f in third.__dataclass_fields__} | change
    body[2] = EventBatch(**fields)
    assert run_length([ColumnBatch.of(b) for b in body], 0) == length
