"""A lookup reads its keys as one batch (``ChunkTable.lookup``, ``rank_placements``: rows, then
fields gathered from the columns, contents widened by one compiled call) and answers exactly
what reading each key's record on its own answers (the record API: ``find_key``,
``placements_at``, ``record_tokens``; a chunk of several salts' bindings): placements
and bound content, for chunks of one key and of several, keys absent, shapes never stored,
chunks without content, contents of every form."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np
import pytest

from kvatlas.directory import KeyDirectory
from kvatlas.directory.records import (
    KeyPlacements,
    Placement,
    find_key,
    key_placements_of,
    placements_at,
    public_placements,
    record_tokens,
)
from kvatlas.directory.token_store import widened
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, pack_kv_rank

CHUNK = 8
RANKS = [pack_kv_rank(2, r, 2, r) for r in range(2)]
FORMS = (1 << 16, 128_256, 1 << 24, 1 << 32)  # ids below these: uint16, planes 17 and 24, uint32


def _hash(i: int) -> bytes:
    return i.to_bytes(2, "little") * 16


def _directory(rng: np.random.Generator, short: bool = True) -> KeyDirectory:
    """``short``: some contents shorter than a chunk (else one length: the uniform read)."""
    d = KeyDirectory(CHUNK, enable_blend_lookup=True)
    stores = (
        ("a", "l1", RANKS[:1], "", range(0, 40)),
        ("b", "l2", RANKS, "", range(20, 60)),  # chunks 20-39: keys of several ranks
        ("c", "l1", RANKS[1:], "t", range(30, 50)),  # and of another salt
    )
    for seq, (inst, tier, ranks, salt, chunks) in enumerate(stores, start=1):
        entries = []
        for i in chunks:
            hi = FORMS[i % len(FORMS)]
            n = CHUNK if i % 7 or not short else 5
            tokens = None if i % 11 == 3 else rng.integers(0, hi, n, dtype=np.uint64)
            ids = None if tokens is None else tokens.astype(np.uint32)
            entries += [
                CacheEntry(ObjectKey(_hash(i), "m", r, 0, salt), 1 << 10, ids, 0) for r in ranks
            ]
        d.consume(EventBatch(inst, 1, seq, "store", tier, "dram", False, 1.0, tuple(entries)))
    return d


def _alone(d: KeyDirectory, k: ObjectKey) -> KeyPlacements:
    """The key read on its own, from its chunk's record."""
    table: Any = d._chunks
    h = k.chunk_hash
    rec = table.parts[h[0]].get(h)
    sid = table.shapes.id_of(k)
    at = -1 if rec is None or sid is None else find_key(rec, sid)
    if at < 0:
        return KeyPlacements(k, ())
    content = record_tokens(rec)
    bindings = table.tenants.rows.get(h)  # a chunk of several salts: the key's salt's own
    if bindings is not None:
        own = bindings.get(k.cache_salt)
        content = None if own is None else widened(own[0])
    return KeyPlacements(k, public_placements(placements_at(rec, at)), content)


def _same(got: list[KeyPlacements], want: list[KeyPlacements]) -> None:
    assert got == want  # keys and placements (content is not part of equality)
    for g, w in zip(got, want, strict=True):
        assert (None if g.content is None else g.content.tolist()) == (
            None if w.content is None else w.content.tolist()
        ), g.key


@pytest.mark.parametrize("short", [True, False])
def test_a_batch_lookup_answers_what_each_key_read_alone_answers(short: bool) -> None:
    d = _directory(np.random.default_rng(0), short)
    keys = [
        ObjectKey(_hash(i), model, r, 0, salt)
        for i in range(-5, 65)
        for model in ("m", "other")
        for r in [*RANKS, pack_kv_rank(1, 0, 1, 0)]
        for salt in ("", "t")
        if i >= 0
    ]
    want = [_alone(d, k) for k in keys]
    assert sum(1 for w in want if w.placements) > 100 and any(
        w.placements and w.content is None for w in want
    )
    _same(d.lookup(keys), want)
    _same(d.lookup(keys[::-1]), want[::-1])
    _same(d.lookup([]), [])
    for size in (1, 7, 16, 17):  # short lookups (rows addressed by a list up to 16) and longer
        for at in range(0, len(keys), 41 * size):
            _same(d.lookup(keys[at : at + size]), want[at : at + size])
    hashes = [_hash(i) for i in range(70)]
    for salt in ("", "t", "nobody"):
        expected = [
            _alone(d, ObjectKey(h, "m", r, 0, salt)).placements for h in hashes for r in RANKS
        ]
        assert d.lookup_placements(hashes, "m", RANKS, salt) == expected


def test_key_placements_of_is_the_constructor_of_each() -> None:
    """The answers made by maps are what the class's own constructor makes, field for field,
    and stay frozen."""
    keys = [ObjectKey(_hash(i), "m", RANKS[0], 0, "") for i in range(5)]
    placements = [(), (Placement("n", 1, "l1", "dram", 1, False, 0.0),), (), (), ()]
    contents = [None, np.arange(3, dtype=np.uint32), None, np.zeros(2, np.uint32), None]
    got = key_placements_of(keys, placements, contents)
    want = [KeyPlacements(*fields) for fields in zip(keys, placements, contents, strict=True)]
    assert got == want
    assert [g.content for g in got] == [w.content for w in want]  # the very arrays
    assert all(type(g) is KeyPlacements for g in got)
    with pytest.raises(FrozenInstanceError):
        got[0].placements = ()  # type: ignore[misc]
    assert key_placements_of([], [], []) == []
