"""Instance registry: registration, heartbeats, timeouts.

An instance that misses heartbeats for ``instance_timeout`` seconds is fenced (its L1
placements dropped: its process memory is presumed gone) and forgotten, so its next heartbeat
gets 404 and it re-registers. L2 placements stay: their bytes outlive the process. See
docs/coordinator.md ("API": registration, liveness, fencing).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvatlas.errors import Conflict


@dataclass(frozen=True, slots=True)
class Registration:
    """What an instance says about itself when it registers (``POST /instances``)."""

    ip: str = ""
    http_port: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    p2p_advertised_url: str | None = None
    mq_port: int | None = None


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """A registered instance; ``last_heartbeat`` is on the registry's (monotonic) clock,
    ``registration_time`` is wall-clock time; ``cache_salts`` are the salts the registering
    token may store for (``None``: any), i.e. the tenants whose nodes may fetch from this one."""

    instance_id: str
    registration: Registration
    registration_time: float
    last_heartbeat: float
    cache_salts: frozenset[str] | None = None


class InstanceRegistry:
    def __init__(
        self,
        timeout_s: float,
        on_fence: Callable[[str], object],
        clock: Callable[[], float] = time.monotonic,
        max_instances: int | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_instances = max_instances
        self._on_fence = on_fence
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, InstanceRecord] = {}
        self.expired_total = 0

    def register(
        self,
        instance_id: str | None,
        registration: Registration,
        cache_salts: frozenset[str] | None = None,
    ) -> tuple[str, bool]:
        """Returns ``(instance_id, re_registered)``; the coordinator assigns an id if none.
        A new instance beyond ``max_instances`` is refused (:class:`Conflict`, 409)."""
        now = self._clock()
        with self._lock:
            if not instance_id:
                instance_id = f"mp-{uuid.uuid4().hex}"  # LMCache's form
            existing = self._records.get(instance_id)
            cap = self.max_instances
            if existing is None and cap is not None and len(self._records) >= cap:
                raise Conflict(
                    f"{len(self._records)} instances registered (--max-instances): "
                    "deregister one first"
                )
            self._records[instance_id] = InstanceRecord(
                instance_id,
                registration,
                registration_time=time.time(),
                last_heartbeat=now,
                cache_salts=cache_salts,
            )
            return instance_id, existing is not None

    def heartbeat(self, instance_id: str) -> bool:
        with self._lock:
            record = self._records.get(instance_id)
            if record is None:
                return False
            self._records[instance_id] = dataclasses.replace(record, last_heartbeat=self._clock())
            return True

    def deregister(self, instance_id: str) -> bool:
        with self._lock:
            return self._records.pop(instance_id, None) is not None

    def known(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._records

    def expire(self) -> list[str]:
        """Fence and forget every instance whose heartbeats stopped; returns their ids."""
        now = self._clock()
        with self._lock:
            dead = [i for i, r in self._records.items() if now - r.last_heartbeat > self.timeout_s]
            for instance_id in dead:
                del self._records[instance_id]
            self.expired_total += len(dead)
        for instance_id in dead:
            self._on_fence(instance_id)
        return dead

    def snapshot(self) -> tuple[float, list[InstanceRecord]]:
        """The clock now and every registered instance (immutable records)."""
        with self._lock:
            return self._clock(), list(self._records.values())
