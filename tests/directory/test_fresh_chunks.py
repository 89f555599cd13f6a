"""The bulk store of a batch of new chunks (``fresh_chunks.store_fresh``) against the table's
entry-by-entry loop (differential): the same batches applied to a directory that takes the
bulk path where it can and to one that never does leave identical directories, down to the
records themselves, the inventory digests, the L1 chunk sets and the blend index."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory
from kvatlas.directory import chunk_stores as stores_module
from kvatlas.directory.blend import AddColumns
from kvatlas.directory.blend import index as index_module
from kvatlas.directory.blend import op_columns as op_module
from kvatlas.directory.blend.op_checks import token_nbytes
from kvatlas.directory.blend.op_columns import OpColumns
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
from tests.directory.helpers import captured, l1_chunk_sets, live_records
from tests.directory.test_columnar_ingest import CHUNK, CONTENTS, SHAPES, _state

HASHES = [bytes([i % 256, i // 256]) + bytes(29) + bytes([i % 7]) for i in range(40)]


@st.composite
def store_st(draw: st.DrawFn, seq: int) -> EventBatch:
    """A store batch, mostly of the bulk path's kind (new, distinct, one shape, whole chunks),
    sometimes not (a hash twice or already held, two shapes, no or short content)."""
    n = draw(st.integers(1, 8))
    hashes = draw(st.lists(st.sampled_from(HASHES), min_size=n, max_size=n))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=2))
    contents = draw(st.sampled_from([CONTENTS[:3], CONTENTS]))
    entries = tuple(
        CacheEntry(
            ObjectKey(h, *draw(st.sampled_from(shapes))),
            draw(st.sampled_from([0, 7, 1 << 20])),
            draw(st.sampled_from(contents) | (st.none() if draw(st.booleans()) else st.nothing())),
            draw(st.sampled_from([-1, 0, CHUNK, 2 * CHUNK])),
        )
        for h in hashes
    )
    return EventBatch(
        draw(st.sampled_from(["a", "b"])),
        1,
        seq,
        "store",
        draw(st.sampled_from(["l1", "l2"])),
        "dram",
        draw(st.booleans()),
        ts=float(seq),
        entries=entries,
    )


def _records(d: KeyDirectory) -> dict[bytes, Any]:
    def plain(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return (value.dtype.str, value.tolist(), value.flags.writeable)
        return tuple(map(plain, value)) if isinstance(value, tuple) else value

    return {h: plain(rec) for h, rec in live_records(d).items()}


def _inside(d: KeyDirectory) -> Any:
    counts = d._chunks.counts
    digests = {k: v.tolist() for k, v in counts.digests.items()}
    return _records(d), digests, l1_chunk_sets(d), counts.keys, counts.placements


@pytest.mark.parametrize("blend", [True, False])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bulk_store_equals_the_loop(blend: bool, data: st.DataObject) -> None:
    bulk = KeyDirectory(CHUNK, enable_blend_lookup=blend)
    loop = KeyDirectory(CHUNK, enable_blend_lookup=blend)
    for seq in range(1, data.draw(st.integers(1, 5)) + 1):
        batch = data.draw(store_st(seq))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(stores_module, "store_fresh", lambda *args: None)
            loop.consume(batch)
        bulk.consume(batch)
        assert _inside(bulk) == _inside(loop)
        if blend:
            assert _state(bulk) == _state(loop)


def test_a_batch_of_new_chunks_takes_the_bulk_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual batch (new chunks, one shape, whole contents) is stored in bulk, a batch with
    a chunk the table holds is not; both as the loop would (the test above)."""
    taken = []
    store_fresh = stores_module.store_fresh

    def counted(*args: Any) -> Any:
        out = store_fresh(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(stores_module, "store_fresh", counted)
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    entries = [CacheEntry(ObjectKey(h, *SHAPES[0]), 1, CONTENTS[0], 0) for h in HASHES[:3]]
    d.consume(EventBatch("a", 1, 1, "store", "l1", "dram", entries=tuple(entries)))
    d.consume(EventBatch("a", 1, 2, "store", "l1", "dram", entries=tuple(entries[:1])))
    assert taken == [True, False]


@pytest.mark.parametrize("n", [3, 20])  # a node's few entries and more
@pytest.mark.parametrize("odd", [None, "unknown offset", "short content"])
def test_the_bulk_checks_read_short_and_long_batches_alike(n: int, odd: str | None) -> None:
    """Whether every content is a whole chunk and every offset known (which decide the bulk
    path and what it indexes) is read the same from a batch of a few entries as of many:
    one odd entry last, as the loop stores it."""
    bulk = KeyDirectory(CHUNK, enable_blend_lookup=True)
    loop = KeyDirectory(CHUNK, enable_blend_lookup=True)
    entries = [
        CacheEntry(ObjectKey(h, *SHAPES[0]), 2, CONTENTS[k % 3], CHUNK * k)
        for k, h in enumerate(HASHES[:n])
    ]
    if odd == "unknown offset":
        entries[-1] = replace(entries[-1], token_offset=-1)
    elif odd == "short content":
        entries[-1] = replace(entries[-1], token_ids=CONTENTS[3])
    b = EventBatch("a", 1, 1, "store", "l1", "dram", entries=tuple(entries))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(stores_module, "store_fresh", lambda *args: None)
        loop.consume(b)
    bulk.consume(b)
    assert _inside(bulk) == _inside(loop)
    assert _state(bulk) == _state(loop)


@pytest.mark.parametrize("held", [0, 1, 3])
def test_a_batch_with_a_held_chunk_leaves_the_table_as_the_loop_does(held: int) -> None:
    """The bulk path inserts where absent in one pass; a chunk the table already holds at any
    position of the batch (first, middle, last) makes it take back what it inserted, and the
    loop stores the batch: records, their order in each partition, index and counts as if the
    bulk path had never been tried."""
    bulk = KeyDirectory(CHUNK, enable_blend_lookup=True)
    loop = KeyDirectory(CHUNK, enable_blend_lookup=True)
    first = [CacheEntry(ObjectKey(HASHES[10 + held], *SHAPES[0]), 1, CONTENTS[1], 0)]
    batch = [
        CacheEntry(ObjectKey(h, *SHAPES[0]), 2, CONTENTS[k % 3], CHUNK * k)
        for k, h in enumerate(HASHES[10:14])
    ]
    for seq, entries in ((1, first), (2, batch)):
        b = EventBatch("a", 1, seq, "store", "l1", "dram", entries=tuple(entries))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(stores_module, "store_fresh", lambda *args: None)
            loop.consume(b)
        bulk.consume(b)
    assert _inside(bulk) == _inside(loop)
    assert [list(p) for p in bulk._chunks.parts] == [list(p) for p in loop._chunks.parts]
    assert _state(bulk) == _state(loop)


@pytest.mark.parametrize("fmt", ["json", "msgpack", "objects"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vouched_adds_pass_the_checks_they_skip(fmt: str, data: st.DataObject) -> None:
    """The directory vouches for the index adds of a batch whose arrays it allocated itself
    (``AddColumns.vouched``: the index then skips its column checks, or, for a batch of at
    most ``SMALL_BATCH`` adds, the single ops' checks). Every such add, taken unvouched,
    passes those checks and gives the same columns, or the same single ops. ``objects``:
    batches of entry objects (``consume``, the Redis stream's and in-process path)."""
    vouched = []
    kept = op_module._kept_columns
    singles = index_module.vouched_singles

    def checked(op: AddColumns, chunk: int) -> Any:
        out = kept(op, chunk)
        if op.vouched:
            vouched.append(op)
            plain = kept(op._replace(vouched=False), chunk)
            assert plain is not None and out is not None
            assert _fields(out)[:-1] == _fields(plain)[:-1]
            # (the header pass counts the ids' bytes besides: the last field, ``id_bytes``)
            assert (out.id_bytes, plain.id_bytes) == (sum(map(token_nbytes, out.tokens)), None)
        return out

    def checked_singles(op: AddColumns) -> Any:
        out = singles(op)
        if out is not None:
            vouched.append(op)
            plain = [op_module.checked_op(one, CHUNK) for one in op.ops()]
            assert [_single(one) for one in out] == [_single(one) for one in plain]
        return out

    codec: dict[str, Callable[[EventBatch], list[ColumnBatch]]] = {
        "json": lambda b: decode_json_columns(encode_json([b])),
        "msgpack": lambda b: decode_msgpack_columns(encode_msgpack([b])),
        "objects": lambda b: [ColumnBatch.of(b)],
    }
    columns = codec[fmt]
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(op_module, "_kept_columns", checked)
        m.setattr(index_module, "vouched_singles", checked_singles)
        for seq in range(1, data.draw(st.integers(1, 4)) + 1):
            d.apply_columns(columns(data.draw(store_st(seq))))
        d.apply_columns(columns(_fresh_batch(seq + 1)))
    assert vouched
    assert _counted_token_bytes(d)


@pytest.mark.parametrize("chunk", [CHUNK, 256])
def test_the_index_counts_the_bytes_of_a_bulk_stores_contents(chunk: int) -> None:
    """Batches of new chunks with new contents (an ingest's usual batch: the index settles it
    without masks, its bytes counted by the header pass), contents of every stored form
    (uint16, planes, uint32), then a delete: the index's byte count is its contents'."""
    rng = np.random.default_rng(5)
    d = KeyDirectory(chunk, enable_blend_lookup=True)
    for seq, top in enumerate((1 << 16, 1 << 17, 1 << 32, 1 << 17), start=1):
        ids = rng.integers(0, top, (20, chunk), dtype=np.uint64).astype(np.uint32)
        entries = tuple(
            CacheEntry(ObjectKey(bytes([seq, i]) * 16, *SHAPES[0]), 5, row, i * chunk)
            for i, row in enumerate(ids)
        )
        d.consume(EventBatch("a", 1, seq, "store", "l1", "dram", entries=entries))
        assert _counted_token_bytes(d)
    gone = tuple(CacheEntry(ObjectKey(bytes([2, i]) * 16, *SHAPES[0])) for i in range(12))
    d.consume(EventBatch("a", 1, 5, "delete", "l1", "dram", entries=gone))
    assert _counted_token_bytes(d)
    assert d.stats().blend.contents == 68  # type: ignore[union-attr]


def _counted_token_bytes(d: KeyDirectory) -> bool:
    """Whether the index's count of its contents' bytes is what they hold."""
    index = d._index
    assert index is not None
    contents = [t for t in index._state.tokens if t is not None]
    return index.stats().token_bytes == sum(map(token_nbytes, contents))


def _single(op: Any) -> tuple[Any, ...]:
    """Comparable: the token array or content by identity (the index keeps it)."""
    assert op is not None
    kind, tokens, chunk_hash, offset, namespace, owned = op
    return kind, id(tokens), chunk_hash, type(offset), offset, namespace, owned


def _fields(cols: OpColumns) -> list[Any]:
    """Comparable: arrays as lists, token arrays by identity (the index keeps them)."""
    out = []
    for name in OpColumns.__dataclass_fields__:
        value = getattr(cols, name)
        if name == "tokens":
            value = list(map(id, value))
        out.append(value.tolist() if isinstance(value, np.ndarray) else value)
    return out


def _fresh_batch(seq: int) -> EventBatch:
    entries = [CacheEntry(ObjectKey(bytes([seq]) * 32, *SHAPES[1]), 5, CONTENTS[1], CHUNK)]
    return EventBatch("c", 1, 1, "store", "l2", "disk", entries=tuple(entries))


WIDE = [np.arange(CHUNK, dtype=np.uint32) + (1 << 16) + 3 * i for i in range(2)]  # uint32 stored


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bulk_store_of_decoded_bodies_equals_the_loop(fmt: str, data: st.DataObject) -> None:
    """The same differential as :func:`test_bulk_store_equals_the_loop`, for bodies decoded to
    columns (the wire's path: arrays allocated from the body's arena, adds vouched for), with
    contents of both stored widths."""
    encode, decode = (
        (encode_json, decode_json_columns)
        if fmt == "json"
        else (encode_msgpack, decode_msgpack_columns)
    )
    bulk = KeyDirectory(CHUNK, enable_blend_lookup=True)
    loop = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for seq in range(1, data.draw(st.integers(1, 4)) + 1):
        batch = data.draw(store_st(seq))
        if data.draw(st.booleans()):  # the same batch with wide contents where it had any
            wide = data.draw(st.sampled_from(WIDE))
            entries = tuple(
                e
                if e.token_ids is None or len(e.token_ids) != CHUNK
                else replace(e, token_ids=wide)
                for e in batch.entries
            )
            batch = replace(batch, entries=entries)
        body = encode([batch])
        with pytest.MonkeyPatch.context() as m:
            m.setattr(stores_module, "store_fresh", lambda *args: None)
            loop.apply_columns(decode(body))
        bulk.apply_columns(decode(body))
        assert _inside(bulk) == _inside(loop)
        assert _state(bulk) == _state(loop)
        assert _counted_token_bytes(bulk) and _counted_token_bytes(loop)


def test_a_capture_open_during_a_bulk_store_keeps_the_records_at_its_start() -> None:
    """A capture in progress when a batch of new chunks arrives: the partitions it has not
    taken yet are taken as they were at its start (the bulk store must not bypass the
    copy-on-write journal), and the batch is in the directory afterwards."""
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    first = [CacheEntry(ObjectKey(bytes([200, 1]) + bytes(30), *SHAPES[0]), 1, CONTENTS[0], 0)]
    d.consume(EventBatch("a", 1, 1, "store", "l1", "dram", entries=tuple(first)))
    new = [
        CacheEntry(ObjectKey(bytes([200 + i, 2]) + bytes(30), *SHAPES[0]), 1, CONTENTS[1], CHUNK)
        for i in range(3)
    ]
    with d.capture() as capture:
        parts = capture.parts()
        taken = dict(next(parts).records())  # partition 0 only
        d.consume(EventBatch("a", 1, 2, "store", "l1", "dram", entries=tuple(new)))
        for part in parts:
            taken.update(part.records())
    assert set(taken) == {first[0].key.chunk_hash}
    assert set(captured(d)) == {first[0].key.chunk_hash} | {e.key.chunk_hash for e in new}


class _Hash(bytes):
    """A ``bytes`` subclass: a valid chunk hash for an ObjectKey, not an exact ``bytes``."""


def test_adds_of_hashes_that_are_not_exact_bytes_are_not_vouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The index keeps a vouched add's hashes by reference, unchecked; entry objects may carry
    a ``bytes`` subclass, so their adds are checked (and the hashes copied to exact bytes)."""
    seen: list[bool] = []
    kept, singles = op_module._kept_columns, index_module.vouched_singles

    def checked(op: AddColumns, chunk: int) -> Any:
        seen.append(op.vouched)
        return kept(op, chunk)

    def taken(op: AddColumns) -> Any:  # (a small batch: as single ops if vouched)
        out = singles(op)
        if out is not None:
            seen.append(op.vouched)
        return out

    monkeypatch.setattr(op_module, "_kept_columns", checked)
    monkeypatch.setattr(index_module, "vouched_singles", taken)
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for seq, make in enumerate((bytes, _Hash), start=1):
        key = ObjectKey(make(bytes([seq]) * 32), *SHAPES[0])
        entries = (CacheEntry(key, 1, CONTENTS[seq - 1], 0),)
        d.consume(EventBatch("a", 1, seq, "store", "l1", "dram", entries=entries))
    assert seen == [True, False]
    namespace = d._chunks.shapes.shapes[0].namespace
    (m,) = d.blend_match(np.concatenate([[7], CONTENTS[1]]).astype(np.uint32), namespace)
    assert type(m.chunk_hash) is bytes and m.chunk_hash == bytes([2]) * 32
