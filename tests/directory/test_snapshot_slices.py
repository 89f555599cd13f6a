"""The writer converts, copies and frees columns a slice at a time (so a concurrent ingesting
thread never waits for a whole column): the file must not depend on the slice size."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.snapshot import SnapshotError, writer
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank
from tests.directory.helpers import CS, Emitter, entry, key


def _directory(n: int, size: int | None = None) -> KeyDirectory:
    """``n`` chunks of one batch, each of its own size (``size`` given: all of that one)."""
    rng = np.random.default_rng(7)
    d = KeyDirectory(16, enable_blend_lookup=True)
    rank = pack_kv_rank(1, 0, 1, 0)
    entries = []
    for i in range(n):
        tokens = rng.integers(0, 1000, 16, dtype=np.uint32)
        tokens.flags.writeable = False
        h = rng.bytes(32)
        nbytes = 100 + i if size is None else size
        entries.append(CacheEntry(ObjectKey(h, "m", rank), nbytes, tokens, i * 16))
    d.consume(EventBatch("node-0", 1, 1, "store", "l1", "dram", False, 0.0, tuple(entries)))
    return d


def test_file_bytes_do_not_depend_on_the_slice_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _directory(300)
    whole = tmp_path / "whole.snap"
    save_snapshot(d, whole, stream_position="1-0")
    monkeypatch.setattr(writer, "_SLICE", 7)
    monkeypatch.setattr(writer, "_ARENA_BLOCK", 5)
    monkeypatch.setattr(writer, "_LARGE", 64)  # every column larger than 64 B in pieces
    sliced = tmp_path / "sliced.snap"
    save_snapshot(d, sliced, stream_position="1-0")
    assert sliced.read_bytes() == whole.read_bytes()
    restored = KeyDirectory(16, enable_blend_lookup=True)
    assert load_snapshot(restored, sliced).keys == 300


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65535, 65536, 65537, 300_000])
def test_header_pieces_concatenate_to_the_msgpack_encoding(size: int) -> None:
    import msgspec

    from kvatlas.directory.snapshot.format import Header

    blob = bytes(range(256)) * (size // 256) + bytes(size % 256)
    pieces = writer.HeaderPieces()

    def field(data: bytes) -> bytes:  # as the writer gives a column: in slices
        return pieces.field([data[i : i + 1000] for i in range(0, len(data), 1000)])

    columns = [blob, b"", b"\x01", blob[: size // 2], b"", b"", blob, blob * 2, b"", b"", b"",
               b"", b"", blob]  # fmt: skip
    common = (1, 256, "1-0", ["m"], [(0, 1, 0, 0)])
    tail = ([("node", 1, 2, 0, 0, None)], [], 0)
    header = Header(*common, *map(field, columns), *tail)
    encoded = pieces.encode(header)
    assert b"".join(encoded) == msgspec.msgpack.encode(Header(*common, *columns, *tail))
    assert (len(encoded) > 1) == (2 * size > writer._LARGE)  # large fields stay in pieces


_ENTRY = st.tuples(
    st.integers(1, 40),  # key
    st.sampled_from([("m", ""), ("m", "s"), ("n", "")]),  # model, salt
    st.none() | st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=2 * CS),  # tokens
    st.booleans(),  # small ids (stored as uint16)
    st.sampled_from([-1, 0, CS, 7 * CS]),  # offset
)
_BATCH = st.tuples(
    st.sampled_from(["a", "b"]),
    st.sampled_from([("l1", "dram", False), ("l2", "fs", False), ("l2", "pool", True)]),
    st.lists(_ENTRY, max_size=12),
)


def _built(batches: list[tuple[str, tuple[str, str, bool], list[Any]]]) -> KeyDirectory:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    emitters = {name: Emitter(name) for name in ("a", "b")}
    for size, (instance, (tier, backend, shared), rows) in enumerate(batches):
        entries = []
        for n, (model, salt), tokens, small, offset in rows:
            ids = (
                None
                if tokens is None
                else np.array([t % 2**16 if small else t for t in tokens], np.uint32)
            )
            entries.append(entry(key(n, model, salt), ids, offset, size=100 + size))
        d.consume(emitters[instance].batch("store", entries, tier, backend, shared))
    return d


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(_BATCH, max_size=8),
    slice_items=st.integers(1, 9),
    arena_block=st.integers(1, 5),
    large=st.integers(0, 300),
)
def test_piecewise_writer_gives_the_one_call_file(
    tmp_path: Path,
    batches: list[tuple[str, tuple[str, str, bool], list[Any]]],
    slice_items: int,
    arena_block: int,
    large: int,
) -> None:
    """Any directory, any slicing: the same bytes as one call per column, one msgpack encode of
    the whole header and one arena write (the writer before it worked in pieces)."""
    d = _built(batches)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("_SLICE", 1 << 40), ("_ARENA_BLOCK", 1 << 40), ("_LARGE", 1 << 62)):
            mp.setattr(writer, name, value)
        save_snapshot(d, tmp_path / "one.snap", stream_position="3-0")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (
            ("_SLICE", slice_items),
            ("_ARENA_BLOCK", arena_block),
            ("_LARGE", large),
        ):
            mp.setattr(writer, name, value)
        info = save_snapshot(d, tmp_path / "pieces.snap", stream_position="3-0")
    assert (tmp_path / "pieces.snap").read_bytes() == (tmp_path / "one.snap").read_bytes()
    assert info.keys == d.stats().keys


@given(values=st.lists(st.integers()), slice_items=st.integers(1, 5), as_dict=st.booleans())
def test_release_empties_a_column_in_slices(
    values: list[int], slice_items: int, as_dict: bool
) -> None:
    column: list[int] | dict[int, int] = dict.fromkeys(values, 0) if as_dict else list(values)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer, "_SLICE", slice_items)
        writer._release(column)
    assert len(column) == 0


def test_writing_keeps_no_tracked_container_of_a_reference_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A young collection while a snapshot is written traverses every young container the
    collector tracks, holding the GIL: the writer's columns (hashes, offsets, contents, keys)
    must not be lists or tuples of a reference per chunk, or one collection near the end
    traverses the whole directory's (8–27 ms at 300,000 chunks)."""
    n = 3000
    d = _directory(n, size=100)  # one placement row (a batch's chunks of one size share it)
    parts = d._chunks.parts
    # the chunks' own objects: their hashes and contents (what a per-chunk column refers to)
    chunk_objects = {id(h) for part in parts for h in part.row}
    chunk_objects |= {id(c) for c in parts[0].cols.objs[0::4] if c is not None}
    gc.collect()
    before = gc.get_objects()  # (kept alive: their ids cannot be reused meanwhile)
    old = {id(o) for o in before} | {id(before), id(chunk_objects)}
    old.add(id(old))
    large: list[str] = []
    write = writer._write_atomically

    def per_chunk(o: list[Any] | tuple[Any, ...] | dict[Any, Any]) -> bool:
        items = [*o, *o.values()] if isinstance(o, dict) else o
        return len(o) >= n and sum(id(x) in chunk_objects for x in items) >= n

    def spy(path: Path, header: list[bytes], arena: Any, *rest: Any) -> int:
        # every column is added and the header encoded: what the writer holds now (new
        # containers of the chunks' objects only: other threads' allocations do not count)
        large.extend(
            f"{type(o).__name__} of {len(o)}"
            for o in gc.get_objects()
            if id(o) not in old and isinstance(o, list | tuple | dict) and per_chunk(o)
        )
        return write(path, header, arena, *rest)

    monkeypatch.setattr(writer, "_write_atomically", spy)
    save_snapshot(d, tmp_path / "s.snap")
    assert large == []
    assert load_snapshot(KeyDirectory(16, enable_blend_lookup=True), tmp_path / "s.snap").keys == n


def test_a_restore_runs_no_collection_and_leaves_the_collector_as_it_was(
    tmp_path: Path,
) -> None:
    """A restore builds lists of a reference per chunk that each young collection traversed
    while they were young: the collector is paused for it (and enabled again after, also
    when the restore is refused; left off if it was off)."""
    path = tmp_path / "s.snap"
    save_snapshot(_directory(500, size=100), path)
    bad = tmp_path / "bad.snap"
    bad.write_bytes(path.read_bytes()[:-1])  # the token section cut short
    targets = [KeyDirectory(16, enable_blend_lookup=True) for _ in range(3)]
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(10)  # a collection every 10 new containers, were it on
    gc.callbacks.append(count)
    try:
        assert load_snapshot(targets[0], path).keys == 500
        assert collections == [] and gc.isenabled()
        with pytest.raises(SnapshotError):
            load_snapshot(targets[1], bad)
        assert gc.isenabled()
        gc.disable()
        load_snapshot(targets[2], path)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
