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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from kvatlas.errors import Unavailable
from kvatlas.redis_clients import redis_client

FRESH_S: Final = 5.0
"""A registration recorded this recently (Redis's clock) counts as live for scoring: several
records, so one late record does not drop a peer; a node fenced by its replica stops being
recorded and drops out within this."""


class FleetLiveness:
    """The fleet's registrations as the replicas last reported them, in one Redis hash."""

    def __init__(self, client: Any, stream: str) -> None:
        """``client`` is a ``redis.Redis``; its errors surface as :class:`Unavailable`."""
        import redis

        self._errors = redis.RedisError
        self.client = client
        self.key = f"{stream}:instances"

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
