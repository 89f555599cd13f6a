"""The fleet eviction planner (docs/cache-control.md, "Fleet eviction") against a brute-force
oracle: never a pinned key, an exempt salt never evicted, a limit of 0 evicts everything
unpinned, the value policy leaves usage at most the target, and LRU order is exactly the order
of an LRU list replayed touch by touch (LMCache's count: ``max(1, int(ratio x keys))``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.cache_control import QuotaTable
from kvatlas.coordinator.cache_control.eviction import (
    DEFAULT_POLICY,
    EvictionConfig,
    EvictionPolicy,
    KeyFacts,
    SaltState,
    limit_bytes_of,
    plan,
    plan_salt,
)
from kvatlas.coordinator.config import parse_config

CONFIG = EvictionConfig(chunk_tokens=256)


@st.composite
def salts(draw: st.DrawFn) -> tuple[SaltState[str], list[str]]:
    """A salt built by replaying touches (stores and accesses) in order, as the directory sees
    them, and the LRU list that replay leaves (least recent first): the oracle's order."""
    n = draw(st.integers(0, 12))
    touches = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=30)) if n else []
    times = sorted(draw(st.lists(st.integers(0, 5), min_size=n + len(touches),
                                 max_size=n + len(touches))))  # fmt: skip
    lru: list[str] = []
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    for step, index in enumerate([*range(n), *touches]):
        key = f"k{index}"
        if key in lru:
            lru.remove(key)
        lru.append(key)
        last[key] = float(times[step])
        count[key] = count.get(key, 0) + 1
    sizes = {k: draw(st.sampled_from([0, 10, 20, 30])) for k in lru}  # ties are common
    pinned = {k: draw(st.booleans()) for k in lru}
    positions = {k: draw(st.sampled_from([0, 1, 40])) for k in lru}
    listed = _shuffle_across_times(lru, last, draw)  # the caller's order
    extra = draw(st.integers(0, 50))  # bytes of copies the keys here do not account for
    usage = sum(sizes.values()) + extra
    limit = draw(st.one_of(st.none(), st.just(0), st.integers(0, usage + 20)))
    facts = [KeyFacts(k, sizes[k], last[k], count[k], positions[k], pinned[k]) for k in listed]
    return SaltState.of("s", usage, limit, facts), lru


def _shuffle_across_times(listed: list[str], last: dict[str, float],
                          draw: st.DrawFn) -> list[str]:  # fmt: skip
    """Reorder the list freely except among keys of equal time (whose order is the tie-break)."""
    groups: dict[float, list[str]] = {}
    for k in listed:
        groups.setdefault(last[k], []).append(k)
    order = draw(st.permutations(sorted(groups)))
    return [k for t in order for k in groups[t]]


def _oracle(policy: EvictionPolicy, state: SaltState[str], lru: list[str],
            now_s: float) -> list[str]:  # fmt: skip
    """The plan, one step at a time."""
    limit = state.limit_bytes
    if limit is None or state.usage_bytes == 0 or state.usage_bytes < CONFIG.watermark * limit:
        return []
    rows = {k: i for i, k in enumerate(state.keys)}
    unpinned = [k for k in lru if not state.pinned[rows[k]]]
    if limit == 0:
        return unpinned
    if policy is EvictionPolicy.LRU:
        count = max(1, int(len(lru) * CONFIG.ratio))
        return unpinned[:count]

    def density(k: str) -> float:
        i = rows[k]
        size = int(state.size_bytes[i])
        if size == 0:
            return math.inf
        rate = int(state.access_count[i]) / (max(now_s - state.last_access_s[i], 0.0)
                                              + CONFIG.pass_interval_s)  # fmt: skip
        context = (int(state.position[i]) + 0.5) * CONFIG.chunk_tokens
        return rate * CONFIG.chunk_tokens * (1 + context / CONFIG.crossover_tokens) / size

    ranked = sorted(unpinned, key=lambda k: (density(k), lru.index(k)))
    chosen: list[str] = []
    usage = state.usage_bytes
    for k in ranked:
        if usage <= CONFIG.watermark * limit:
            break
        chosen.append(k)
        usage -= int(state.size_bytes[rows[k]])
    return chosen


@settings(max_examples=250, deadline=None)
@given(salts(), st.sampled_from(list(EvictionPolicy)), st.integers(5, 20))
def test_the_plan_is_the_oracles(salt: tuple[SaltState[str], list[str]],
                                 policy: EvictionPolicy, now: int) -> None:  # fmt: skip
    state, lru = salt
    eviction = plan_salt(policy, state, float(now), CONFIG)
    chosen = list(eviction.keys) if eviction else []
    assert chosen == _oracle(policy, state, lru, float(now))
    rows = {k: i for i, k in enumerate(state.keys)}
    assert not any(state.pinned[rows[k]] for k in chosen)
    if state.limit_bytes is None:
        assert chosen == []
    if state.limit_bytes == 0 and state.usage_bytes > 0:
        assert set(chosen) == {k for k in lru if not state.pinned[rows[k]]}
    if eviction is not None:
        assert eviction.freed_bytes == sum(int(state.size_bytes[rows[k]]) for k in chosen)
        assert eviction.usage_after_bytes == state.usage_bytes - eviction.freed_bytes
        if policy is EvictionPolicy.VALUE and state.limit_bytes:
            pinned_bytes = int(state.size_bytes[state.pinned].sum())
            untracked = state.usage_bytes - int(state.size_bytes.sum())
            floor = pinned_bytes + untracked
            assert eviction.usage_after_bytes <= max(state.limit_bytes, floor)


def _facts(n: int, pinned: frozenset[int] = frozenset(), size: int = 10) -> list[KeyFacts[str]]:
    return [KeyFacts(f"k{i}", size, float(i), 1, i, i in pinned) for i in range(n)]


def test_lmcache_lru_evicts_a_fifth_of_the_keys_counting_the_pinned_ones() -> None:
    state = SaltState.of("s", 100, 100, _facts(10, pinned=frozenset({0, 2})))
    eviction = plan_salt(EvictionPolicy.LRU, state, 20.0)
    assert eviction is not None and eviction.keys == ("k1", "k3")  # int(10 x 0.2) = 2
    one = plan_salt(EvictionPolicy.LRU, SaltState.of("s", 30, 30, _facts(3)), 20.0)
    assert one is not None and one.keys == ("k0",)  # at least one key
    below = SaltState.of("s", 99, 100, _facts(10))
    assert plan_salt(EvictionPolicy.LRU, below, 20.0) is None  # under the watermark


def test_null_is_exempt_and_zero_evicts_every_unpinned_key() -> None:
    quotas = QuotaTable(default_limit_gb=None, limits={"t0": 0.0})
    exempt = SaltState.of("t1", 10**12, limit_bytes_of(quotas, "t1"), _facts(5))
    zero = SaltState.of("t0", 50, limit_bytes_of(quotas, "t0"), _facts(5, pinned=frozenset({3})))
    evictions = plan(EvictionPolicy.VALUE, [exempt, zero], 10.0)
    assert [(e.cache_salt, e.keys) for e in evictions] == [("t0", ("k0", "k1", "k2", "k4"))]
    assert plan(EvictionPolicy.LRU, [SaltState.of("t0", 0, 0, [])], 10.0) == []


def test_value_keeps_what_is_reused_most_per_byte() -> None:
    facts = [
        KeyFacts("hot", 10, 9.0, 50, 0),  # reused often
        KeyFacts("cold", 10, 9.0, 1, 0),
        KeyFacts("big", 40, 9.0, 50, 0),  # as often as hot, four times the bytes
        KeyFacts("deep", 10, 9.0, 1, 200),  # as cold, but costly to recompute (position)
        KeyFacts("pinned", 10, 0.0, 1, 0, pinned=True),
    ]
    eviction = plan_salt(EvictionPolicy.VALUE, SaltState.of("s", 80, 60, facts), 10.0)
    assert eviction is not None and eviction.keys == ("cold", "deep")
    assert eviction.usage_after_bytes == 60


def test_columns_must_match_and_limits_are_not_negative() -> None:
    with pytest.raises(ValueError):
        SaltState("s", 0, None, ["a"], np.zeros(2, dtype=np.int64), np.zeros(1),
                  np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                  np.zeros(1, dtype=bool))  # fmt: skip
    with pytest.raises(ValueError):
        SaltState.of("s", 0, -1, [])
    with pytest.raises(ValueError):
        SaltState.of("s", 10, 5, [KeyFacts("k", 10, math.nan)])
    with pytest.raises(ValueError):
        EvictionConfig(watermark=0.0)


def test_the_coordinator_flag_defaults_to_the_measured_winner() -> None:
    assert parse_config([], environ={}).eviction_policy == DEFAULT_POLICY.value
    assert parse_config(["--eviction-policy", "value"], environ={}).eviction_policy == "value"
