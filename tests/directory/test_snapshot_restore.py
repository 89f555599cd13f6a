"""Restore: a restored directory is the saved one (placements, contents, counts, blend answers
against the brute-force oracle), before and after further changes; each content is filled
from the section read into one buffer, correctly whatever the forms and lengths, and the
buffer is freed."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.blend.kernels.planes import FORM_U16
from kvatlas.directory.records import record_offset, record_stored_tokens, record_tokens, shape_ids
from kvatlas.directory.snapshot.token_section import allocated_contents, fill_piece, fill_targets
from kvatlas.directory.token_store import (
    form_sizes,
    stored_form,
    stored_one,
    stored_payload,
    widened,
)
from kvatlas.events import CacheEntry
from kvatlas.keys import BlendMatch, BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks
from tests.directory.test_blend_index_oracle import Oracle, canonical

NAMESPACES = [BlendNamespace("m"), BlendNamespace("m", cache_salt="s"), BlendNamespace("m2")]
BIG = (1 << 16) + 5  # keeps a chunk out of uint16 (in the planes form)


def view(d: KeyDirectory) -> tuple[object, ...]:
    """Everything a restore must reproduce, contents included (``KeyPlacements`` equality
    leaves them out)."""
    items = d.list_keys(limit=100_000).items
    contents = [(kp.key, None if kp.content is None else kp.content.tolist()) for kp in items]
    # batch outcomes and content conflicts are counts since the start, not snapshotted; the
    # blend index's sizes depend on its history
    stats = dataclasses.replace(d.stats(), batches={}, blend=None, content_conflicts=0)
    return items, contents, d.emitters(), d.capacities(), stats, d.usage()


def oracle_of(d: KeyDirectory) -> Oracle:
    """The blend contract over ``d``'s records, naively."""
    oracle = Oracle(CS)
    with d.capture() as capture:
        shapes, tenants = capture.shapes, capture.state.tenants
        for part in capture.parts():
            for h, rec in part.records():
                for ids, offset, salt in bindings_of(h, rec, tenants):
                    # (a salt's binding of a chunk of several salts: an occupant of its own)
                    at = h if salt is None else h + b"\0" + salt.encode()
                    for sid in shape_ids(rec):
                        if salt is None or shapes[sid].cache_salt == salt:
                            oracle.add(ids, at, offset, shapes[sid].namespace)
    return oracle


def bindings_of(
    h: bytes, rec: Any, tenants: dict[bytes, Any]
) -> list[tuple[list[int], int, str | None]]:
    """A chunk's matchable bindings (ids, offset, salt): its record's (for every salt,
    ``None``), or for a chunk of several salts each salt's (directory/tenant_bindings.py)."""
    if h not in tenants:
        tokens = record_tokens(rec)
        if tokens is None or record_offset(rec) < 0:
            return []
        return [(tokens.tolist(), record_offset(rec), None)]
    return [(widened(t).tolist(), at, salt) for salt, (t, at) in tenants[h].items() if at >= 0]


def queries(d: KeyDirectory) -> list[np.ndarray[Any, Any]]:
    """Every bound content between noise, and all of them in a row."""
    contents = [c for _, c in view(d)[1] if c is not None]
    out = [toks(7, *c, 9) for c in contents]
    return [*out, toks(*[t for c in contents for t in c])] if contents else [toks(1, 2, 3, 4, 5)]


Answer = list[tuple[int, bytes, int]]
_answers: dict[tuple[object, ...], dict[tuple[tuple[int, ...], BlendNamespace], Answer]] = {}
"""The oracle's canonical answers by its entries (only the last entries are kept): an answer is
a pure function of the entries, the query and the namespace, and the slab tests ask the same
questions of an unchanged ``d`` step after step (the directories are asked anew every time)."""


def assert_same_answers(restored: KeyDirectory, d: KeyDirectory) -> None:
    oracle = oracle_of(d)
    entries = tuple((k, offset, frozenset(c)) for k, (offset, c) in oracle.entries.items())
    if entries not in _answers:
        _answers.clear()
    answers = _answers.setdefault(entries, {})
    for q in queries(d):
        query = tuple(q.tolist())
        for ns in NAMESPACES:
            if (query, ns) not in answers:
                found = oracle.match(query, ns)  # (an occupant of a salt's own: its chunk's)
                chunks = [BlendMatch(m.chunk_hash[:32], m.old_st, m.cur_st) for m in found]
                answers[query, ns] = canonical(chunks)
            want = answers[query, ns]
            assert canonical(restored.blend_match(q, ns)) == want
            assert canonical(d.blend_match(q, ns)) == want


token_ids = st.one_of(st.integers(0, 50), st.just(BIG))
contents = st.one_of(
    st.none(),
    st.lists(token_ids, min_size=CS, max_size=CS),
    st.lists(token_ids, min_size=1, max_size=CS + 3),  # odd lengths
)
store_entries = st.lists(
    st.tuples(
        st.integers(1, 12),
        st.sampled_from([("m", ""), ("m", "s"), ("m2", "")]),
        contents,
        st.sampled_from([-1, 0, 8]),
    ),
    max_size=8,
)
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.sampled_from(["a", "b"]),
            st.sampled_from([("l1", False), ("l2", False), ("l2", True)]),
            store_entries,
        ),
        st.tuples(
            st.just("delete"), st.sampled_from(["a", "b"]), st.just(("l1", False)), store_entries
        ),
    ),
    max_size=10,
)


def apply(ds: list[KeyDirectory], emitters: dict[str, Emitter], program: list[Any]) -> None:
    """The same batches into each of ``ds`` (each batch numbered once: one emitter)."""
    for kind, inst, (tier, shared), rows in program:
        batch = emitters[inst].batch(
            kind,
            [
                CacheEntry(key(n, model, salt), 10 + n, None if t is None else toks(*t), off)
                for n, (model, salt), t, off in rows
            ],
            tier=tier,
            backend="pool" if shared else "dram",
            shared=shared,
        )
        for d in ds:
            d.consume(batch)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(before=ops, after=ops)
def test_restore_is_the_saved_directory_before_and_after_more_changes(
    tmp_path: Path, before: list[Any], after: list[Any]
) -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    emitters = {"a": Emitter("a"), "b": Emitter("b")}
    apply([d], emitters, before)
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    restored, plain = KeyDirectory(CS, enable_blend_lookup=True), KeyDirectory(CS)
    load_snapshot(restored, path)
    load_snapshot(plain, path)
    assert view(restored) == view(d) == view(plain)
    assert_same_answers(restored, d)
    apply([d, restored, plain], emitters, after)  # removals, rebinds, re-stores
    assert view(restored) == view(d) == view(plain)
    assert_same_answers(restored, d)
    save_snapshot(restored, tmp_path / "again.snap")  # restored contents written again
    again = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(again, tmp_path / "again.snap")
    assert view(again) == view(d)
    assert_same_answers(again, d)
    for inst in emitters:  # fencing walks the restored per-instance L1 chunk sets
        dropped = d.fence_instance(inst)
        assert restored.fence_instance(inst) == dropped == plain.fence_instance(inst)
    assert view(restored) == view(d) == view(plain)
    assert_same_answers(restored, d)


def test_the_read_buffer_is_seen_by_tracemalloc_until_it_is_freed() -> None:
    """Memory measurements (``bench directory``, tracemalloc) count a restore's read buffer
    (an anonymous mapping, which the allocators tracemalloc hooks never see)."""
    from kvatlas.directory.snapshot.token_section import _zeroed

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        buffer, into = _zeroed(1 << 20)
        assert tracemalloc.get_traced_memory()[0] - before >= 1 << 20
        del buffer, into
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - before < 1 << 16
    finally:
        tracemalloc.stop()


def test_the_read_buffer_is_freed_before_the_restore_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token section's read buffers (each thread's scratch for its pieces) are gone once
    the contents are filled, and so is the header's (its columns are views of it, so no view
    of it lives on in the restored state): nothing of them is alive while the restored state
    is installed."""
    from kvatlas.directory.snapshot import token_section

    d, em = KeyDirectory(CS, enable_blend_lookup=True), Emitter("a")
    d.consume(em.batch("store", [entry(key(n), toks(n, n, n, n), 4 * n) for n in range(1, 9)]))
    monkeypatch.setattr(token_section, "FILL_PIECE", 2)  # several pieces (the file's too)
    save_snapshot(d, tmp_path / "s.snap")
    alive: list[int] = []
    install = KeyDirectory.install

    def measured(self: KeyDirectory, restored: Any) -> None:
        domain = tracemalloc.DomainFilter(True, token_section._TRACE_DOMAIN)
        traces = tracemalloc.take_snapshot().filter_traces([domain])
        alive.append(sum(s.size for s in traces.statistics("filename")))
        install(self, restored)

    monkeypatch.setattr(KeyDirectory, "install", measured)
    tracemalloc.start()
    try:
        load_snapshot(KeyDirectory(CS, enable_blend_lookup=True), tmp_path / "s.snap")
    finally:
        tracemalloc.stop()
    assert alive == [0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([2, 4, 17, 18, 24]))))
def test_filled_contents_hold_each_chunks_ids(shapes: list[tuple[int, int]]) -> None:
    """What a restore makes of a token section: each chunk's content (``None``: no ids) is
    the one the directory stores for its ids, whatever the forms and lengths before it."""
    rng = np.random.default_rng(len(shapes))
    rows, forms = [], []
    for n, form in shapes:
        top = {2: 1 << 16, 4: 1 << 32}.get(form, 1 << (form - 16 + 16))
        row = rng.integers(0, top, n, dtype=np.uint64).astype(np.uint32)
        if n and form > 4:
            row[0] = top - 1  # the planes form of exactly h high bits, where it pays
        stored = stored_one(row)
        rows.append((row, stored))
        forms.append(stored_form(stored))
    lens = np.array([n for n, _ in shapes], np.int64)
    forms_of = np.array(forms, np.int64)
    section = b"".join(bytes(stored_payload(c)) for (r, c) in rows if len(r))
    got = allocated_contents(lens, forms_of)
    targets = fill_targets(got, lens > 0, forms_of, form_sizes(lens, forms_of))
    fill_piece(targets, np.frombuffer(section, np.uint8))
    for out, (row, stored) in zip(got, rows, strict=True):
        if not len(row):
            assert out is None
            continue
        assert type(out) is bytes and out == stored and widened(out).tolist() == row.tolist()


def test_stats_of_a_restore_after_deletes_are_the_saved_ones(tmp_path: Path) -> None:
    """A tier whose copies are all gone had a 0 left in ``bytes_by_tier`` that a restore
    (which counts what is there) does not have; stats now name the tiers that have
    placements, as ``placements_by_tier`` does (a tier of 0-byte copies is still named)."""
    d, em = KeyDirectory(CS), Emitter("a")
    d.consume(em.batch("store", [entry(key(1), toks(1, 2, 3, 4), 0), entry(key(2))]))
    d.consume(em.batch("store", [entry(key(3))], tier="l2", backend="fs"))
    d.consume(em.batch("delete", [entry(key(1)), entry(key(2))]))
    save_snapshot(d, tmp_path / "s.snap")
    restored = KeyDirectory(CS)
    load_snapshot(restored, tmp_path / "s.snap")
    assert view(restored) == view(d)
    assert d.stats().bytes_by_tier == {"l2": 10}


def test_a_version_1_file_is_compacted_a_group_of_chunks_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.directory.test_snapshot_format import GOLDEN_V1, golden_directory

    monkeypatch.setattr("kvatlas.directory.snapshot.token_section.V1_GROUP", 2)
    d = KeyDirectory(CS)
    load_snapshot(d, GOLDEN_V1)
    assert view(d) == view(golden_directory(before_v7=True))
    for rec in captured(d).values():  # compact where they fit
        tokens = record_stored_tokens(rec)
        assert tokens is None or stored_form(tokens) == FORM_U16


@settings(max_examples=30, deadline=None)
@given(program=ops)
def test_key_count_is_the_stats_key_count(program: list[Any]) -> None:
    """``key_count`` (read at start-up without the pass over every record) is ``stats().keys``."""
    d = KeyDirectory(CS)
    apply([d], {"a": Emitter("a"), "b": Emitter("b")}, program)
    assert d.key_count == d.stats().keys
