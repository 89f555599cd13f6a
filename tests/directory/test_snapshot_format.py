"""The snapshot file format is fixed: the writer produces ``data/snapshot-v2.snap`` (from the
directory :func:`golden_directory` builds) byte for byte, and a version-1 file written before
the snapshot package was split (``data/snapshot-v1.snap``, same directory) still loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from kvatlas.directory import KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.snapshot.format import COLUMNS, MAGIC, PREFIX, VERSION, Header
from tests.directory.helpers import CS, Emitter, entry, key, toks

GOLDEN = Path(__file__).parent / "data" / "snapshot-v2.snap"
GOLDEN_V1 = Path(__file__).parent / "data" / "snapshot-v1.snap"
POSITION = "1700000000-7"


def golden_directory() -> KeyDirectory:
    """Several keys per chunk, several placements per key, shared and unbound content, an
    access, a gap, a capacity declaration and a delete."""
    d = KeyDirectory(CS)
    a, b = Emitter("a"), Emitter("b", incarnation=3)
    first = [entry(key(n), toks(n, n, n, n), 4 * n, size=10 + n) for n in range(1, 9)]
    d.consume(a.batch("store", first, ts=1.5))
    more = [entry(key(1, salt="t")), entry(key(2, ws=2, rank=1), toks(2, 2, 2, 2), 8)]
    d.consume(a.batch("store", more, ts=2.0))
    l2 = [entry(key(n), size=7) for n in range(1, 5)]
    d.consume(b.batch("store", l2, tier="l2", backend="fs", ts=3.0))
    pool = [entry(key(5), toks(1, 2, 3), 0)]
    d.consume(b.batch("store", pool, tier="l2", backend="pool", shared=True, ts=4.0))
    d.consume(a.batch("access", [entry(key(1))], ts=9.25))
    a.seq += 2  # a gap
    d.consume(a.batch("config", tier="l1", backend="", capacity_bytes=1 << 20, capacity_revision=4))
    d.consume(a.batch("delete", [entry(key(8))]))
    return d


def view(d: KeyDirectory) -> tuple[object, ...]:
    stats = dataclasses.replace(d.stats(), batches={})  # batch outcomes are not snapshotted
    return (d.list_keys(limit=1000).items, d.emitters(), d.capacities(), stats)


def test_writer_output_is_unchanged_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "s.snap"
    save_snapshot(golden_directory(), path, stream_position=POSITION)
    assert path.read_bytes() == GOLDEN.read_bytes()


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V1], ids=["v2", "v1"])
def test_a_file_from_the_unsplit_writer_loads(golden: Path) -> None:
    d = KeyDirectory(CS)
    info = load_snapshot(d, golden)
    assert (info.chunks, info.keys, info.stream_position) == (7, 9, POSITION)
    assert view(d) == view(golden_directory())
    cursor = d.gap_state("a")
    assert cursor is not None and cursor.gaps == 1


def test_header_layout_is_pinned() -> None:
    raw = GOLDEN.read_bytes()
    assert MAGIC == b"KVATSNP1" and VERSION == 2 and PREFIX.format == "<8sQ"
    magic, header_len = PREFIX.unpack_from(raw)
    assert magic == MAGIC
    header = msgspec.msgpack.decode(raw[PREFIX.size : PREFIX.size + header_len], type=Header)
    assert header.version == VERSION and header.chunk_size == CS
    columns = [
        f
        for f, t in zip(Header.__struct_fields__, Header.__annotations__.values(), strict=True)
        if t == "bytes"
    ]
    assert columns == [
        "pl_instance",
        "pl_incarnation",
        "pl_tier",
        "pl_backend",
        "pl_size",
        "pl_shared",
        "pl_access",
        "chunk_hashes",
        "chunk_offsets",
        "chunk_token_lens",
        "chunk_key_counts",
        "key_shapes",
        "key_pl_counts",
        "key_pls",
        "chunk_token_widths",
    ]
    assert sorted(COLUMNS) == sorted(c for c in columns if c != "chunk_hashes")
