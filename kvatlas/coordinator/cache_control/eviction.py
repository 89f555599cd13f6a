"""Fleet eviction per cache salt: which keys a pass evicts. A pinned key is never chosen, an
exempt salt (no limit) never loses a key, and a salt whose limit is 0 loses every unpinned key.

Pure: the planner reads per-salt usage, limits and per-key facts and returns the keys to evict;
it sends nothing and records nothing (the delivery loop turns each :class:`Eviction` into a
durable ``evict`` command, ``commands.py``). Two policies, chosen by one flag
(``--eviction-policy``, :data:`DEFAULT_POLICY`):

- ``lru`` — LMCache's coordinator loop as LMCache 0.5.6 ships it: one LRU per salt; a salt
  whose usage is at or above ``watermark`` x its limit loses ``max(1, int(ratio x keys))`` keys
  (``keys`` counts the pinned ones too), least recently used first, pinned ones skipped
  (ratio 1 when the limit is 0). Its defaults: watermark 1.0, ratio 0.2, a pass every 5 s.
- ``value`` — evict first what is least likely to be reused per byte: a key's value density is
  ``access_count / (idle_s + pass_interval_s)`` (its reuse rate, from the directory's
  ``access`` events) x its recompute cost (its tokens x ``(1 + context / crossover)``: the
  attention share of prefill grows with the chunk's position) / its bytes; the lowest go
  first, until usage is at most ``watermark`` x the limit (LMCache's fixed fraction does not
  promise that).

Ties keep LRU order, and LRU order is ``last_access_s``, then the order the caller lists the
keys in (give them in the order the directory saw their touches). ``docs/cache-control.md``,
"Fleet eviction", has the comparison on the Mooncake traces (``kvatlas bench eviction``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import numpy as np

from kvatlas.coordinator.cache_control.quotas import GB, Quotas

K = TypeVar("K")


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    VALUE = "value"


DEFAULT_POLICY: Final = EvictionPolicy.LRU
"""What ``--eviction-policy`` defaults to: the policy that won ``kvatlas bench eviction``."""
POLICY_NAMES: Final = tuple(p.value for p in EvictionPolicy)


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """The loop's constants. ``watermark``, ``ratio`` and ``pass_interval_s`` are LMCache
    0.5.6's coordinator defaults (``MPCoordinatorConfig``: ``trigger_watermark`` 1.0,
    ``eviction_ratio`` 0.2, ``eviction_check_interval`` 5 s). ``chunk_tokens`` is the fleet's
    chunk size (LMCache's 256). ``crossover_tokens`` is the context at which a token's attention
    costs as much as its linear layers: Llama-3-8B (32 layers, d_model 4096, 8.0 B parameters)
    spends 2 x 8.0e9 FLOPs per token in its weights and 4 x 32 x 4096 = 524,288 FLOPs per token
    of context in attention, equal at ~30,600 tokens."""

    watermark: float = 1.0
    ratio: float = 0.2
    pass_interval_s: float = 5.0
    chunk_tokens: int = 256
    crossover_tokens: float = 30_600.0

    def __post_init__(self) -> None:
        if not 0.0 < self.watermark <= 1.0:
            raise ValueError("watermark must be in (0, 1]")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError("ratio must be in [0, 1]")
        if self.pass_interval_s <= 0 or self.chunk_tokens < 1 or self.crossover_tokens <= 0:
            raise ValueError("pass_interval_s, chunk_tokens and crossover_tokens must be > 0")


@dataclass(frozen=True, slots=True)
class KeyFacts(Generic[K]):
    """One key of a salt as the directory knows it. ``size_bytes`` is what evicting it frees
    from the salt's usage (every copy the quota counts); ``access_count`` counts its stores and
    accesses; ``position`` is its chunk's index in its token sequence (0 = the first chunk)."""

    key: K
    size_bytes: int
    last_access_s: float
    access_count: int = 1
    position: int = 0
    pinned: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class SaltState(Generic[K]):
    """One salt: its usage, its limit (``None`` = exempt) and its keys' facts as columns, one
    row per key (:meth:`of` builds it from :class:`KeyFacts`; a simulation passes arrays)."""

    cache_salt: str
    usage_bytes: int
    limit_bytes: int | None
    keys: Sequence[K]
    size_bytes: np.ndarray  # int64
    last_access_s: np.ndarray  # float64
    access_count: np.ndarray  # int64
    position: np.ndarray  # int64
    pinned: np.ndarray  # bool

    def __post_init__(self) -> None:
        n = len(self.keys)
        columns = (self.size_bytes, self.last_access_s, self.access_count, self.position,
                   self.pinned)  # fmt: skip
        if any(c.shape != (n,) for c in columns):
            raise ValueError("every column needs one value per key")
        if self.usage_bytes < 0 or (self.limit_bytes is not None and self.limit_bytes < 0):
            raise ValueError("usage and limit must be >= 0")
        if n and (self.size_bytes.min() < 0 or self.access_count.min() < 0
                  or self.position.min() < 0):  # fmt: skip
            raise ValueError("sizes, access counts and positions must be >= 0")
        if n and not np.isfinite(self.last_access_s).all():
            raise ValueError("last access times must be finite")

    @classmethod
    def of(
        cls, cache_salt: str, usage_bytes: int, limit_bytes: int | None,
        facts: Iterable[KeyFacts[K]],
    ) -> SaltState[K]:  # fmt: skip
        rows = list(facts)
        return cls(
            cache_salt,
            usage_bytes,
            limit_bytes,
            [f.key for f in rows],
            np.array([f.size_bytes for f in rows], dtype=np.int64),
            np.array([f.last_access_s for f in rows], dtype=np.float64),
            np.array([f.access_count for f in rows], dtype=np.int64),
            np.array([f.position for f in rows], dtype=np.int64),
            np.array([f.pinned for f in rows], dtype=bool),
        )


@dataclass(frozen=True, slots=True)
class Eviction(Generic[K]):
    """What one pass evicts from one salt: ``keys`` in eviction order (``rows`` are their
    indices in the :class:`SaltState`), the bytes they free, and usage before and after."""

    cache_salt: str
    policy: EvictionPolicy
    keys: tuple[K, ...]
    rows: tuple[int, ...]
    freed_bytes: int
    usage_bytes: int
    limit_bytes: int
    usage_after_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "usage_after_bytes", self.usage_bytes - self.freed_bytes)


def limit_bytes_of(quotas: Quotas, cache_salt: str) -> int | None:
    """The salt's effective limit (its own, else the default) in bytes; ``None`` = exempt."""
    limit = quotas.effective_gb(cache_salt)
    return None if limit is None else int(limit * GB)


def triggered(state: SaltState[K], config: EvictionConfig) -> bool:
    """Whether a pass evicts from the salt: it has a limit, holds something, and its usage is
    at or above ``watermark`` x the limit (any usage when the limit is 0)."""
    limit = state.limit_bytes
    return (
        limit is not None
        and state.usage_bytes > 0
        and (state.usage_bytes >= config.watermark * limit)
    )


def lru_order(state: SaltState[K]) -> np.ndarray:
    """Row indices, least recently used first (ties: the order the keys were given in)."""
    return np.argsort(state.last_access_s, kind="stable")


def value_density(state: SaltState[K], now_s: float, config: EvictionConfig) -> np.ndarray:
    """Expected recompute saved per byte per second by keeping each key (higher = keep)."""
    idle = np.maximum(now_s - state.last_access_s, 0.0) + config.pass_interval_s
    rate = state.access_count / idle
    context = (state.position + 0.5) * config.chunk_tokens
    cost = config.chunk_tokens * (1.0 + context / config.crossover_tokens)  # token-equivalents
    with np.errstate(divide="ignore", invalid="ignore"):
        density = np.where(state.size_bytes > 0, rate * cost / state.size_bytes, np.inf)
    return density


def value_order(state: SaltState[K], now_s: float, config: EvictionConfig) -> np.ndarray:
    """Row indices, lowest value density first (ties in LRU order)."""
    lru_rank = np.empty(len(state.keys), dtype=np.int64)
    lru_rank[lru_order(state)] = np.arange(len(state.keys))
    return np.lexsort((lru_rank, value_density(state, now_s, config)))


def take_count(state: SaltState[K], order: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` unpinned rows of ``order``."""
    unpinned: np.ndarray = order[~state.pinned[order]]
    return unpinned[:count]


def take_until(state: SaltState[K], order: np.ndarray, target_bytes: float) -> np.ndarray:
    """The shortest run of unpinned rows of ``order`` whose eviction brings usage to at most
    ``target_bytes`` (all of them when even that does not)."""
    unpinned: np.ndarray = order[~state.pinned[order]]
    excess = state.usage_bytes - target_bytes
    if excess <= 0:
        return unpinned[:0]
    freed = np.cumsum(state.size_bytes[unpinned])
    enough = int(np.searchsorted(freed, excess, side="left"))
    return unpinned[: enough + 1]


def plan_salt(
    policy: EvictionPolicy, state: SaltState[K], now_s: float,
    config: EvictionConfig = EvictionConfig(),
) -> Eviction[K] | None:  # fmt: skip
    """One salt's eviction for this pass, ``None`` when it evicts nothing."""
    if not triggered(state, config):
        return None
    limit = state.limit_bytes
    assert limit is not None  # triggered() says so
    if limit == 0:
        rows = lru_order(state)
        rows = rows[~state.pinned[rows]]
    elif policy is EvictionPolicy.LRU:
        count = int(len(state.keys) * config.ratio)
        if config.ratio > 0 and count == 0:
            count = 1
        rows = take_count(state, lru_order(state), count)
    else:
        rows = take_until(state, value_order(state, now_s, config), config.watermark * limit)
    if len(rows) == 0:
        return None
    return Eviction(
        cache_salt=state.cache_salt,
        policy=policy,
        keys=tuple(state.keys[int(r)] for r in rows),
        rows=tuple(int(r) for r in rows),
        freed_bytes=int(state.size_bytes[rows].sum()),
        usage_bytes=state.usage_bytes,
        limit_bytes=limit,
    )


def plan(
    policy: EvictionPolicy, salts: Iterable[SaltState[K]], now_s: float,
    config: EvictionConfig = EvictionConfig(),
) -> list[Eviction[K]]:  # fmt: skip
    """One pass over every salt: the evictions to carry out, one per salt that evicts."""
    return [e for s in salts if (e := plan_salt(policy, s, now_s, config)) is not None]
