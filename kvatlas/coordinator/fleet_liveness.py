"""Which instances some replica of the event stream has registered (docs/coordinator.md,
"Replicas").

A node registers with one replica and heartbeats to it alone, while its batches reach every
replica through the stream. So a replica cannot tell from its own registry whether a quiet,
unregistered emitter left the fleet or only registered elsewhere: forgetting it would drop
its cursor and L1 copies from this replica's directory and fail its cache-control commands
for every replica. Each replica therefore records, at each departure sweep, the instances
registered with it in the Redis hash ``<stream>:instances`` (field: the instance id; value:
the Redis server's time, in seconds, when a replica last saw it registered) at every tick of
its sweeper (at most a second apart), and forgets only an emitter no replica saw registered
within its retention.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvatlas.errors import Unavailable
from kvatlas.redis_clients import redis_client


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

    def record(self, registered: Iterable[str]) -> None:
        """Record ``registered`` (this replica's instances) as seen now (every sweeper tick:
        how fresh the record is must not depend on this replica's own retention, which
        another replica's may differ from)."""
        ids = sorted(registered)
        if not ids:
            return
        try:
            sec, usec = self.client.time()
            self.client.hset(self.key, mapping=dict.fromkeys(ids, f"{sec + usec / 1e6:.3f}"))
        except self._errors as exc:
            raise Unavailable(f"redis {self.key}: {exc}") from exc

    def close(self) -> None:
        self.client.close()

    def exchange(self, registered: Iterable[str], within: float) -> set[str]:
        """Record ``registered`` (this replica's instances) as seen now, and return every
        instance some replica saw registered within the last ``within`` seconds (Redis's
        clock: the replicas' own clocks need not agree). Records older than twice that are
        removed. Raises :class:`Unavailable` when Redis cannot tell."""
        ids = sorted(registered)
        try:
            sec, usec = self.client.time()
            now = sec + usec / 1e6
            pipe = self.client.pipeline(transaction=False)
            if ids:
                pipe.hset(self.key, mapping=dict.fromkeys(ids, f"{now:.3f}"))
            pipe.hgetall(self.key)
            seen: dict[bytes, bytes] = pipe.execute()[-1]
            alive, stale = set(), []
            for field, value in seen.items():
                try:
                    age = now - float(value)
                except ValueError:
                    age = float("inf")  # not ours to read: dropped
                if age <= within:
                    alive.add(field.decode())
                elif age > 2 * within:
                    stale.append(field)
            if stale:
                self.client.hdel(self.key, *stale)
        except self._errors as exc:
            raise Unavailable(f"redis {self.key}: {exc}") from exc
        return alive
