"""The snapshot file format is fixed: the writer produces ``data/snapshot-v7.snap`` (from the
directory :func:`golden_directory` builds), ``data/snapshot-v7-wide.snap`` (ids of large
vocabularies, :func:`wide_directory`) and ``data/snapshot-v7-blend.snap`` (the wide directory
with blend on, its fingerprints and anchors saved under a fixed base and secret) byte for
byte; files of earlier versions still load: the version-6 files the writer produced before
bindings were per salt (``data/snapshot-v6.snap``, ``-wide``, ``-blend``; restored without
the one binding of a chunk held under keys of two salts), the version-5 files it produced
before the checksums (``data/snapshot-v5.snap``, ``data/snapshot-v5-wide.snap``,
``data/snapshot-v5-blend.snap``), the version-4 files the writer produced before
the anchors (``data/snapshot-v4.snap``, ``data/snapshot-v4-wide.snap``,
``data/snapshot-v4-fingerprints.snap``), the version-3 files it produced before the
fingerprints (``data/snapshot-v3.snap``, ``data/snapshot-v3-wide.snap``), a version-2 file
(``data/snapshot-v2.snap``, and ``data/snapshot-v2-wide.snap`` written by the code before the
planes form, main at 7907e79) and a version-1 file written before the snapshot package was
split (``data/snapshot-v1.snap``)."""

from __future__ import annotations

import dataclasses
import io
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvatlas.directory import BlendIndex, KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.blend.anchors import SCHEME as ANCHOR_SCHEME
from kvatlas.directory.blend.kernels.anchors import kgram_size
from kvatlas.directory.blend.kernels.modhash import SCHEME
from kvatlas.directory.records import record_stored_tokens
from kvatlas.directory.snapshot.format import COLUMNS, MAGIC, PREFIX, VERSION, Header
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key, toks

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "snapshot-v7.snap"
GOLDEN_V6 = DATA / "snapshot-v6.snap"
GOLDEN_V5 = DATA / "snapshot-v5.snap"
GOLDEN_V4 = DATA / "snapshot-v4.snap"
GOLDEN_V3 = DATA / "snapshot-v3.snap"
GOLDEN_V2 = DATA / "snapshot-v2.snap"
GOLDEN_V1 = DATA / "snapshot-v1.snap"
WIDE = DATA / "snapshot-v7-wide.snap"
WIDE_V6 = DATA / "snapshot-v6-wide.snap"
WIDE_V5 = DATA / "snapshot-v5-wide.snap"
WIDE_V4 = DATA / "snapshot-v4-wide.snap"
WIDE_V3 = DATA / "snapshot-v3-wide.snap"
BLEND = DATA / "snapshot-v7-blend.snap"
BLEND_V6 = DATA / "snapshot-v6-blend.snap"
BLEND_V5 = DATA / "snapshot-v5-blend.snap"
FINGERPRINTS = DATA / "snapshot-v4-fingerprints.snap"
BASE = 0x1234_5678_9ABC_DEF  # the fingerprint base BLEND and FINGERPRINTS were written under
ANCHOR_KEYS = (0x9E37_79B1, 0x85EB_CA6B, 0xC2B2_AE35, 0x27D4_EB2F)  # BLEND's anchor secret
WIDE_V2 = DATA / "snapshot-v2-wide.snap"
POSITION = "1700000000-7"
WIDE_POSITION = "1700000000-9"


def golden_directory(before_v7: bool = False) -> KeyDirectory:
    """Several keys per chunk (chunk 1's of two salts), several placements per key, shared
    and unbound content, an access, a gap, a capacity declaration and a delete.
    ``before_v7``: as a file written before bindings were per salt restores it (chunk 1's
    one binding for both salts dropped: nobody can tell whose it was)."""
    d = KeyDirectory(CS)
    a, b = Emitter("a"), Emitter("b", incarnation=3)
    first = [
        entry(key(n), None if before_v7 and n == 1 else toks(n, n, n, n), 4 * n, size=10 + n)
        for n in range(1, 9)
    ]
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


WIDE_CONTENTS = {
    1: (1, 2, 3, 4),
    2: (70_000, 128_255, 5, 65_536),
    3: (1 << 20, 3, 3, 3),
    4: ((1 << 24) - 1, 0, 0, 1),
    5: (1 << 24, 2, 2, 2),
    6: ((1 << 32) - 1, 65_535, 65_536, 0),
    7: (65_535, 0, 65_535, 7),
}


def fixed_base(chunk_size: int, probe_stride: int) -> BlendIndex:
    """A blend index whose fingerprint base is :data:`BASE` and anchor secret
    :data:`ANCHOR_KEYS` (a byte-stable file)."""
    return BlendIndex(chunk_size, probe_stride, _fingerprint_base=BASE, _anchor_keys=ANCHOR_KEYS)


def wide_directory(blend: bool = False) -> KeyDirectory:
    """Contents in every form (uint16, the planes form, uint32 where it is smaller), one
    shared by two namespaces, one shorter than a chunk (as ``data/snapshot-v2-wide.snap``
    was written from, by the code before the planes form)."""
    d = KeyDirectory(CS, enable_blend_lookup=blend, blend_index_factory=fixed_base)
    a = Emitter("a")
    first = [entry(key(n), toks(*t), 4 * n) for n, t in WIDE_CONTENTS.items()]
    d.consume(a.batch("store", first, ts=1.5))
    d.consume(a.batch("store", [entry(key(9, salt="t"), toks(*WIDE_CONTENTS[2]), 8)], ts=2.0))
    d.consume(a.batch("store", [entry(key(8), toks(131_071, 9, 9), 0)], ts=2.5))
    return d


def view(d: KeyDirectory) -> tuple[object, ...]:
    # (batch outcomes and content conflicts are counts since the start, not snapshotted)
    stats = dataclasses.replace(d.stats(), batches={}, content_conflicts=0)
    return (d.list_keys(limit=1000).items, d.emitters(), d.capacities(), stats)


def test_writer_output_is_unchanged_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "s.snap"
    save_snapshot(golden_directory(), path, stream_position=POSITION)
    assert path.read_bytes() == GOLDEN.read_bytes()


@pytest.mark.parametrize(
    "golden",
    [GOLDEN, GOLDEN_V6, GOLDEN_V5, GOLDEN_V4, GOLDEN_V3, GOLDEN_V2, GOLDEN_V1],
    ids=["v7", "v6", "v5", "v4", "v3", "v2", "v1"],
)
def test_a_file_from_the_unsplit_writer_loads(golden: Path) -> None:
    d = KeyDirectory(CS)
    info = load_snapshot(d, golden)
    assert (info.chunks, info.keys, info.stream_position) == (7, 9, POSITION)
    assert view(d) == view(golden_directory(before_v7=golden != GOLDEN))
    content = {kp.key: kp.content for kp in d.lookup([key(1), key(1, salt="t"), key(2)])}
    chunk_1 = content[key(1)]
    assert (chunk_1 is None) == (golden != GOLDEN)  # (a v7 file keeps salt ""'s binding)
    assert chunk_1 is None or chunk_1.tolist() == [1, 1, 1, 1]
    assert content[key(1, salt="t")] is None  # salt "t" stored no ids
    assert content[key(2)].tolist() == [2, 2, 2, 2]  # type: ignore[union-attr]
    cursor = d.gap_state("a")
    assert cursor is not None and cursor.gaps == 1


def test_wide_contents_are_written_unchanged_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "s.snap"
    save_snapshot(wide_directory(), path, stream_position=WIDE_POSITION)
    assert path.read_bytes() == WIDE.read_bytes()


@pytest.mark.parametrize(
    "golden",
    [WIDE, BLEND, WIDE_V6, BLEND_V6, WIDE_V5, BLEND_V5, WIDE_V4, FINGERPRINTS, WIDE_V3, WIDE_V2],
    ids=["v7", "v7-blend", "v6", "v6-blend", "v5", "v5-blend", "v4", "v4-fp", "v3", "v2"],
)
@pytest.mark.parametrize("blend", [False, True], ids=["plain", "blend"])
def test_a_wide_file_from_before_the_planes_form_loads_in_the_forms_ids_need(
    golden: Path, blend: bool
) -> None:
    """The version-2 file stores uint32 where the planes form is now smaller: it restores
    the same directory, each content in the form a fresh store gives it (the memory win
    does not wait for the chunk to be stored again), matchable with blend on."""
    d = KeyDirectory(CS, enable_blend_lookup=blend)
    info = load_snapshot(d, golden)
    assert (info.chunks, info.keys, info.stream_position) == (9, 9, WIDE_POSITION)
    fresh = wide_directory(blend)
    assert view(d) == view(fresh)
    got, want = captured(d), captured(fresh)
    for h, rec in want.items():
        mine, theirs = record_stored_tokens(got[h]), record_stored_tokens(rec)
        assert mine is not None and theirs is not None
        assert type(mine) is bytes and mine == theirs  # the header names the form
    if blend:
        for n, t in WIDE_CONTENTS.items():
            q = np.array([9, *t], dtype=np.uint32)
            assert sorted(m.old_st for m in d.blend_match(q, BlendNamespace("m"))) == [4 * n]


def test_saved_fingerprints_and_anchors_are_written_unchanged_byte_for_byte(
    tmp_path: Path,
) -> None:
    """With blend on, each content's fingerprint and anchor are saved under the index's keys:
    the same bytes for the same ids, base, bits and secret (a change of the fingerprint or
    anchor function shows here and must come with a new ``SCHEME``)."""
    path = tmp_path / "s.snap"
    save_snapshot(wide_directory(blend=True), path, stream_position=WIDE_POSITION)
    assert path.read_bytes() == BLEND.read_bytes()
    header = read_header(BLEND)
    assert header.fingerprint_key == (SCHEME, 61, BASE)
    fps = np.frombuffer(header.chunk_fingerprints, "<u8")
    assert np.count_nonzero(fps) == 8  # every chunk of CS ids; 0 for the short one
    assert header.anchor_key == (ANCHOR_SCHEME, list(ANCHOR_KEYS))
    anchors = np.frombuffer(header.chunk_anchors, "<u8")
    assert np.count_nonzero(anchors >> np.uint64(32)) == 8  # a spread hash for each of them
    assert (anchors & np.uint64(0xFFFF_FFFF) <= CS - kgram_size(CS)).all()  # offsets


def read_header(path: Path) -> Header[bytes]:
    return read_header_bytes(path.read_bytes())


def test_header_layout_is_pinned() -> None:
    raw = GOLDEN.read_bytes()
    assert MAGIC == b"KVATSNP1" and VERSION == 7 and PREFIX.format == "<8sQ"
    assert PREFIX.unpack_from(raw)[0] == MAGIC
    header = read_header_bytes(raw)
    assert header.version == VERSION and header.chunk_size == CS
    columns = [
        f
        for f, t in zip(Header.__struct_fields__, Header.__annotations__.values(), strict=True)
        if t in ("bytes", "Buf")  # (Buf: the reader decodes the columns as views)
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
        "chunk_fingerprints",
        "fingerprint_digest",
        "chunk_anchors",
        "anchor_digest",
    ]
    assert sorted(COLUMNS) == sorted(
        c for c in columns if c not in ("chunk_hashes", "fingerprint_digest", "anchor_digest")
    )


def test_the_reader_decodes_the_columns_as_views_of_the_bytes_read() -> None:
    """A restore's header columns (≈60 MB at 10^6 keys) are read-only views of the one
    buffer read, not copies; the same values as the writer's ``bytes``."""
    from kvatlas.directory.snapshot.reader import read_header

    raw = GOLDEN.read_bytes()
    written = read_header_bytes(raw)
    with open(GOLDEN, "rb", buffering=0) as f:
        header, body = read_header(f, len(raw))
    assert body == PREFIX.size + PREFIX.unpack_from(raw)[1]
    buffers = set()
    for name in COLUMNS:
        value = getattr(header, name)
        if name in ("chunk_token_widths", "chunk_fingerprints", "chunk_anchors"):
            continue  # (fields with a default: ``bytes`` either way, a few bytes a chunk)
        assert isinstance(value, memoryview) and value.readonly, name
        assert bytes(value) == getattr(written, name), name
        buffers.add(id(value.obj))
    assert len(buffers) == 1


def read_header_bytes(raw: bytes) -> Header[bytes]:
    _, header_len = PREFIX.unpack_from(raw)
    return msgspec.msgpack.decode(raw[PREFIX.size : PREFIX.size + header_len], type=Header[bytes])


def test_a_header_read_in_short_pieces_is_read_whole() -> None:
    """An unbuffered read may return fewer bytes than asked (Linux: ≈2 GiB at most a call):
    the header is read until it is whole or the file ends."""
    from kvatlas.directory.snapshot.token_section import read_exactly

    class Trickle(io.FileIO):
        def readinto(self, buffer: Any) -> int:
            view = memoryview(buffer)
            return super().readinto(view[: min(7, len(view))]) or 0

    with tempfile.NamedTemporaryFile() as f:
        f.write(bytes(range(256)) * 4)
        f.flush()
        with Trickle(f.name, "rb") as t:
            assert read_exactly(t, 1000) == (bytes(range(256)) * 4)[:1000]
            assert read_exactly(t, 100) == (bytes(range(256)) * 4)[1000:]  # the end: fewer
