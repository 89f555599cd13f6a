"""Copy-on-write snapshots hold the directory exactly as it was when the capture started.

Changes (stores of new placements and new content, deletes, accesses, fences, new keys) hit
the same chunks both in partitions already captured and in partitions not captured yet, between
the partitions of a capture; the restored directory's whole observable state must equal an
oracle fed the same batches up to the capture's start (docs/directory.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvatlas.directory import KeyDirectory, Restored, load_snapshot, save_snapshot
from kvatlas.directory.capture import Capture, CapturedPart
from kvatlas.directory.chunk_counts import PARTS, Partition
from kvatlas.keys import BlendNamespace, ObjectKey, chunk_hashes, pack_kv_rank
from tests.directory.helpers import CS, Emitter, entry, key, toks

NS = BlendNamespace("m")
SPLIT = 128  # partitions below are captured before the changes, the rest after
# chunk n lives in partition n (helpers.key): these straddle SPLIT
NUMS = list(range(100, 160))
GONE = (60, 170, 190)  # chunks the changes remove entirely (60 is captured before they happen)
PROMPT = np.arange(1000, 1000 + 24 * CS, dtype=np.uint32)  # a real hash chain for lookup_tokens
PROMPT_HASHES = chunk_hashes(PROMPT, CS)


def chain_key(h: bytes, salt: str = "") -> ObjectKey:
    return ObjectKey(h, "m", pack_kv_rank(1, 0, 1, 0), 0, salt)


def content(n: int) -> Any:
    return toks(n, n + 1, n + 2, n + 3)


def feed(d: KeyDirectory, a: Emitter, b: Emitter) -> None:
    """The batches every directory here gets before its capture starts."""
    d.consume(a.batch("store", [entry(key(n), content(n), 4 * n) for n in NUMS], ts=1.0))
    d.consume(a.batch("store", [entry(key(n), content(n), 4) for n in GONE]))
    d.consume(b.batch("store", [entry(key(n)) for n in NUMS[::3]], tier="l2", backend="fs"))
    d.consume(a.batch("store", [entry(key(n, salt="s")) for n in NUMS[::4]], shared=True))
    chain = [
        entry(chain_key(h), PROMPT[i * CS : (i + 1) * CS], i * CS)
        for i, h in enumerate(PROMPT_HASHES)
    ]
    d.consume(a.batch("store", chain[:18], ts=2.0))
    d.consume(b.batch("store", chain[:10], tier="l2", backend="fs"))
    d.consume(a.batch("config", tier="l1", backend="", capacity_bytes=7, capacity_revision=1))
    b.seq += 2  # leaves a gap in b's cursor
    d.consume(b.batch("config", tier="l2", backend="fs", capacity_bytes=9, capacity_revision=2))


def changes(d: KeyDirectory, a: Emitter, b: Emitter, c: Emitter) -> None:
    """Every kind of change, to chunks on both sides of SPLIT (and chunks of the chain)."""
    chain = [chain_key(h) for h in PROMPT_HASHES]
    # new placements of existing keys, and new keys in existing chunks
    d.consume(c.batch("store", [entry(key(n)) for n in NUMS[::2]], tier="l2", backend="s3"))
    d.consume(c.batch("store", [entry(key(n, salt="new")) for n in NUMS[1::2]]))
    d.consume(c.batch("store", [entry(k) for k in chain[5:20]], tier="l2", backend="s3"))
    # re-store different content at another offset (re-binds the chunk, moves the blend index)
    d.consume(b.batch("store", [entry(key(n), toks(7, 7, n, 7), 4) for n in NUMS[::5]]))
    # deletes of some keys entirely, and of one placement of others
    d.consume(a.batch("delete", [entry(key(n)) for n in NUMS[::7]]))
    d.consume(b.batch("delete", [entry(key(n)) for n in NUMS[::3]], tier="l2", backend="fs"))
    d.consume(a.batch("delete", [entry(k) for k in chain[3:6]]))
    d.consume(a.batch("delete", [entry(key(n)) for n in GONE[:2]]))  # GONE[2] goes by the fence
    # accesses move last_access
    d.consume(a.batch("access", [entry(key(n)) for n in NUMS], ts=50.0))
    d.consume(b.batch("access", [entry(k) for k in chain], tier="l2", backend="fs", ts=60.0))
    # brand-new chunks on both sides
    d.consume(c.batch("store", [entry(key(n), content(n), 0) for n in (20, 90, 200, 250)]))
    # cursors and capacities move too
    d.consume(a.batch("config", tier="l1", backend="", capacity_bytes=70, capacity_revision=5))
    c.seq += 3
    d.consume(c.batch("access", [entry(key(101))], ts=70.0))
    # and a fence drops every L1 copy a reported
    assert d.fence_instance("a") > 0


def after_each_part(d: KeyDirectory, c: Emitter, part_no: int) -> None:
    """Changes to the partition just captured and to the next one, between two partitions."""
    ks = [key(n) for n in (part_no, part_no + 1) if n in NUMS]
    d.consume(c.batch("store", [entry(k, toks(9, 9, 9, part_no), 8) for k in ks], tier="l2"))
    d.consume(c.batch("delete", [entry(k) for k in ks], tier="l2"))
    d.consume(c.batch("store", [entry(k) for k in ks], tier="l2", backend="late"))


def observe(d: KeyDirectory) -> dict[str, Any]:
    """Everything a client can see of a directory (but the per-process batch counters)."""
    every_key = [key(n, salt=s) for n in range(1, PARTS) for s in ("", "s", "new")]
    every_key += [chain_key(h, s) for h in PROMPT_HASHES for s in ("", "s", "new")]
    stats = d.stats()
    blend_probes = [content(n) for n in NUMS + list(GONE)] + [toks(7, 7, n, 7) for n in NUMS]
    blend_probes += [PROMPT[i * CS : (i + 1) * CS] for i in range(len(PROMPT_HASHES))]
    return {
        "list_keys": d.list_keys(limit=1_000_000).items,
        "lookup": d.lookup(every_key),
        "lookup_tokens": d.lookup_tokens(PROMPT, "m"),
        "blend": [sorted(d.blend_match(t, NS), key=repr) for t in blend_probes],
        "emitters": d.emitters(),
        "capacities": d.capacities(),
        "stats": (
            stats.keys,
            stats.chunks,
            stats.bound_chunks,
            stats.placements,
            stats.l1_placements_by_instance,
            stats.bytes_by_tier,
            stats.emitters,
            stats.gaps,
            stats.capacity_bytes_by_instance,
        ),
    }


def oracle_state() -> dict[str, Any]:
    d = KeyDirectory(CS, enable_blend_lookup=True)
    feed(d, Emitter("a"), Emitter("b"))
    return observe(d)


def started() -> tuple[KeyDirectory, Emitter, Emitter, Emitter]:
    d, a, b, c = (
        KeyDirectory(CS, enable_blend_lookup=True),
        Emitter("a"),
        Emitter("b"),
        Emitter("c"),
    )
    feed(d, a, b)
    return d, a, b, c


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for name in want:
        assert got[name] == want[name], name


def interleaved(
    d: KeyDirectory, a: Emitter, b: Emitter, c: Emitter
) -> Callable[[Capture], Iterator[CapturedPart]]:
    """A replacement for Capture.parts that changes ``d`` between partitions."""
    original = Capture.parts

    def parts(capture: Capture) -> Iterator[CapturedPart]:
        for part_no, part in enumerate(original(capture)):
            yield part
            if part_no == SPLIT - 1:
                changes(d, a, b, c)
            after_each_part(d, c, part_no)

    return parts


def test_the_test_changes_are_visible() -> None:
    """Guard: the changes do change every observable the snapshot test compares."""
    d, a, b, c = started()
    before = observe(d)
    changes(d, a, b, c)
    after = observe(d)
    for name in before:
        assert after[name] != before[name], name


def test_install_of_a_capture_with_interleaved_changes_is_the_start_state() -> None:
    d, a, b, c = started()
    want = oracle_state()
    assert_same(observe(d), want)
    parts: list[Partition] = [{} for _ in range(PARTS)]
    with d.capture() as capture:
        for part in interleaved(d, a, b, c)(capture):
            for h, rec in part.records():
                parts[h[0]][h] = rec
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    restored.install(Restored(capture.state, capture.shapes, parts))
    assert_same(observe(restored), want)
    assert observe(d) != want  # the live directory did change


def test_saved_snapshot_with_interleaved_changes_restores_the_start_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, a, b, c = started()
    want = oracle_state()
    monkeypatch.setattr(Capture, "parts", interleaved(d, a, b, c))
    info = save_snapshot(d, tmp_path / "s.snap")
    monkeypatch.undo()
    assert observe(d) != want
    restored = KeyDirectory(CS, enable_blend_lookup=True)
    got = load_snapshot(restored, tmp_path / "s.snap")
    assert got.keys == info.keys == want["stats"][0]
    assert_same(observe(restored), want)
    # a second snapshot, of the changed directory, restores the changed state
    save_snapshot(d, tmp_path / "t.snap")
    again = KeyDirectory(CS, enable_blend_lookup=True)
    load_snapshot(again, tmp_path / "t.snap")
    assert_same(observe(again), observe(d))
