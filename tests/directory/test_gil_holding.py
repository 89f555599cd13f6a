"""Ingestion and short lookups never release the GIL for microseconds.

A thread waiting for the GIL is woken each time the holder releases it; if the holder takes
it back before the waiter runs, the waiter sleeps again with its switch interval restarted.
A thread that releases the GIL for a few microseconds per batch (a ``nogil`` kernel of one
small batch) so starves every other thread: a snapshot beside a thread consuming small
batches took 10–200× its time. These tests count the waiter's wake-ups (its voluntary context
switches) while this thread consumes, with a switch interval so long that only a release can
wake it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest

from kvatlas.directory import KeyDirectory
from kvatlas.directory.blend import BlendIndex
from kvatlas.events import CacheEntry, EventBatch, decode_json, decode_json_columns, encode_json
from kvatlas.keys import BlendNamespace, ObjectKey, pack_kv_rank

CHUNK = 256
_RANK = pack_kv_rank(1, 0, 1, 0)
NS = BlendNamespace("model")


def _wakeups() -> int:
    """This thread's voluntary context switches so far (the times it went to sleep)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


@contextmanager
def _gil_waiter() -> Iterator[list[int]]:
    """A thread waiting for the GIL while the body runs, with a switch interval so long that
    only a release lets it in; each time it gets in, it gives the GIL back and waits again.
    The list yielded holds, after the body, how often it went to sleep meanwhile (a few times
    when nothing released the GIL; at least once per release it saw otherwise)."""
    ready, go, stop = threading.Event(), threading.Event(), threading.Event()
    slept: list[int] = []

    def wait_for_the_gil() -> None:
        before = _wakeups()
        ready.set()
        go.wait()
        while not stop.is_set():  # runs only while holding the GIL: after a release
            time.sleep(0.0005)  # give it back, then wait for the next release
        slept.append(_wakeups() - before)

    waiter = threading.Thread(target=wait_for_the_gil, daemon=True)
    waiter.start()
    ready.wait()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        go.set()
        yield slept
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        waiter.join()


def _batches(n: int, per_batch: int, seed: int) -> list[EventBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n):
        entries = []
        for i in range(per_batch):
            tokens = rng.integers(0, 50_000, CHUNK, dtype=np.uint32)
            tokens.flags.writeable = False
            key = ObjectKey(rng.bytes(32), "model", _RANK)
            entries.append(CacheEntry(key, 65536, tokens, (b * per_batch + i) * CHUNK))
        out.append(EventBatch("probe", 1, b + 1, "store", "l1", "dram", False, 0.0, tuple(entries)))
    return out


def test_storing_chunks_again_in_small_batches_never_releases_the_gil() -> None:
    """What a client storing the same chunks again does (the snapshot benchmark's probe, an
    engine re-storing a block): a release per batch starved a snapshot writer 10–100×."""
    (batch,) = _batches(1, 8, seed=2)
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for seq in range(1, 5):  # compiled and warm
        d.consume(replace(batch, seq=seq))
    with _gil_waiter() as woken:
        for seq in range(5, 405):
            d.consume(replace(batch, seq=seq))
    assert d.stats().keys == 8
    cursor = d.gap_state("probe")
    assert cursor is not None and cursor.last_seq == 404  # every batch applied
    assert woken[0] < 20  # a release per batch wakes it ≈400 times


def _wakeups_storing_again(batches: list[EventBatch]) -> int:
    """The waiter's wake-ups while ``batches`` are stored into a directory they were stored
    into and deleted from before (compiled, warm, and grown, then emptied: the rows and ids
    are reused)."""
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    seq = 0
    for kind in ("store", "delete"):
        for b in batches:
            seq += 1
            d.consume(replace(b, seq=seq, event_type=kind))
    assert d.stats().keys == 0
    with _gil_waiter() as woken:
        for b in batches:
            seq += 1
            d.consume(replace(b, seq=seq))
    assert d.stats().keys == sum(len(b.entries) for b in batches)
    return woken[0]


def test_storing_new_chunks_in_small_batches_never_releases_the_gil() -> None:
    """What a node storing chunks a few at a time does (the inventory digests' step was
    numpy's ``ufunc.at``, which releases the GIL on every call: a release per batch)."""
    assert _wakeups_storing_again(_batches(200, 8, seed=6)) < 20  # ≈200 with a release a batch


def test_storing_batches_of_mixed_keys_never_releases_the_gil() -> None:
    """What a node storing a batch of several models' (or salts') chunks does, or a batch
    with chunks of unknown offset (stored, not indexed): the index adds of such a batch were
    indexed by ``np.unique``, which releases the GIL on every call."""
    mixed = []
    for b in _batches(200, 8, seed=10):
        entries = list(b.entries)
        k = entries[1].key
        entries[1] = replace(entries[1], key=replace(k, model_name="other"))  # another shape
        entries[2] = replace(entries[2], token_offset=-1)  # offset unknown: not indexed
        mixed.append(replace(b, entries=tuple(entries)))
    assert _wakeups_storing_again(mixed) < 20  # 391–797 at 7033b3a: two releases a batch


def test_short_lookups_and_accesses_never_release_the_gil() -> None:
    """What a router's prefix lookup of a few chunks does, and a node's access reports: each
    reads its chunks' rows as one batch (``np.arange`` there released the GIL on every call:
    a release per lookup)."""
    batches = _batches(100, 8, seed=4)
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for b in batches:
        d.consume(b)
    keys = [[e.key for e in b.entries] for b in batches]
    d.lookup(keys[0])  # warm
    seq = len(batches)
    with _gil_waiter() as woken:
        for _ in range(4):
            for ks in keys:
                d.lookup(ks)
        for b in batches:
            seq += 1
            d.consume(replace(b, seq=seq, event_type="access", ts=1.0))
    assert all(p.last_access == 1.0 for kp in d.lookup(keys[-1]) for p in kp.placements)
    assert woken[0] < 20  # a release per lookup or batch wakes it hundreds of times


def test_single_blend_writes_never_release_the_gil() -> None:
    """What a cache node does as it stores and evicts chunks one at a time."""
    rng = np.random.default_rng(3)
    chunks = [(rng.integers(0, 50_000, CHUNK, dtype=np.uint32), rng.bytes(32)) for _ in range(2000)]
    index = BlendIndex(chunk_size=CHUNK)
    for tokens, h in chunks:  # compiled, warm, and grown: growing copies arrays, which
        index.add(tokens, h, 0, NS)  # releases the GIL (rarely, for long enough)
    for tokens, h in chunks:
        index.remove_claim(tokens, h, NS)
    with _gil_waiter() as woken:
        for tokens, h in chunks:
            index.add(tokens, h, 0, NS)
        for tokens, h in chunks[::2]:
            index.remove_claim(tokens, h, NS)
    assert index.stats().claims == 1000
    assert woken[0] < 20  # a release per write wakes it hundreds of times


def test_short_blend_matches_never_release_the_gil() -> None:
    """What a lookup of a prompt of a few chunks does: its scan takes microseconds."""
    rng = np.random.default_rng(4)
    chunks = [(rng.integers(0, 50_000, CHUNK, dtype=np.uint32), rng.bytes(32)) for _ in range(64)]
    index = BlendIndex(chunk_size=CHUNK)
    for tokens, h in chunks:
        index.add(tokens, h, 0, NS)
    query = np.concatenate([chunks[3][0], chunks[9][0][:40]])  # 41 windows, < 500 ids
    for _ in range(4):  # compiled and warm
        assert len(index.match(query, NS)) == 1
    with _gil_waiter() as woken:
        for _ in range(400):
            index.match(query, NS)
    assert woken[0] < 20  # a release per match woke it 204 times


def test_decoding_small_json_bodies_never_releases_the_gil() -> None:
    """What a stream consumer does per stream entry (a JSON body: here of one chunk, fewer
    ids than numpy's own calls release the GIL for), and the coordinator per ``POST /events``
    body."""
    body = encode_json(_batches(1, 1, seed=5))
    for _ in range(4):  # compiled and warm
        decode_json(body)
        decode_json_columns(body)
    with _gil_waiter() as woken:
        for _ in range(200):
            decode_json(body)
            decode_json_columns(body)
    assert woken[0] < 20  # a release per body woke it 45 times


def test_the_kernels_that_release_the_gil_give_the_same_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The releasing variants (long scans, large bodies) are the same kernels behind another
    entry point: with every call taking them, the same matches and the same decoded bodies."""
    from kvatlas.directory.blend import kernels
    from kvatlas.events import _json_cut, _json_tokens

    rng = np.random.default_rng(6)
    chunks = [(rng.integers(0, 50_000, CHUNK, dtype=np.uint32), rng.bytes(32)) for _ in range(16)]
    index = BlendIndex(chunk_size=CHUNK)
    for tokens, h in chunks:
        index.add(tokens, h, 0, NS)
    query = np.concatenate(
        [chunks[5][0], rng.integers(0, 50_000, 77, dtype=np.uint32), chunks[2][0]]
    )
    body = encode_json(_batches(2, 3, seed=7))
    holding = index.match(query, NS), decode_json(body), decode_json_columns(body)
    monkeypatch.setattr(kernels, "RELEASE_WINDOWS", 0)
    monkeypatch.setattr(_json_tokens, "RELEASE_BYTES", 0)
    monkeypatch.setattr(_json_cut, "RELEASE_BYTES", 0)
    releasing = index.match(query, NS), decode_json(body), decode_json_columns(body)
    assert len(holding[0]) == 2 and releasing[0] == holding[0]
    assert releasing[1] == holding[1]
    assert [c.entry_columns().entries() for c in releasing[2]] == [
        c.entry_columns().entries() for c in holding[2]
    ]


def test_the_releasing_form_of_a_kernel_releases_the_gil() -> None:
    """The releasing forms (``kvatlas/kernel_twins.py``) do release the GIL, as loaded from
    numba's on-disk cache too (two forms under one cache name would share one machine code):
    the JSON token parser's, on one long list, lets the waiter in on every call; its holding
    form (the negative control) never does."""
    from kvatlas.events import _json_tokens

    ids = np.random.default_rng(8).integers(0, 50_000, 1 << 20, dtype=np.uint32)
    buf = np.frombuffer(("[" + ",".join(map(str, ids.tolist())) + "]").encode(), np.uint8)
    starts, ends = np.zeros(1, np.int64), np.full(1, len(buf), np.int64)
    arena, lengths = np.empty(len(ids), np.uint32), np.zeros(1, np.int64)
    woken = {}
    for form in (_json_tokens._parse_lists, _json_tokens._parse_lists_releasing):
        assert form(buf, starts, ends, arena, lengths) == -1  # compiled and warm
        assert lengths[0] == len(ids)
        with _gil_waiter() as slept:
            for _ in range(10):
                form(buf, starts, ends, arena, lengths)
        woken[form.__name__] = slept[0]
    print(woken)
    assert woken["_parse_lists_releasing"] >= 10, woken
    assert woken["_parse_lists"] < 5, woken


def test_deleting_chunks_in_small_batches_never_releases_the_gil() -> None:
    """What a node evicting chunks a few at a time does, and an engine's removed blocks: the
    removal's settling (2-D masks, ``np.bincount``, ``np.unique``) released the GIL three or
    four times a batch. Each delete batch names chunks of eight store batches (eight groups
    of placements), as evictions do."""
    batches = _batches(100, 8, seed=8)
    n = len(batches)
    evictions = [
        replace(batches[k], event_type="delete",
                entries=tuple(batches[(k + i) % n].entries[i] for i in range(8)))
        for k in range(n)
    ]  # fmt: skip
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    seq = 0
    for _ in range(2):  # compiled and warm: stored, deleted, stored again
        for b in (*batches, *evictions):
            seq += 1
            d.consume(replace(b, seq=seq))
        assert d.stats().keys == 0
    for b in batches:
        seq += 1
        d.consume(replace(b, seq=seq))
    assert d.stats().keys == 8 * n
    with _gil_waiter() as woken:
        for b in evictions:
            seq += 1
            d.consume(replace(b, seq=seq))
    assert d.stats().keys == 0
    assert woken[0] < 20  # a release per batch wakes it ≥ 100 times


def test_a_second_models_claims_in_small_batches_never_release_the_gil() -> None:
    """What a node storing chunks another model (or salt) already stored does: each chunk's
    occupant gets a claim in the extra-claim set, which the index settles op by op; reading
    those ops' results was a 2-D index (a release per batch)."""
    batches = _batches(100, 8, seed=12)
    again = [
        replace(
            b,
            instance_id="second",
            entries=tuple(replace(e, key=replace(e.key, model_name="other")) for e in b.entries),
        )
        for b in batches
    ]
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    for b in batches[:4] + again[:4]:  # compiled and warm
        d.consume(b)
    for b in batches[4:]:
        d.consume(b)
    index = d.blend_index
    assert index is not None
    extra = index.stats().claims
    with _gil_waiter() as woken:
        for b in again[4:]:
            d.consume(b)
    assert index.stats().claims == extra + 8 * 96  # each chunk claimed again, for "other"
    assert woken[0] < 20  # a release per batch wakes it ≈100 times
