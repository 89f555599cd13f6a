"""Instance registry: registration, heartbeats, timeouts, and who still owes a digest exchange.

An instance that misses heartbeats for ``instance_timeout`` seconds is fenced (its L1
placements dropped: its process memory is presumed gone) and forgotten, so its next heartbeat
gets 404 and it re-registers. L2 placements stay: their bytes outlive the process.

The registry is part of the snapshot (:meth:`InstanceRegistry.rows`, :meth:`restore`): after a
restart every instance keeps the time it was last heard of, so one that died while the
coordinator was down is fenced by the first sweep instead of staying a ghost. Every restored or
instance, and every instance registered when a replica learns its stream position was trimmed
(:meth:`owe_all`), *owes a digest exchange* (:meth:`wants_digest`) until it completes one
(:meth:`digest_done`); heartbeat replies carry that hint (a node exchanges digests after each
(re-)registration of its own accord). When another replica lost events of the stream, every
registered instance *owes a full listing* (:meth:`owe_listings`), asked for once in its next
heartbeat reply (:meth:`take_listing`). See docs/coordinator.md ("API": registration,
liveness, fencing; "Resync"; "Stream retention").
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvatlas.directory import InstanceRow
from kvatlas.errors import Conflict

_SALTS = "_cache_salts"
"""The snapshot row's key for the registering token's salts (beside the registration)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """What an instance says about itself when it registers (``POST /instances``)."""

    ip: str = ""
    http_port: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    p2p_advertised_url: str | None = None
    mq_port: int | None = None
    p2p_url_signature: str | None = None
    """The node's proof that it holds the fleet's peer secret, for this id and URL (opaque
    here: nodes check it, ``kvatlas/node/peer_credentials.py``)."""
    engine_id: str | None = None
    """The engine whose KV connector this node is (``kvatlas node --engine-id``): its copies
    are that engine's own when routes are scored (docs/route-scoring.md)."""


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


def attachments(records: Iterable[InstanceRecord]) -> dict[str, str]:
    """Node id → the engine it serves (``engine_id``), for the nodes that name one."""
    return {r.instance_id: r.registration.engine_id for r in records if r.registration.engine_id}


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
        # Held by expire() from forgetting an instance to the end of its fence, and by
        # register(): a re-registration never lands before the fence of the instance it
        # replaces (a late fence would drop what the new registration re-reported).
        self._fencing = threading.Lock()
        self._records: dict[str, InstanceRecord] = {}
        self._owing: set[str] = set()  # instances that owe a digest exchange
        self._since = clock()  # when registrations were first taken (open, heard_all)
        self._listing: set[str] = set()  # instances asked to list everything they hold
        # listings this replica asked the fleet for: due from whom (None: not known yet)
        self._awaited: set[str] | None = set()
        self._carried: set[str] = set()  # restored from the snapshot, not registered since
        self.owe_on_register = False  # a registration owes one too (a replica resyncing)
        self.expired_total = 0

    def register(
        self,
        instance_id: str | None,
        registration: Registration,
        cache_salts: frozenset[str] | None = None,
    ) -> tuple[str, bool]:
        """Returns ``(instance_id, re_registered)``; the coordinator assigns an id if none.
        A new instance beyond ``max_instances`` is refused (:class:`Conflict`, 409), and so
        are an ``engine_id`` that is a registered node's id and an id that a registered node
        names as its engine (node ids and engine ids are separate namespaces)."""
        engine = registration.engine_id
        with self._fencing, self._lock:
            now = self._clock()
            if not instance_id:
                instance_id = f"mp-{uuid.uuid4().hex}"  # LMCache's form
            if engine is not None and engine in self._records:
                raise Conflict(
                    f"engine_id {engine!r} is a registered node's id: a node serves an engine"
                )
            for r in self._records.values():
                if r.registration.engine_id == instance_id:
                    raise Conflict(
                        f"{instance_id!r} is the engine node {r.instance_id!r} serves "
                        "(its engine_id): nodes use other ids"
                    )
            existing = self._records.get(instance_id)
            cap = self.max_instances
            if existing is None and cap is not None and len(self._records) >= cap:
                raise Conflict(
                    f"{len(self._records)} instances registered (--max-instances): "
                    "deregister one first"
                )
            self._carried.discard(instance_id)
            self._records[instance_id] = InstanceRecord(
                instance_id,
                registration,
                registration_time=time.time(),
                last_heartbeat=now,
                cache_salts=cache_salts,
            )
            if self.owe_on_register:
                self._owing.add(instance_id)
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
            self._owing.discard(instance_id)
            self._listing.discard(instance_id)
            return self._records.pop(instance_id, None) is not None

    def known(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._records

    def may_hold(self, instance_id: str, cache_salt: str) -> bool:
        """Whether the token that registered ``instance_id`` may store under ``cache_salt``
        (an instance not registered here, with another replica: not known, so yes)."""
        with self._lock:
            r = self._records.get(instance_id)
        return r is None or r.cache_salts is None or cache_salt in r.cache_salts

    def carried_over(self, instance_id: str) -> bool:
        """Restored from the snapshot and not registered since: its node kept running
        through this coordinator's restart (a node registers whenever it starts)."""
        with self._lock:
            return instance_id in self._carried

    def expire(self) -> list[str]:
        """Fence and forget every instance whose heartbeats stopped; returns their ids. A
        registration of one of them waits until its fence is done."""
        with self._fencing:
            now = self._clock()
            with self._lock:
                dead = [
                    i for i, r in self._records.items() if now - r.last_heartbeat > self.timeout_s
                ]
                for instance_id in dead:
                    del self._records[instance_id]
                    self._owing.discard(instance_id)
                    self._listing.discard(instance_id)
                self.expired_total += len(dead)
            for instance_id in dead:
                self._on_fence(instance_id)
        return dead

    def snapshot(self) -> tuple[float, list[InstanceRecord]]:
        """The clock now and every registered instance (immutable records)."""
        with self._lock:
            return self._clock(), list(self._records.values())

    def records(self) -> list[InstanceRecord]:
        """Every registered instance (immutable records)."""
        with self._lock:
            return list(self._records.values())

    # ------------------------------------------------------------------ digest exchanges

    def wants_digest(self, instance_id: str) -> bool:
        """Whether the instance owes a digest exchange (restored, or (re-)registered since)."""
        with self._lock:
            return instance_id in self._owing

    def owe_all(self) -> None:
        """Every registered instance owes a digest exchange from now on."""
        with self._lock:
            self._owing = set(self._records)

    def digest_done(self, instance_id: str) -> None:
        with self._lock:
            self._owing.discard(instance_id)
            if self._awaited:
                self._awaited.discard(instance_id)

    def expect_listings(self) -> None:
        """This replica asked the fleet for listings; :meth:`await_listings` says from whom."""
        with self._lock:
            self._awaited = None

    def await_listings(self, fleet: Iterable[str]) -> None:
        """The ask is recorded: a listing is due from each of ``fleet`` registered elsewhere
        (its ``resync`` batch, :meth:`digest_done`)."""
        with self._lock:
            self._awaited = set(fleet) - set(self._records)

    def listings_due(self) -> bool:
        """Whether listings this replica asked the fleet for are still due."""
        with self._lock:
            return self._awaited is None or bool(self._awaited)

    def stop_awaiting(self) -> None:
        with self._lock:
            self._awaited = set()

    def owe_listings(self) -> int:
        """Every registered instance owes a full listing (another replica lost events);
        returns how many."""
        with self._lock:
            self._listing = set(self._records)
            return len(self._listing)

    def take_listing(self, instance_id: str) -> bool:
        """Whether the instance owes a full listing; it is asked for once (the node lists
        again after a failure of its own)."""
        with self._lock:
            if instance_id not in self._listing:
                return False
            self._listing.discard(instance_id)
            return True

    def owing(self) -> set[str]:
        """Registered instances that still owe a digest exchange."""
        with self._lock:
            return set(self._owing)

    # ------------------------------------------------------------------ snapshot

    def rows(self) -> list[InstanceRow]:
        """Every registered instance as a snapshot row: ``(instance_id, registration_time,
        last heard of (wall clock), registration and the registering token's salts as
        JSON)``."""
        now, wall = self._clock(), time.time()
        with self._lock:
            records = list(self._records.values())
        return [
            (
                r.instance_id,
                r.registration_time,
                wall - (now - r.last_heartbeat),
                json.dumps(
                    {
                        **dataclasses.asdict(r.registration),
                        _SALTS: None if r.cache_salts is None else sorted(r.cache_salts),
                    }
                ).encode(),
            )
            for r in records
        ]

    def open(self) -> None:
        """Registrations are taken from now (the service has started: restored, warmed up):
        :meth:`heard_all` counts from here."""
        self._since = self._clock()

    def heard_all(self) -> bool:
        """Whether every instance alive now has had a whole timeout to register since this
        registry was opened (:meth:`open`; else made): one not registered by then is gone.
        Before, one may be alive and not heard yet (a coordinator restarted without a
        snapshot, or with one older than a registration, starts without them)."""
        return self._clock() - self._since >= self.timeout_s

    def restore(self, rows: list[InstanceRow]) -> None:
        """Adopt a snapshot's rows. Each instance has a whole timeout from now to be heard
        from (the downtime is not its silence: its heartbeats could not reach a coordinator
        that was down), then :meth:`expire` fences it. Every restored instance owes a
        digest exchange."""
        now = self._clock()
        records = {}
        for instance_id, registration_time, _last_heard, blob in rows:
            salts: frozenset[str] | None = frozenset()  # unreadable: bound to no tenant
            try:
                fields = json.loads(blob)
                raw = fields.pop(_SALTS, None)
                salts = None if raw is None else frozenset(raw)
                registration = Registration(**fields)
            except (ValueError, TypeError, AttributeError):
                registration = Registration()
            records[instance_id] = InstanceRecord(
                instance_id, registration, registration_time, now, salts
            )
        with self._lock:
            self._records = records
            self._carried = set(records)
            self._owing = set(records)
