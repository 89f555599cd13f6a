"""Which instances some replica of the event stream has registered, and the engine each
serves (docs/coordinator.md, "Replicas").

A node registers with one replica and heartbeats to it alone, while its batches reach every
replica through the stream. So a replica cannot tell from its own registry whether a quiet,
unregistered emitter left the fleet or only registered elsewhere: forgetting it would drop
its cursor and L1 copies from this replica's directory and fail its cache-control commands
for every replica. Nor could it score a node's copies as its engine's (``engine_id``) or count
it as a live peer. Each replica therefore records, every second (on a thread of its own),
the instances registered with it in the Redis hash ``<stream>:instances`` (field: the
instance id; value: the Redis server's time, in seconds, when a replica last saw it
registered, a space, and its ``engine_id`` or nothing); it forgets only an emitter no replica
saw registered within its retention, and scores with the registrations seen within
:data:`FRESH_S`.

The same thread carries **asks for full listings**. A replica that lost events of the stream
(its position was trimmed away, or Redis lost them) repairs its view of its own nodes by digest
exchanges, but the nodes registered with other replicas never exchange with it. So it records
an ask in the Redis hash ``<stream>:listings`` (field: its consumer group; value: the Redis
server's time of the ask and a random tag), and every other replica that sees the ask within
:data:`LISTING_ASK_WINDOW_S` asks each node registered with it to list everything it holds
(heartbeat reply ``list_all: true``). The listings are ``resync`` batches on the stream that
every replica reads: the asking replica replaces its view of each node, bucket by bucket.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from typing import Any, Final

from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.errors import Unavailable
from kvatlas.redis_clients import redis_client

log = logging.getLogger(__name__)

FRESH_S: Final = 5.0
"""A registration recorded this recently (Redis's clock) counts as live for scoring: several
records, so one late record does not drop a peer; a node fenced by its replica stops being
recorded and drops out within this."""
LISTING_ASK_WINDOW_S: Final = 120.0
"""An ask for listings this recent (Redis's clock) is acted on, also by a replica that starts
after it; an older one is history."""


class FleetLiveness:
    """The fleet's registrations as the replicas last reported them, in one Redis hash."""

    def __init__(self, client: Any, stream: str) -> None:
        """``client`` is a ``redis.Redis``; its errors surface as :class:`Unavailable`."""
        import redis

        self._errors = redis.RedisError
        self.client = client
        self.key = f"{stream}:instances"
        self.listings_key = f"{stream}:listings"
        self._ask = False  # this replica's ask, written by the next listing_asks()
        self._acted: dict[bytes, bytes] = {}  # asks acted on: consumer group -> its time
        self.asks_error: str | None = None  # why the last listing_asks() failed

    @classmethod
    def connect(cls, redis_url: str, stream: str) -> FleetLiveness:
        """A liveness record over a new client of ``redis_url`` (connects lazily)."""
        return cls(redis_client(redis_url, socket_timeout=5), stream)

    def close(self) -> None:
        self.client.close()

    def record(self, registered: Iterable[tuple[str, str | None]]) -> None:
        """Record ``registered`` (this replica's instances and the engine each serves) as seen
        now."""
        rows = dict(registered)
        if not rows:
            return
        try:
            sec, usec = self.client.time()
            now = f"{sec + usec / 1e6:.3f}"
            self.client.hset(self.key, mapping={i: f"{now} {e or ''}" for i, e in rows.items()})
        except self._errors as exc:
            raise Unavailable(f"redis {self.key}: {exc}") from exc

    def seen(self, within: float) -> dict[str, str | None]:
        """Every instance some replica saw registered within the last ``within`` seconds
        (Redis's clock: the replicas' own clocks need not agree), with the engine it serves.
        Records older than twice that are removed. Raises :class:`Unavailable` when Redis
        cannot tell."""
        try:
            sec, usec = self.client.time()
            now = sec + usec / 1e6
            rows: dict[bytes, bytes] = self.client.hgetall(self.key)
            alive: dict[str, str | None] = {}
            stale = []
            for field, value in rows.items():
                at, _, engine = value.decode(errors="replace").partition(" ")
                try:
                    age = now - float(at)
                except ValueError:
                    age = float("inf")  # not ours to read: dropped
                if age <= within:
                    alive[field.decode(errors="replace")] = engine or None
                elif age > 2 * within:
                    stale.append(field)
            if stale:
                self.client.hdel(self.key, *stale)
        except self._errors as exc:
            raise Unavailable(f"redis {self.key}: {exc}") from exc
        return alive

    def ask_listings(self) -> None:
        """Ask the nodes registered with the other replicas for full listings: recorded by the
        next :meth:`listing_asks` (again after a failure)."""
        self._ask = True

    def listing_asks(self, group: str) -> tuple[bool, list[str]]:
        """Record this replica's ask if one is pending (``group``: its consumer group); return
        whether it did, and the other replicas' asks not acted on yet, within
        :data:`LISTING_ASK_WINDOW_S`. Raises :class:`Unavailable` when Redis cannot tell."""
        pending, self._ask = self._ask, False
        try:
            sec, usec = self.client.time()
            now = sec + usec / 1e6
            if pending:
                ask = f"{now:.3f} {secrets.token_hex(4)}"  # each ask its own, same ms or not
                self.client.hset(self.listings_key, group, ask)
            rows: dict[bytes, bytes] = self.client.hgetall(self.listings_key)
        except self._errors as exc:
            self._ask = self._ask or pending
            raise Unavailable(f"redis {self.listings_key}: {exc}") from exc
        asked = []
        for field, value in rows.items():
            if field == group.encode() or self._acted.get(field) == value:
                continue
            self._acted[field] = value
            try:
                recent = now - float(value.partition(b" ")[0]) <= LISTING_ASK_WINDOW_S
            except ValueError:
                recent = False  # not ours to read
            if recent:
                asked.append(field.decode(errors="replace"))
        return pending, asked


def share_registrations(
    liveness: FleetLiveness, instances: InstanceRegistry, group: str
) -> dict[str, str | None]:
    """One tick of a replica's registrations thread: the instances registered here, for the
    other replicas (their departure sweeps and scores); this replica's ask for listings, and
    the other replicas' asks for the nodes registered here (``group``: this replica's consumer
    group). Returns the registrations seen within :data:`FRESH_S` (none while Redis cannot
    tell: the next tick tries again)."""
    try:
        liveness.record((r.instance_id, r.registration.engine_id) for r in instances.records())
        seen = liveness.seen(FRESH_S)
    except Unavailable as exc:
        log.debug("registrations not shared: %s", exc)
        return {}
    try:
        recorded, asked = liveness.listing_asks(group)
    except Unavailable as exc:  # e.g. an ACL without <stream>:listings: said once a streak
        if liveness.asks_error is None:
            log.warning("asks for listings not shared (retried every second): %s", exc)
        liveness.asks_error = str(exc)
        return seen
    liveness.asks_error = None
    if recorded:  # a listing is due from each node registered elsewhere
        instances.await_listings(seen)
    for asker in asked:
        n = instances.owe_listings()
        log.warning("replica %s lost events: asking the %d nodes here for listings", asker, n)
    return seen
