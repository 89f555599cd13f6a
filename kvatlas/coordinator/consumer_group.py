"""One live consumer per group: a replica's consumer shows itself to Redis
``stream_consumer.TOUCHES_PER_HEARTBEAT`` times per ``--consumer-heartbeat-s``, and a replica refuses to join a
group whose consumer is seen again while it watches (:func:`ensure_group_free`, at start-up
and again just before joining). A consumer idle past the heartbeat is a crashed replica's: it
is removed on joining. A clean stop removes its own consumer (the group's position, not the
consumer, carries the progress), so a restart never waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.errors import Conflict, Unavailable
from kvatlas.redis_clients import redis_client

log = logging.getLogger(__name__)

_CLOCK_SLACK_MS = 5
"""Rounding between Redis's clock and its idle times (both in ms): a consumer whose last-seen
time moved by more than this was seen again."""


class GroupHeld(Conflict):
    """Another live replica consumes the group this replica would join."""


def group_consumers(client: Any, stream: str, group: str) -> list[tuple[str, int]]:
    """``(name, idle ms)`` of each consumer of ``group`` (none when group or stream is new)."""
    return _observe(client, stream, group)[2]


def _observe(client: Any, stream: str, group: str) -> tuple[int, int, list[tuple[str, int]]]:
    """Redis's clock (ms), its uptime (ms) and each consumer's ``(name, idle ms)``, read in
    one transaction so that ``clock - idle`` is the time Redis last saw the consumer."""
    import redis

    pipe = client.pipeline(transaction=True)
    pipe.time()
    pipe.info("server")
    pipe.xinfo_consumers(stream, group)
    try:
        (seconds, micros), server, rows = pipe.execute()
    except redis.ResponseError as exc:
        if "NOGROUP" in str(exc) or "no such key" in str(exc):
            return 0, 0, []
        raise
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    up_ms = int(server.get("uptime_in_seconds", 0)) * 1000
    return now_ms, up_ms, [(text_of(row["name"]), int(row["idle"])) for row in rows]


def text_of(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ensure_group_free(
    client: Any,
    stream: str,
    group: str,
    heartbeat_s: float,
    *,
    own: str | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> None:
    """Return once no consumer of ``group`` but ``own`` is live; :class:`GroupHeld`, naming
    the group and the consumer, when one is.

    A consumer idle past ``heartbeat_s`` is dead. One seen within it is watched (a poll every
    tenth of the heartbeat): seen again, it is live (a replica shows itself several times per
    heartbeat); idle past the heartbeat without being seen, it was a crashed replica, whose
    successor may take the group over — at most one heartbeat after the crash. Right after a
    Redis restart every consumer looks idle for the whole outage (a live replica could not show
    itself meanwhile): until Redis has been up for one heartbeat, all of them are watched."""
    limit_ms = heartbeat_s * 1000
    first_seen: dict[str, int] = {}
    while True:
        now_ms, up_ms, rows = _observe(client, stream, group)
        fresh = up_ms < limit_ms
        recent = {
            name: now_ms - idle for name, idle in rows if name != own and (fresh or idle < limit_ms)
        }
        if not recent:
            return
        if recent.keys() - first_seen.keys():
            log.info(
                "consumer(s) %s of group %s seen within the heartbeat: watching whether they "
                "are alive (up to %g s)", ", ".join(sorted(recent)), group, heartbeat_s,
            )  # fmt: skip
        for name, seen_ms in recent.items():
            if seen_ms > first_seen.setdefault(name, seen_ms) + _CLOCK_SLACK_MS:
                raise GroupHeld(
                    f"consumer group {group!r} on stream {stream!r} is held by live consumer "
                    f"{name!r} (it keeps reading, within --consumer-heartbeat-s {heartbeat_s:g} "
                    "s): another replica with this replica id is running; give each replica "
                    "its own --replica-id",
                    group=group,
                    consumer=name,
                )
        sleep(heartbeat_s / 10)


def refuse_held_group(config: CoordinatorConfig) -> None:
    """The start-up check, before restoring or consuming: :class:`GroupHeld` when another
    live replica consumes ``config.group_name``; :class:`Unavailable` when Redis answers but
    cannot tell or refuses the credentials. Redis not reachable (down, restarting, loading its
    data) is no reason to refuse: the replica starts, serves its snapshot and makes the same
    check when Redis appears (:meth:`StreamConsumer.run`)."""
    import redis

    client = redis_client(config.redis_url or "", socket_timeout=5)
    try:
        ensure_group_free(
            client, config.event_stream, config.group_name, config.consumer_heartbeat_s
        )
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
        raise Unavailable(f"redis refused this coordinator's credentials: {exc}") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # down, restarting, loading
        log.warning(
            "redis not reachable (%s): starting anyway; consumer group %s is checked and joined "
            "when redis appears", exc, config.group_name,
        )  # fmt: skip
    except redis.RedisError as exc:
        raise Unavailable(
            f"cannot check that consumer group {config.group_name!r} is free: redis: {exc}"
        ) from exc
    finally:
        client.close()
