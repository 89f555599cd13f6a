"""The ``redis`` L2: chunks as values in a Redis server, a fleet-wide pool whose losses
(TTL, ``maxmemory`` evictions, restarts) are watched for the keys this node wrote (see
:class:`RedisL2`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Final

from kvatlas.keys import ObjectKey
from kvatlas.node.l2.backend import (
    EVICTED,
    EXPIRED,
    VANISHED,
    FoundCallback,
    L2Unavailable,
    LostCallback,
    decode_for,
    key_digest,
)
from kvatlas.node.stored_chunk import StoredChunk, encode_chunk

log = logging.getLogger(__name__)

_MGET_BATCH: Final = 64  # bounds one reply's size: values are MB-sized chunks


class RedisL2:
    """Chunks as binary values in Redis: the fleet-wide shared pool (``shared=True``).

    Values are the encoded chunks under ``prefix + key_digest(key)``; reads batch with MGET.
    Memory is bounded by the server (``maxmemory`` + an LRU policy), or per value by
    ``ttl_seconds``. Short socket timeouts and a single immediate retry: a dead Redis must
    cost a lookup milliseconds, and the one retry transparently replaces a connection that a
    Redis restart killed. A corrupt value is a miss but is left in place (another node may be
    overwriting it right now; deleting could drop the good copy).

    After :meth:`attach`, the keys *this node* wrote are watched: expirations and evictions
    arrive as keyspace notifications when the server has them on (``notify-keyspace-events``
    with ``E`` and ``x``/``e`` or ``A``; read once, never changed), and a sweep checks that the
    node's own keys still exist every ``sweep_interval`` seconds in any case (pub/sub is
    at-most-once, and a Redis restart drops keys silently). Each loss goes to ``on_lost``.
    """

    shared = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvatlas:kv:",
        name: str = "redis",
        ttl_seconds: int | None = None,
        sweep_interval: float = 30.0,
        socket_timeout: float = 2.0,
        connect_timeout: float = 0.5,
    ) -> None:
        import redis  # optional dependency (the ``redis`` extra)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.prefix = prefix
        self.name = name
        self.ttl_seconds = ttl_seconds or None
        self.sweep_interval = sweep_interval
        self.notifications = False
        """Whether the server's keyspace notifications are used (known after :meth:`attach`)."""
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self._redis: Any = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 1),
        )
        self._own: dict[str, ObjectKey] = {}  # redis key -> key, for what this node wrote
        self._own_lock = threading.Lock()
        self._on_lost: LostCallback | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._causes: dict[str, str] = {}

    @property
    def client(self) -> Any:
        """The Redis client (the pool journal keeps its list beside the values)."""
        return self._redis

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """What a failed call of :attr:`client` raises."""
        return self._errors

    def redis_key(self, key: ObjectKey) -> str:
        return self.prefix + key_digest(key)

    def put(self, chunk: StoredChunk) -> None:
        name = self.redis_key(chunk.key)
        try:
            self._redis.set(name, encode_chunk(chunk), ex=self.ttl_seconds)
        except self._errors as exc:
            raise L2Unavailable(f"redis L2 write failed: {exc}") from exc
        with self._own_lock:
            self._own[name] = chunk.key

    def get(self, key: ObjectKey) -> StoredChunk | None:
        try:
            data = self._redis.get(self.redis_key(key))
        except self._errors as exc:
            log.warning("redis L2 read failed (miss): %s", exc)
            return None
        return None if data is None else decode_for(key, data, "redis")

    def get_many(self, keys: Iterable[ObjectKey]) -> dict[ObjectKey, StoredChunk]:
        wanted = list(dict.fromkeys(keys))
        found: dict[ObjectKey, StoredChunk] = {}
        for i in range(0, len(wanted), _MGET_BATCH):
            batch = wanted[i : i + _MGET_BATCH]
            try:
                values = self._redis.mget([self.redis_key(k) for k in batch])
            except self._errors as exc:
                log.warning("redis L2 read failed (miss): %s", exc)
                return found
            for key, data in zip(batch, values, strict=True):
                chunk = None if data is None else decode_for(key, data, "redis")
                if chunk is not None:
                    found[key] = chunk
        return found

    def delete(self, key: ObjectKey) -> bool:
        name = self.redis_key(key)
        with self._own_lock:
            self._own.pop(name, None)
        try:
            return bool(self._redis.delete(name))
        except self._errors as exc:
            raise L2Unavailable(f"redis L2 delete failed: {exc}") from exc

    def contains(self, key: ObjectKey) -> bool:
        try:
            return bool(self._redis.exists(self.redis_key(key)))
        except self._errors:
            return False

    def attach(self, on_found: FoundCallback, on_lost: LostCallback) -> None:
        """Watch this node's keys (class docstring). A shared pool reports nothing found:
        what it held before this process belongs to whoever wrote it."""
        self._on_lost = on_lost
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name="kvatlas-redis-l2-watch", daemon=True
            )
            self._watcher.start()

    def sweep(self) -> int:
        """Check that every key this node wrote still exists; report the missing ones as
        :data:`VANISHED`. Returns how many were missing (0 when Redis is unreachable)."""
        with self._own_lock:
            names = list(self._own)
        missing: list[str] = []
        for i in range(0, len(names), 256):
            batch = names[i : i + 256]
            pipe = self._redis.pipeline(transaction=False)
            for name in batch:
                pipe.exists(name)
            try:
                exists = pipe.execute()
            except self._errors as exc:
                log.debug("redis L2 sweep failed: %s", exc)
                return 0
            missing += [n for n, e in zip(batch, exists, strict=True) if not e]
        for name in missing:
            self._lost(name, VANISHED)
        return len(missing)

    def _lost(self, name: str, cause: str) -> None:
        with self._own_lock:
            key = self._own.pop(name, None)
        if key is not None and self._on_lost is not None:
            self._on_lost(key, cause)

    def _channels(self) -> dict[str, str]:
        """The keyevent channels to subscribe to (channel -> cause), or none when the server
        does not publish expirations and evictions (or refuses ``CONFIG GET``)."""
        try:
            flags = str(
                self._redis.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            )
        except self._errors as exc:
            log.info("redis L2: CONFIG GET refused (%s); sweeping for lost keys", exc)
            return {}
        db = int(self._redis.connection_pool.connection_kwargs.get("db", 0))
        if "E" not in flags:
            return {}
        events = {"expired": ("x", EXPIRED), "evicted": ("e", EVICTED)}
        return {
            f"__keyevent@{db}__:{event}": cause
            for event, (flag, cause) in events.items()
            if flag in flags or "A" in flags
        }

    def _watch(self) -> None:
        """Listen to keyspace notifications (if any) and sweep every ``sweep_interval``."""
        pubsub: Any = None
        next_sweep = time.monotonic() + self.sweep_interval
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    channels = self._channels()
                    self.notifications = bool(channels)
                    if channels:
                        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(*channels)
                        self._causes = channels
                        self.sweep()  # what was lost while not subscribed
                if pubsub is not None:
                    message = pubsub.get_message(timeout=min(0.5, self.sweep_interval))
                    if message is not None and message.get("type") == "message":
                        self._on_message(message)
                else:
                    self._stop.wait(min(0.5, self.sweep_interval))
            except self._errors as exc:
                log.debug("redis L2 watch: %s", exc)
                if pubsub is not None:
                    with contextlib.suppress(*self._errors):
                        pubsub.close()
                pubsub = None
                self._stop.wait(min(1.0, self.sweep_interval))
            if time.monotonic() >= next_sweep:
                self.sweep()
                next_sweep = time.monotonic() + self.sweep_interval
        if pubsub is not None:
            with contextlib.suppress(*self._errors):
                pubsub.close()

    def _on_message(self, message: dict[str, Any]) -> None:
        channel, data = message.get("channel"), message.get("data")
        if isinstance(channel, bytes):
            channel = channel.decode()
        if isinstance(data, bytes):
            data = data.decode(errors="replace")
        cause = self._causes.get(str(channel))
        if cause is not None and isinstance(data, str) and data.startswith(self.prefix):
            self._lost(data, cause)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with contextlib.suppress(*self._errors):
            self._redis.close()
