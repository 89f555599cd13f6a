"""Fleet eviction carried out: every :attr:`EvictionConfig.pass_interval_s` the delivery loop
runs one pass (:meth:`FleetEviction.run_once`) that reads each salt's L2 usage from the
directory, gathers the facts of the keys of the salts at or over ``watermark`` x their limit,
runs the planner (:mod:`.eviction`) with the configured policy and records one durable
``evict`` command per instance holding copies of the chosen keys (a private L2's owner; a
shared pool's copy through the instance that reported it, or one live member of the pool
while that one is down: the delivery loop's rule for deletes, which it delivers and
finishes them by).

- A pinned key is never chosen (the planner skips it) and never sent: delivery drops keys
  pinned since the pass (:meth:`Delivery.deliver`). A salt without a limit is exempt.
- Keys of ``evict`` commands not yet finished are counted as gone (their bytes leave the
  salt's usage and they are not chosen again), so a slow node does not make every pass evict
  another fifth of the salt.
- The directory keeps no access count per key, only each copy's newest access: every key
  counts one access, so the ``value`` policy ranks by idle time, recompute cost and bytes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from kvatlas.coordinator.cache_control.commands import Command, object_key
from kvatlas.coordinator.cache_control.eviction import (
    EvictionConfig,
    EvictionPolicy,
    KeyFacts,
    SaltState,
    limit_bytes_of,
    plan,
)
from kvatlas.coordinator.cache_control.service import CacheControl, wire_key
from kvatlas.directory.salt_usage import Holder, SaltKey
from kvatlas.keys import ObjectKey

log = logging.getLogger(__name__)
TIER = "l2"
"""The tier quotas count and evictions remove (LMCache's quotas are L2 quotas)."""


class SaltKeys(Protocol):
    """What a pass reads of the directory (``KeyDirectory`` answers it)."""

    def bytes_by_salt(self, tier: str = "l2") -> dict[str, int]: ...

    def keys_of_salts(
        self, salts: Collection[str], tier: str = "l2"
    ) -> Mapping[str, list[SaltKey]]: ...


class FleetEviction:
    """The eviction passes of one coordinator, and what they did (for the metrics)."""

    def __init__(
        self,
        control: Callable[[], CacheControl],
        directory: SaltKeys,
        policy: EvictionPolicy,
        config: EvictionConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._control = control  # replaced when a snapshot is restored
        self.directory = directory
        self.policy = policy
        self.config = config or EvictionConfig()
        self._clock = clock
        self._last_pass = -math.inf
        self._lock = threading.Lock()
        self._evicted: Counter[tuple[str, str]] = Counter()
        self._usage: dict[str, int] = {}

    def maybe_run(self) -> list[Command]:
        """A pass if :attr:`EvictionConfig.pass_interval_s` has gone by since the last one."""
        now = self._clock()
        if now - self._last_pass < self.config.pass_interval_s:
            return []
        self._last_pass = now
        return self.run_once()

    def run_once(self) -> list[Command]:
        """One pass: the ``evict`` commands it recorded."""
        control = self._control()
        usage = self.directory.bytes_by_salt(TIER)
        with self._lock:
            self._usage = dict(usage)
        quotas, w = control.quotas, self.config.watermark
        over = sorted(s for s, used in usage.items() if quotas.over_limit(s, used, w))
        if not over:
            return []
        in_flight = {
            object_key(k)
            for c in control.commands.unfinished()
            if c.kind == "evict"
            for k in c.keys
        }
        found = self.directory.keys_of_salts(over, TIER)
        states: list[SaltState[ObjectKey]] = []
        holders: dict[ObjectKey, tuple[Holder, ...]] = {}
        for salt in over:
            keys = found.get(salt, [])
            gone = sum(k.size_bytes for k in keys if k.key in in_flight)
            keys = [k for k in keys if k.key not in in_flight]
            pinned = control.pins.pinned(k.key for k in keys)
            facts = [
                KeyFacts(k.key, k.size_bytes, k.last_access, 1, k.position, k.key in pinned)
                for k in keys
            ]
            holders.update({k.key: k.holders for k in keys})
            limit = limit_bytes_of(quotas, salt)
            states.append(SaltState.of(salt, max(usage[salt] - gone, 0), limit, facts))
        recorded: list[Command] = []
        for eviction in plan(self.policy, states, self._clock(), self.config):
            by_target: dict[str, list[ObjectKey]] = {}
            for key in eviction.keys:
                for target in dict.fromkeys(h.instance_id for h in holders[key]):
                    by_target.setdefault(target, []).append(key)
            for target, chosen in sorted(by_target.items()):
                wire = [wire_key(k) for k in chosen]
                recorded.append(control.commands.new("evict", [target], wire, tier=TIER))
            with self._lock:
                self._evicted[(eviction.cache_salt, eviction.policy.value)] += eviction.freed_bytes
            log.info(
                "fleet eviction (%s): salt %r at %d of %d bytes: %d keys, %d bytes",
                eviction.policy.value, eviction.cache_salt, eviction.usage_bytes,
                eviction.limit_bytes, len(eviction.keys), eviction.freed_bytes,
            )  # fmt: skip
        return recorded

    def evicted_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes each salt's evictions were planned to free, by (salt, policy), since start."""
        with self._lock:
            return dict(self._evicted)

    def usage(self) -> dict[str, int]:
        """Each salt's L2 bytes at the last pass."""
        with self._lock:
            return dict(self._usage)
