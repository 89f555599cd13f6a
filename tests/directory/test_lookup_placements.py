"""``KeyDirectory.lookup_placements`` (the route scorer's lookup, which builds no keys) gives
exactly what ``lookup`` gives for the keys ``expand_prefix_keys`` builds: for one rank and
two, salted and not, held and absent chunks, several holders and tiers of one key."""

from __future__ import annotations

import numpy as np

from kvatlas.directory import KeyDirectory
from kvatlas.events import CacheEntry, EventBatch
from kvatlas.keys import ObjectKey, expand_prefix_keys, pack_kv_rank

CHUNK = 16
MODEL = "m"
HASHES = [bytes([i]) + bytes(30) + bytes([i % 5]) for i in range(12)]


def _store(d: KeyDirectory, instance: str, seq: int, tier: str, keys: list[ObjectKey]) -> None:
    tokens = np.arange(CHUNK, dtype=np.uint32)
    entries = tuple(CacheEntry(k, 1 << 10, tokens + i, 0) for i, k in enumerate(keys))
    d.consume(EventBatch(instance, 1, seq, "store", tier, "dram", False, 1.0, entries))


def test_lookup_placements_equals_lookup_of_the_expanded_keys() -> None:
    d = KeyDirectory(CHUNK)
    r0, r1 = pack_kv_rank(2, 0, 2, 0), pack_kv_rank(2, 1, 2, 1)
    one = pack_kv_rank(1, 0, 1, 0)
    _store(d, "a", 1, "l1", [ObjectKey(h, MODEL, one) for h in HASHES[:6]])
    _store(d, "b", 1, "l2", [ObjectKey(h, MODEL, one) for h in HASHES[3:9]])
    _store(d, "b", 2, "l2", [ObjectKey(h, MODEL, one, 0, "tenant") for h in HASHES[:2]])
    _store(d, "c", 1, "l1", [ObjectKey(h, MODEL, r) for h in HASHES[:5] for r in (r0, r1)])
    _store(d, "a", 2, "l1", [ObjectKey(h, MODEL, r0) for h in HASHES[5:8]])
    for world_size in (1, 2):
        ranks = [pack_kv_rank(world_size, r, world_size, r) for r in range(world_size)]
        for salt in ("", "tenant", "nobody"):
            keys = expand_prefix_keys(HASHES, MODEL, world_size, salt)
            expected = [kp.placements for kp in d.lookup(keys)]
            assert d.lookup_placements(HASHES, MODEL, ranks, salt) == expected
            assert any(expected) == (salt == "" or (salt == "tenant" and world_size == 1))
    assert d.lookup_placements(HASHES, "other-model", [one]) == [()] * len(HASHES)
