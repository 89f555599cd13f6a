"""Per-emitter bookkeeping beside the directory's cursors: when each emitter last sent a batch,
how its batches arrive (LMCache 0.5.7's delivery delay and dropped events), the gap count at
its last digest exchange, and which departed emitters to forget. In memory only: it restarts
at zero with the process. Also the emitter and instance views built from it
(``GET /instances``; docs/coordinator.md, "API" and "Security").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvatlas.api.fleet import PEER_METADATA
from kvatlas.auth import Principal
from kvatlas.coordinator.instances import InstanceRecord, Registration
from kvatlas.coordinator.views import NO_EMITTER, EmitterView, InstanceView
from kvatlas.directory import EmitterCursor
from kvatlas.errors import Conflict, Forbidden, Unprocessable
from kvatlas.events import EventBatch


@dataclass(slots=True)
class Delivery:
    """How one emitter's applied batches arrive."""

    last_event: float  # the service clock when its last batch was applied
    delay_s: float | None = None  # wall clock at apply minus the batch's ts
    events_dropped: int = 0


class EmitterBook:
    """Thread-safe; times are on the service clock (``tick``) unless named wall clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_emit: dict[str, float] = {}  # its retention clock: last batch, or since known
        self._last_batch: dict[str, float] = {}  # clock of its last batch (any outcome)
        self._delivery: dict[str, Delivery] = {}  # of applied batches
        self._gaps_seen: dict[str, int] = {}  # gap count at its last digest exchange

    def received(self, batches: Sequence[EventBatch], tick: float) -> None:
        with self._lock:
            for batch in batches:
                self._last_emit[batch.instance_id] = tick
                self._last_batch[batch.instance_id] = tick

    def applied(self, batch: EventBatch, now: float, tick: float) -> None:
        """``batch`` was applied at wall clock ``now``."""
        with self._lock:
            d = self._delivery.get(batch.instance_id)
            if d is None:
                d = self._delivery[batch.instance_id] = Delivery(tick)
            d.last_event = tick
            if batch.ts > 0:
                d.delay_s = max(0.0, now - batch.ts)
            d.events_dropped += batch.dropped_events

    def deregistered(self, instance_id: str, known: bool, tick: float) -> None:
        """A known instance's series expire with the departed (:meth:`departed`)."""
        with self._lock:
            self._delivery.pop(instance_id, None)
            self._gaps_seen.pop(instance_id, None)
            if known:
                self._last_emit.setdefault(instance_id, tick)

    def departed(
        self, emitters: Iterable[str], registered: set[str], tick: float, retention: float
    ) -> list[str]:
        """Forget and return the emitters that are not registered and sent nothing for
        ``retention`` seconds (``emitters``: those the directory tracks, e.g. restored)."""
        with self._lock:
            for instance_id in emitters:
                self._last_emit.setdefault(instance_id, tick)
            gone = [
                i
                for i, seen in self._last_emit.items()
                if i not in registered and tick - seen > retention
            ]
            for instance_id in gone:
                del self._last_emit[instance_id]
                self._last_batch.pop(instance_id, None)
                self._delivery.pop(instance_id, None)
                self._gaps_seen.pop(instance_id, None)
        return gone

    def ages(self, tick: float) -> dict[str, float]:
        """Seconds since each emitter's last batch received by this process: none for an
        emitter restored from a snapshot or known only by its registration (their retention
        clocks start when this process first sees them, which is no batch's time)."""
        with self._lock:
            return {inst: tick - seen for inst, seen in self._last_batch.items()}

    def deliveries(self) -> dict[str, tuple[float, float | None, int]]:
        """``(last_event, delay_s, events_dropped)`` per emitter with an applied batch."""
        with self._lock:
            return {
                i: (d.last_event, d.delay_s, d.events_dropped) for i, d in self._delivery.items()
            }

    def gaps_seen(self, instance_id: str) -> int:
        with self._lock:
            return self._gaps_seen.get(instance_id, 0)

    def exchanged(self, instance_id: str, gaps: int) -> None:
        """A digest exchange repairs the gaps up to ``gaps``."""
        with self._lock:
            self._gaps_seen[instance_id] = gaps


def admit(new: set[str], tracked: int, registered: Callable[[str], bool] | None, cap: int) -> None:
    """Admit emitters the directory does not track yet: with auth on (``registered`` given)
    only registered instances (:class:`Forbidden`; a sink retries after it registered), and
    at most ``cap`` emitters in all (:class:`Conflict`). Known emitters never come here: their
    cursor exists already, so nothing grows (and a replay after a restart is not refused)."""
    if registered is not None:
        for instance_id in sorted(new):
            if not registered(instance_id):
                raise Forbidden(
                    f"instance {instance_id!r} is not registered: register "
                    "(POST /instances) before emitting"
                )
    if tracked + len(new) > cap:
        raise Conflict(
            f"{tracked} emitters tracked; {len(new)} more would exceed --max-instances {cap}"
        )


class IncarnationAhead(Unprocessable):
    """A batch whose incarnation no restart of its emitter can reach yet."""


def check_incarnations(batches: Sequence[EventBatch], ceiling: int) -> None:
    """Refuse (:class:`IncarnationAhead`, naming the batch) an incarnation above ``ceiling``:
    the coordinator's clock in ns plus ``--max-clock-skew-s``. An incarnation is a start time
    in ns or a boot counter (docs/directory.md), never later than the emitter's own clock;
    one beyond it would fence the emitter's real incarnation and leave every later batch of
    it stale — a lock-out until deregistration, for 2^63-1. One bound for every transport."""
    for i, batch in enumerate(batches):
        if batch.incarnation > ceiling:
            ahead_s = (batch.incarnation - ceiling) / 1e9
            raise IncarnationAhead(
                f"instance {batch.instance_id!r}: incarnation {batch.incarnation} lies "
                f"{ahead_s:.3g} s beyond this coordinator's clock + --max-clock-skew-s (an "
                "incarnation is the emitter's start time in ns, or a boot counter)",
                field=f"batches[{i}].incarnation",
            )


def emitter_views(
    cursors: Mapping[str, EmitterCursor],
    deliveries: Mapping[str, tuple[float, float | None, int]],
    tick: float,
) -> dict[str, EmitterView]:
    """Each emitter's cursor beside how its batches arrive (see :meth:`EmitterBook.deliveries`)."""
    views = {}
    for inst, cursor in cursors.items():
        last, delay, dropped = deliveries.get(inst, (None, None, 0))
        views[inst] = EmitterView(
            cursor.incarnation,
            cursor.last_seq,
            cursor.gaps,
            cursor.missing_batches,
            dropped,
            None if last is None else round(max(0.0, tick - last), 3),
            delay,
        )
    return views


def instance_views(
    records: Sequence[InstanceRecord],
    now: float,
    emitters: Callable[[], dict[str, EmitterView]],
    who: Principal,
) -> list[InstanceView]:
    """Registered instances and emitters without registration, by instance id. A token bound
    to cache salts sees only its own instances in full and, of the others, those registered
    for one of its salts with just what a peer needs (id, liveness, ``p2p_advertised_url`` and
    its signature, the :data:`~kvatlas.api.fleet.PEER_METADATA` of its metadata): no other
    metadata, addresses or cursors."""
    rows: list[InstanceView] = []
    if who.sees_everything:
        found = emitters()
        for r in records:
            emitter = found.pop(r.instance_id, NO_EMITTER)
            age = round(now - r.last_heartbeat, 3)
            rows.append(
                InstanceView(r.instance_id, r.registration, r.registration_time, age, emitter)
            )
        rows += [InstanceView(inst, None, None, None, e) for inst, e in found.items()]
    else:
        own = who.instance_ids or frozenset()
        salts = who.cache_salts or frozenset()
        found = emitters() if own else {}
        for r in records:
            age = round(now - r.last_heartbeat, 3)
            if r.instance_id in own:
                emitter = found.get(r.instance_id, NO_EMITTER)
                rows.append(
                    InstanceView(r.instance_id, r.registration, r.registration_time, age, emitter)
                )
            elif r.cache_salts is None or not r.cache_salts.isdisjoint(salts):
                meta = r.registration.metadata
                peer = Registration(
                    p2p_advertised_url=r.registration.p2p_advertised_url,
                    p2p_url_signature=r.registration.p2p_url_signature,
                    metadata={k: meta[k] for k in PEER_METADATA if k in meta},
                )
                rows.append(InstanceView(r.instance_id, peer, r.registration_time, age, NO_EMITTER))
    rows.sort(key=lambda r: r.instance_id)
    return rows
