"""L1Cache: LRU order, hard byte budget, eviction callbacks, pins, refusal, thread safety."""

from __future__ import annotations

import logging
import random
import threading
from collections import OrderedDict
from contextlib import AbstractContextManager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.keys import ObjectKey
from kvatlas.node.l1 import L1Cache
from kvatlas.node.pins import PinnedKeys
from kvatlas.node.stored_chunk import StoredChunk


def key(i: int, model: str = "org/model") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), model, 1 << 24 | 1 << 8)


def chunk(i: int, nbytes: int = 100) -> StoredChunk:
    assert nbytes % 4 == 0
    return StoredChunk(key(i), np.full(nbytes // 4, i, dtype=np.float32), token_offset=i)


def test_lru_order_and_touch() -> None:
    l1 = L1Cache(300)
    for i in range(3):
        assert l1.put(chunk(i)) == []
    assert l1.keys() == [key(0), key(1), key(2)]
    assert l1.get(key(0)) is not None  # touch: 0 becomes most recent
    assert l1.peek(key(1)) is not None  # no touch
    assert l1.get(key(2), touch=False) is not None  # no touch
    assert l1.keys() == [key(1), key(2), key(0)]
    evicted = l1.put(chunk(3))
    assert [c.key for c in evicted] == [key(1)]
    assert l1.keys() == [key(2), key(0), key(3)]
    assert not l1.contains(key(1)) and key(1) not in l1
    assert l1.get(key(1)) is None
    assert len(l1) == 3 and l1.used_bytes == 300


def test_byte_budget_evicts_as_many_as_needed() -> None:
    l1 = L1Cache(400)
    for i in range(4):
        l1.put(chunk(i, 100))
    evicted = l1.put(chunk(9, 300))
    assert [c.key for c in evicted] == [key(0), key(1), key(2)]
    assert l1.keys() == [key(3), key(9)]
    assert l1.used_bytes == 400


def test_replace_same_key_updates_bytes_without_eviction() -> None:
    seen: list[StoredChunk] = []
    l1 = L1Cache(300, on_evict=seen.append)
    l1.put(chunk(0, 100))
    l1.put(chunk(1, 100))
    bigger = StoredChunk(key(0), np.zeros(50, dtype=np.float32))  # 200 bytes
    assert l1.put(bigger) == []
    assert l1.peek(key(0)) is bigger
    assert l1.used_bytes == 300 and seen == []
    assert l1.keys() == [key(1), key(0)]  # re-put makes it most recent


def test_oversized_chunk_is_refused_and_cache_untouched() -> None:
    seen: list[StoredChunk] = []
    l1 = L1Cache(200, on_evict=seen.append)
    l1.put(chunk(0))
    l1.put(chunk(1))
    huge = chunk(2, 400)
    result = l1.put(huge)
    assert len(result) == 1 and result[0] is huge
    assert not l1.contains(key(2))
    assert l1.keys() == [key(0), key(1)] and l1.used_bytes == 200
    assert seen == []  # never entered L1: no eviction callback

    # a refused replacement keeps the old value
    old = l1.peek(key(0))
    assert l1.put(StoredChunk(key(0), np.zeros(100, dtype=np.float32)))[0].key == key(0)
    assert l1.peek(key(0)) is old


def test_eviction_callback_gets_evicted_chunks_outside_the_lock() -> None:
    l1: L1Cache
    seen: list[StoredChunk] = []

    def on_evict(c: StoredChunk) -> None:
        # re-entering the cache from the callback would deadlock if it ran under the lock
        assert not l1.contains(c.key)
        seen.append(c)
        if c.key == key(0):
            l1.put(chunk(100, 4))

    l1 = L1Cache(300, on_evict=on_evict)
    for i in range(3):
        l1.put(chunk(i))
    done = threading.Event()

    def storm() -> None:
        l1.put(chunk(3))
        done.set()

    threading.Thread(target=storm, daemon=True).start()
    assert done.wait(5), "on_evict re-entering the cache deadlocked"
    assert seen[0].key == key(0)
    assert seen[0].token_offset == 0  # the chunk object itself, not a copy
    assert l1.used_bytes <= 300


def test_failing_callback_does_not_lose_other_evictions(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[ObjectKey] = []

    def on_evict(c: StoredChunk) -> None:
        seen.append(c.key)
        if c.key == key(0):
            raise OSError("disk full")

    l1 = L1Cache(200, on_evict=on_evict)
    l1.put(chunk(0))
    l1.put(chunk(1))
    with caplog.at_level(logging.ERROR, logger="kvatlas.node"):
        evicted = l1.put(chunk(2, 200))
    assert [c.key for c in evicted] == [key(0), key(1)]
    assert seen == [key(0), key(1)]
    assert "on_evict callback failed" in caplog.text
    assert l1.keys() == [key(2)]


def test_pinned_entries_survive_pressure_and_full_pin_refuses() -> None:
    seen: list[StoredChunk] = []
    l1 = L1Cache(300, on_evict=seen.append)
    for i in range(3):
        l1.put(chunk(i))
    with l1.pinned([key(0)]):
        assert l1.is_pinned(key(0))
        evicted = l1.put(chunk(3))  # LRU is 0, pinned: 1 goes instead
        assert [c.key for c in evicted] == [key(1)]
        with l1.pinned([key(2), key(3), key(0)]):  # nested pin on 0
            newcomer = chunk(4)
            result = l1.put(newcomer)  # every resident is pinned: refused, nothing evicted
            assert len(result) == 1 and result[0] is newcomer
            assert l1.keys() == [key(0), key(2), key(3)]
        assert l1.is_pinned(key(0)) and not l1.is_pinned(key(2))
        # 0 still pinned (outer block): 2 goes, although 0 is least recently used
        assert [c.key for c in l1.put(chunk(5))] == [key(2)]
    assert not l1.is_pinned(key(0))
    assert [c.key for c in l1.put(chunk(6))] == [key(0)]
    assert [c.key for c in seen] == [key(1), key(2), key(0)]  # refusal is not an eviction


def test_operator_pins_hold_off_eviction_while_they_last() -> None:
    """``held`` (the coordinator's pins, as the node keeps them): the LRU passes them by; a put
    that only they could make room for is refused; replaced by an empty set, they go."""
    pins = PinnedKeys([key(0)])
    l1 = L1Cache(300, held=pins)
    for i in range(3):
        l1.put(chunk(i))
    assert l1.is_pinned(key(0)) and not l1.is_pinned(key(1))
    assert [c.key for c in l1.put(chunk(3))] == [key(1)]
    pins.replace([key(0), key(2), key(3)])
    newcomer = chunk(4)
    assert l1.put(newcomer) == [newcomer] and l1.keys() == [key(0), key(2), key(3)]
    pins.replace([])
    assert [c.key for c in l1.put(chunk(4))] == [key(0)]


def test_partial_room_from_pins_refuses_without_evicting() -> None:
    l1 = L1Cache(300)
    for i in range(3):
        l1.put(chunk(i))
    with l1.pinned([key(0), key(1)]):
        # needs 200 bytes freed; only 100 (key 2) is evictable: refuse, keep key 2
        big = chunk(9, 200)
        assert l1.put(big) == [big]
        assert l1.keys() == [key(0), key(1), key(2)]


def test_pin_of_absent_key_applies_once_it_arrives_and_remove_ignores_pins() -> None:
    l1 = L1Cache(200)
    with l1.pinned([key(7)]):
        l1.put(chunk(7))
        l1.put(chunk(1))
        assert [c.key for c in l1.put(chunk(2))] == [key(1)]  # 7 is LRU but pinned
        assert l1.remove(key(7)) is True  # removal is a correctness call, not eviction
        assert l1.remove(key(7)) is False
    assert l1.keys() == [key(2)] and l1.used_bytes == 100


def test_pins_released_when_block_raises() -> None:
    l1 = L1Cache(100)
    l1.put(chunk(0))
    with pytest.raises(RuntimeError), l1.pinned([key(0)]):
        raise RuntimeError("transfer failed")
    assert not l1.is_pinned(key(0))
    assert [c.key for c in l1.put(chunk(1))] == [key(0)]


def test_bad_capacity_rejected() -> None:
    with pytest.raises(ValueError):
        L1Cache(-1)
    with pytest.raises(TypeError):
        L1Cache(True)


class _ModelLRU:
    """The naive oracle: the documented semantics, written as plainly as possible."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, int] = OrderedDict()  # key -> size, LRU first
        self.pins: dict[int, int] = {}

    def put(self, k: int, size: int) -> list[int] | None:
        others = {x: s for x, s in self.entries.items() if x != k}
        if size > self.capacity:
            return None
        evictable = [x for x in others if self.pins.get(x, 0) == 0]
        free = self.capacity - sum(others.values())
        if free + sum(others[x] for x in evictable) < size:
            return None
        out = []
        for x in evictable:
            if free >= size:
                break
            free += self.entries.pop(x)
            out.append(x)
        self.entries.pop(k, None)
        self.entries[k] = size
        return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "remove", "pin", "unpin"]),
            st.integers(0, 7),
            st.integers(1, 4),
        ),
        max_size=60,
    )
)
def test_matches_naive_model(ops: list[tuple[str, int, int]]) -> None:
    l1 = L1Cache(600)
    model = _ModelLRU(600)
    pins: list[tuple[int, AbstractContextManager[None]]] = []
    for op, k, units in ops:
        if op == "put":
            c = chunk(k, 100 * units)
            expected = model.put(k, 100 * units)
            got = l1.put(c)
            if expected is None:
                assert len(got) == 1 and got[0] is c
            else:
                assert [x.key for x in got] == [key(x) for x in expected]
        elif op == "get":
            present = k in model.entries
            assert (l1.get(key(k)) is not None) == present
            if present:
                model.entries.move_to_end(k)
        elif op == "remove":
            assert l1.remove(key(k)) == (model.entries.pop(k, None) is not None)
        elif op == "pin":
            pin = l1.pinned([key(k)])
            pin.__enter__()
            pins.append((k, pin))
            model.pins[k] = model.pins.get(k, 0) + 1
        elif pins:
            pk, held = pins.pop(units % len(pins))
            held.__exit__(None, None, None)
            model.pins[pk] -= 1
        assert l1.keys() == [key(x) for x in model.entries]
        assert l1.used_bytes == sum(model.entries.values()) <= 600


def test_thread_safety_smoke() -> None:
    evicted: list[ObjectKey] = []
    refused: list[ObjectKey] = []
    removed: list[ObjectKey] = []
    lock = threading.Lock()
    l1 = L1Cache(2000, on_evict=lambda c: evicted.append(c.key))
    n_threads, n_ops = 4, 1500
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for n in range(n_ops):
                i = tid * n_ops + n  # unique keys: every put is accounted exactly once
                c = chunk(i, 4 * rng.randint(1, 100))
                r = rng.random()
                if r < 0.1:
                    with l1.pinned([key(rng.randrange(i + 1))]):
                        got = l1.put(c)
                else:
                    got = l1.put(c)
                if got and got[-1] is c:
                    with lock:
                        refused.append(c.key)
                if rng.random() < 0.2:
                    l1.get(key(rng.randrange(i + 1)))
                if rng.random() < 0.05:
                    victim = key(rng.randrange(i + 1))
                    if l1.remove(victim):
                        with lock:
                            removed.append(victim)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    present = l1.keys()
    assert len(present) == len(l1)
    assert l1.used_bytes == sum(c.nbytes for c in (l1.peek(k) for k in present) if c) <= 2000
    accounted = len(present) + len(evicted) + len(refused) + len(removed)
    assert accounted == n_threads * n_ops
    assert len(set(evicted) | set(present) | set(removed)) == len(evicted) + len(present) + len(
        removed
    )
