"""Saved content anchors (snapshot version 5): a restore that adopts them answers blend
matches exactly as the saved directory and the brute-force oracle do, for contents of every
stored form, and anchors nothing on its first lookup; a column that is corrupt, short or not
the contents' anchors is refused; one under a key this build cannot use is ignored (the first
lookup anchors every content), as a version-4 file's missing column is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvatlas.directory import BlendIndex, KeyDirectory, load_snapshot, save_snapshot
from kvatlas.directory.blend.anchors import SCHEME, AnchorKey
from kvatlas.directory.records import record_indexed
from kvatlas.directory.snapshot.format import VERSION, SnapshotError
from kvatlas.keys import BlendNamespace
from tests.directory.helpers import CS, Emitter, captured, entry, key
from tests.directory.test_fingerprint_column import (
    directory_of_every_form,
    header_of,
    ops,
    rewrite,
    saved,
)
from tests.directory.test_snapshot_format import wide_directory
from tests.directory.test_snapshot_restore import apply, assert_same_answers, view
from tests.directory.test_snapshot_restore import ops as later_ops

DATA = Path(__file__).parent / "data"
KEYS = (0x9E3779B1, 0x85EBCA6B | 1, 0xC2B2AE35 | 1, 0x27D4EB2F)  # odd: a usable secret


def index_of(d: KeyDirectory) -> BlendIndex:
    index = d._index
    assert index is not None
    return index


def pending(d: KeyDirectory) -> bool:
    """Whether the next lookup anchors contents first (none adopted, or some noted since)."""
    anchors = index_of(d)._state.anchors
    return anchors._all or anchors._noted_count > 0


def saved_key(path: Path) -> AnchorKey:
    scheme, keys = header_of(path).anchor_key or ("", [])
    return AnchorKey(scheme, CS, tuple(keys))


def fixed_keys(chunk_size: int, probe_stride: int) -> BlendIndex:
    return BlendIndex(chunk_size, probe_stride, _anchor_keys=KEYS)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(program=ops, after=later_ops)
def test_a_restore_from_saved_anchors_answers_as_the_saved_directory_and_the_oracle(
    tmp_path: Path, program: list[Any], after: list[Any]
) -> None:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    emitters = {"a": Emitter("a"), "b": Emitter("b")}
    apply([d], emitters, program)
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    assert saved_key(path) == index_of(d).anchor_key
    restored = KeyDirectory(CS, enable_blend_lookup=True)  # a secret of its own, replaced
    load_snapshot(restored, path)
    if any(map(record_indexed, captured(d).values())):  # the saved anchors were adopted,
        # with their secret (but for the per-salt bindings of chunks of several salts, which
        # records do not carry: added after the build, anchored on the first lookup)
        assert not pending(restored) or restored._chunks.tenants.bound()
        assert index_of(restored).anchor_key == index_of(d).anchor_key
    assert view(restored) == view(d)
    assert_same_answers(restored, d)
    apply([d, restored], emitters, after)  # writes into the adopted table: noted, rebuilt
    assert view(restored) == view(d)
    assert_same_answers(restored, d)


def test_the_secret_is_saved_and_a_restore_adopts_it_over_its_own(tmp_path: Path) -> None:
    d = directory_of_every_form(fixed_keys)
    path = tmp_path / "s.snap"
    save_snapshot(d, path)
    assert header_of(path).version == VERSION and header_of(path).anchor_key == (SCHEME, list(KEYS))
    restored = KeyDirectory(CS, enable_blend_lookup=True)  # a fresh secret of its own
    load_snapshot(restored, path)
    assert index_of(restored).anchor_key == AnchorKey(SCHEME, CS, KEYS)
    assert not pending(restored)
    assert_same_answers(restored, d)


def test_a_corrupt_or_short_anchor_column_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    d, path, header = saved(tmp_path)
    column = bytearray(header.chunk_anchors)
    column[5] ^= 1
    rewrite(path, chunk_anchors=bytes(column))
    target = KeyDirectory(CS, enable_blend_lookup=True)
    with pytest.raises(SnapshotError, match="corrupt anchor column"):
        load_snapshot(target, path)
    assert view(target) == view(KeyDirectory(CS, enable_blend_lookup=True))
    short = bytes(header.chunk_anchors[:-8])  # one anchor short, its digest recomputed
    rewrite(path, chunk_anchors=short, anchor_digest=saved_key(path).digest([short]))
    with pytest.raises(SnapshotError, match="one anchor per chunk"):
        load_snapshot(target, path)
    rewrite(path, chunk_anchors=header.chunk_anchors, anchor_digest=header.anchor_digest)
    load_snapshot(target, path)  # (the same file, its column whole again: taken)
    assert view(target) == view(d)


@pytest.mark.parametrize("change", ["offsets", "spreads", "low spread bits", "one"])
def test_anchors_that_are_not_the_contents_are_refused(tmp_path: Path, change: str) -> None:
    """A column whose digest holds but whose values are not the contents' anchors: the
    sample recomputed from the token ids shows it (fewer contents than the sample here, so
    it sees every one; "low spread bits": bits the kept anchor drops, but the table's tag
    holds)."""
    _, path, header = saved(tmp_path)
    values = np.frombuffer(header.chunk_anchors, "<u8").copy()
    live = np.flatnonzero(values)
    assert len(live) >= 10
    flip = {
        "offsets": np.uint64(1),  # offset 0 (CS ids: one k-gram) taken as 1
        "spreads": np.uint64(1 << 63),
        "low spread bits": np.uint64(1 << 32),
        "one": np.uint64(1 << 40),
    }[change]
    values[live if change != "one" else live[-1:]] ^= flip
    raw = values.tobytes()
    rewrite(path, chunk_anchors=raw, anchor_digest=saved_key(path).digest([raw]))
    target = KeyDirectory(CS, enable_blend_lookup=True)
    with pytest.raises(SnapshotError, match="anchor column does not match the token section"):
        load_snapshot(target, path)
    assert view(target) == view(KeyDirectory(CS, enable_blend_lookup=True))


@pytest.mark.parametrize("change", ["scheme", "even", "zero", "three", "wide"])
def test_anchors_under_a_key_this_build_cannot_use_are_ignored(tmp_path: Path, change: str) -> None:
    """Another scheme or an invalid secret (the digest recomputed to match): not an error;
    the column (garbage here) is not read, and the first lookup anchors every content."""
    d, path, header = saved(tmp_path)
    keys = list(saved_key(path).keys)
    bad = {
        "scheme": ("another-anchor/1", keys),
        "even": (SCHEME, [keys[0] & ~1, *keys[1:]]),
        "zero": (SCHEME, [0, *keys[1:]]),
        "three": (SCHEME, keys[:3]),
        "wide": (SCHEME, [keys[0] | 1 << 32, *keys[1:]]),
    }[change]
    column = np.arange(len(header.chunk_anchors) // 8, dtype="<u8").tobytes()
    digest = AnchorKey(bad[0], CS, tuple(bad[1])).digest([column])
    rewrite(path, anchor_key=bad, chunk_anchors=column, anchor_digest=digest)
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, path)
    assert pending(restored)  # not adopted: every content anchored on the first lookup
    assert index_of(restored).anchor_key.keys != tuple(keys)  # its own secret
    assert view(restored) == view(d)
    assert_same_answers(restored, d)
    assert not pending(restored)


def test_anchors_at_every_offset_are_adopted_at_a_larger_chunk(tmp_path: Path) -> None:
    """Chunks of 16 ids (an anchor's offset 0 .. 12, where ``CS`` has only 0), more contents
    than the sample: each is found at its offset, as in the saved directory."""
    rng = np.random.default_rng(7)
    contents = [rng.integers(0, [50, 1 << 17, 1 << 30][n % 3], 16, np.uint32) for n in range(200)]
    d = KeyDirectory(16, enable_blend_lookup=True)
    d.consume(Emitter().batch("store", [entry(key(n), c, 5 * n) for n, c in enumerate(contents)]))
    save_snapshot(d, tmp_path / "s.snap")
    restored = KeyDirectory(16, enable_blend_lookup=True)
    load_snapshot(restored, tmp_path / "s.snap")
    assert not pending(restored)
    offsets = np.frombuffer(header_of(tmp_path / "s.snap").chunk_anchors, "<u8") & 0xFFFF
    assert len(set(offsets.tolist())) > 5
    ns = BlendNamespace("m")
    for n, c in enumerate(contents):
        q = np.concatenate([rng.integers(0, 1 << 30, n % 7, np.uint32), c, [9]])
        got = restored.blend_match(q, ns)
        assert got == d.blend_match(q, ns) and [m.old_st for m in got] == [5 * n]


@pytest.mark.parametrize("name", ["snapshot-v4-fingerprints.snap", "snapshot-v4-wide.snap"])
def test_a_version_4_file_is_anchored_on_the_first_lookup(name: str) -> None:
    """The wide directory's version-4 files, with and without fingerprints: no anchors."""
    golden = DATA / name
    assert header_of(golden).version == 4 and header_of(golden).anchor_key is None
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(restored, golden)
    assert pending(restored)
    assert_same_answers(restored, wide_directory(blend=True))
    assert not pending(restored)
