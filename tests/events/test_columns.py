"""Entry columns built from objects (``EntryColumns.of_entries``, C-level maps) against the
obvious loop over the entries."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.events import CacheEntry, EventBatch, decode_json_columns, encode_json
from kvatlas.events.columns import ColumnBatch, EntryColumns
from kvatlas.keys import ObjectKey
from tests.events.strategies import entries, object_keys


@settings(max_examples=150, deadline=None)
@given(st.lists(entries(), max_size=12), st.lists(object_keys(), min_size=1, max_size=3))
def test_columns_of_entries_are_the_loops(es: list[CacheEntry], shapes: list[object]) -> None:
    """Every column as a loop over the entries computes it; shapes numbered in order of first
    appearance (entries repeat a few key shapes, as batches do)."""
    es = es + [CacheEntry(k, 1, e.token_ids, e.token_offset) for k in shapes for e in es[:3]]
    cols = EntryColumns.of_entries(es)
    index: dict[tuple[str, int, int, str], int] = {}
    for e in es:
        k = e.key
        index.setdefault((k.model_name, k.kv_rank, k.object_group_id, k.cache_salt), len(index))
    assert cols.shapes == list(index)
    assert cols.chunk_hashes == [e.key.chunk_hash for e in es]
    assert [cols.shapes[s] for s in cols.shape_of.tolist()] == [
        (e.key.model_name, e.key.kv_rank, e.key.object_group_id, e.key.cache_salt) for e in es
    ]
    assert cols.size_bytes.tolist() == [e.size_bytes for e in es]
    assert cols.token_offsets.tolist() == [e.token_offset for e in es]
    assert cols.token_lengths.tolist() == [
        0 if e.token_ids is None else len(e.token_ids) for e in es
    ]
    assert cols.token_objects is not None
    assert all(a is e.token_ids for a, e in zip(cols.token_objects, es, strict=True))
    assert cols.entries() == tuple(es)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3)), max_size=40))
def test_rows_shared_is_two_entries_with_tokens_at_one_start(rows: list[tuple[int, int]]) -> None:
    """Against the definition: starts in any order, repeated, with and without tokens (the
    check skips its sort when the starts rise, as a decoded body's do)."""
    n = len(rows)
    cols = EntryColumns(
        [bytes(32)] * n, [], np.zeros(n, np.intp), np.zeros(n, np.int64), np.zeros(n, np.int64),
        np.zeros(64, np.uint32), np.array([s for s, _ in rows], np.int64),
        np.array([k for _, k in rows], np.int64),
    )  # fmt: skip
    with_tokens = [s for s, k in rows if k > 0]
    assert cols.rows_shared() == (len(set(with_tokens)) != len(with_tokens))


@settings(max_examples=150, deadline=None)
@given(st.lists(entries(), max_size=12), st.lists(object_keys(), max_size=3), st.data())
def test_without_salts_is_the_filtered_loop(
    es: list[CacheEntry], keys: list[ObjectKey], data: st.DataObject
) -> None:
    """A batch without the entries of some salts (a stream entry applied without the salts
    its signer may not store for) holds exactly the other entries, in order, tokens and all:
    built from objects, and decoded from a body (one arena of tokens), alike."""
    es = es + [CacheEntry(k, 1, e.token_ids, e.token_offset) for k in keys for e in es[:3]]
    salts = sorted({e.key.cache_salt for e in es})
    gone = frozenset(data.draw(st.lists(st.sampled_from(salts), unique=True)) if salts else [])
    kept = tuple(e for e in es if e.key.cache_salt not in gone)
    assert EntryColumns.of_entries(es).without_salts(gone).entries() == kept
    batch = EventBatch("n", 1, 1, "store", "l1", "dram", entries=tuple(es))
    (decoded,) = decode_json_columns(encode_json([batch]))
    filtered = decoded.without_salts(gone)
    assert filtered.header.seq == 1 and filtered.batch().entries == kept
    assert (filtered is decoded) == (len(kept) == len(es))
    header_only = ColumnBatch(batch).without_salts(gone)  # a resync's: entries in the header
    assert header_only.batch().entries == kept and header_only.header.seq == 1
