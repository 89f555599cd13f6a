"""The writer converts and copies columns a slice at a time (so a concurrent ingesting thread
never waits for a whole column): the file must not depend on the slice size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.snapshot import writer
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank


def _directory(n: int) -> KeyDirectory:
    rng = np.random.default_rng(7)
    d = KeyDirectory(16, enable_blend_lookup=True)
    rank = pack_kv_rank(1, 0, 1, 0)
    entries = []
    for i in range(n):
        tokens = rng.integers(0, 1000, 16, dtype=np.uint32)
        tokens.flags.writeable = False
        h = rng.bytes(32)
        entries.append(CacheEntry(ObjectKey(h, "m", rank), 100 + i, tokens, i * 16))
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
