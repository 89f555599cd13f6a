"""L2 adapters: where chunks go beyond L1 -- a local directory (``fs``) or Redis (``redis``).

Both store the checksummed :func:`~kvatlas.node.stored_chunk.encode_chunk` bytes, so every L2
read is verified: a torn or corrupt value is a *miss*, never wrong KV.

Error contract, shared by all backends, because L2 is a cache and a cache that is down must
degrade to recomputation, not to failed requests:

* reads (``get``, ``get_many``, ``contains``) never raise for backend trouble -- an unreachable
  server, an I/O error or a corrupt value is a miss;
* writes (``put``, ``delete``) raise :class:`L2Unavailable` when the backend cannot take them,
  so the caller knows the chunk is *not* in L2 and must not report an L2 store event for it.

Honesty contract (``docs/node.md``, "L2 bounds"): a chunk that leaves L2 by any way other than
the node's own ``delete`` -- evicted for the byte cap, found corrupt, expired or evicted by
Redis -- is reported to the ``on_lost`` callback given to :meth:`L2Backend.attach` (the node
turns it into a ``delete`` event), and a restarted node learns what its private fs L2 really
holds from :meth:`FsL2.rescan` (``on_found``), so the directory never keeps a placement whose
bytes are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import blake3
import msgspec

from kvatlas.errors import InvalidInput, Unavailable
from kvatlas.keys import ObjectKey, check_instance_id
from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk, decode_chunk, encode_chunk

log = logging.getLogger(__name__)

_key_json = msgspec.json.Encoder(order="sorted")
_MGET_BATCH: Final = 64  # bounds one reply's size: values are MB-sized chunks


LostCallback = Callable[[ObjectKey, str], None]
"""``on_lost(key, cause)``: ``key`` left L2 without the node deleting it; ``cause`` is one of
:data:`EVICTED`, :data:`CORRUPT_DELETED`, :data:`EXPIRED`, :data:`VANISHED`."""
FoundCallback = Callable[[StoredChunk], None]
EVICTED: Final = "evicted"
"""Removed to stay under the byte cap (fs), or by Redis under ``maxmemory``."""
CORRUPT_DELETED: Final = "corrupt_deleted"
"""A torn, truncated or corrupt file, deleted instead of served."""
EXPIRED: Final = "expired"
"""Its Redis TTL ran out."""
VANISHED: Final = "vanished"
"""Gone without a word (someone else deleted it; a Redis restart; seen by a sweep or a read)."""


class L2Unavailable(Unavailable):
    """An L2 write (put/delete) could not be applied: the backend is down, full or failing.

    An :class:`~kvatlas.errors.Unavailable` (so still a ``RuntimeError``)."""


def key_digest(key: ObjectKey) -> str:
    """A fixed-length, filesystem- and Redis-safe name for ``key``.

    Hashes the *full* wire form (model names hold '/', salts separate tenants), so two keys that
    differ in any field never share a file or a Redis key.
    """
    return blake3.blake3(_key_json.encode(key.to_wire())).hexdigest()


def instance_dir(root: Path, instance_id: str) -> Path:
    """The fs L2 directory of one instance under ``root``: ``instance_id`` must be a valid
    id (:func:`~kvatlas.keys.check_instance_id`) and the resolved path (symlinks followed)
    must lie strictly inside the resolved ``root``, or :class:`~kvatlas.errors.InvalidInput`
    (an id is a name, never a way out of the L2 root)."""
    try:
        check_instance_id(instance_id)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    base = Path(root).resolve()
    path = (base / instance_id).resolve()
    if path == base or not path.is_relative_to(base):
        raise InvalidInput(f"instance directory {path} is not inside the L2 root {base}")
    return path


@runtime_checkable
class L2Backend(Protocol):
    """What the node needs from an L2 tier (see the module docstring for the error contract).

    ``shared`` says whether other nodes read the same store (a fleet-wide pool): the events of
    a shared backend are fleet placements, not this node's.
    """

    name: str
    shared: bool

    def put(self, chunk: StoredChunk) -> None: ...

    def get(self, key: ObjectKey) -> StoredChunk | None: ...

    def get_many(self, keys: Iterable[ObjectKey]) -> dict[ObjectKey, StoredChunk]: ...

    def delete(self, key: ObjectKey) -> bool: ...

    def contains(self, key: ObjectKey) -> bool: ...

    def attach(self, on_found: FoundCallback, on_lost: LostCallback) -> None:
        """Start reporting: ``on_found`` for each chunk a private store already holds (a
        restart), ``on_lost`` from now on for each chunk that leaves without ``delete``."""
        ...

    def close(self) -> None: ...


def _decode_for(key: ObjectKey, data: bytes, where: str) -> StoredChunk | None:
    try:
        chunk = decode_chunk(data)
    except ChunkDecodeError as exc:
        log.warning("corrupt L2 value for %s in %s: %s", key, where, exc)
        return None
    # A digest collision (or a value written under a foreign scheme) must not hand back
    # another key's KV.
    return chunk if chunk.key == key else None


@dataclass(frozen=True, slots=True)
class FsL2Stats:
    """What a private fs L2 holds against its cap, and what it dropped (since start)."""

    files: int
    used_bytes: int
    max_bytes: int
    evicted: int
    corrupt_deleted: int


class FsL2:
    """One file per key under ``root`` (``<root>/<d[:2]>/<d>.kvc``, ``d`` = :func:`key_digest`).

    Writes are crash-safe: the bytes go to a temp file in the target directory, are fsynced,
    renamed over the final name (atomic on POSIX) and the directory is fsynced -- so a crash
    leaves either the old file, the new file or an ignored temp file, never a half file under
    the final name. A file that is corrupt anyway (disk fault, foreign writer) is a miss, is
    removed and counted (``corrupt_deleted``). Temp files left by a crash are swept at start-up
    once older than ``stale_temp_seconds`` (young ones may belong to a live writer sharing the
    directory).

    A private L2 (``shared=False``) keeps an LRU of its files (recency from reads and writes;
    after a restart, from the files' modification times) and, with ``max_bytes > 0``, a put
    that would pass the cap evicts least-recently-used files first (never the one being
    written); a chunk larger than the whole cap is refused. The LRU is rebuilt from the files
    really there by :meth:`rescan` (the node calls it through :meth:`attach`; a capped L2 that
    was never attached scans on its first put). Puts are serialized: the byte count and the
    files never disagree.

    ``shared=True`` declares ``root`` a fleet-wide pool (a directory every node mounts): its
    placements are then the pool's, not this node's, and survive the node. A shared pool has no
    cap here (``max_bytes`` must be 0): no node sees what the others write, so a cap is the job
    of whoever provisions the pool (a quota, a size-limited volume).
    """

    def __init__(
        self,
        root: Path,
        name: str = "fs",
        *,
        shared: bool = False,
        stale_temp_seconds: float = 3600.0,
        max_bytes: int = 0,
    ) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0 (0 = no cap)")
        if shared and max_bytes:
            raise ValueError("a byte cap applies to a private fs L2 only, not to a shared pool")
        self.root = Path(root)
        self.name = name
        self.shared = shared
        self.max_bytes = max_bytes
        self.corrupt_deleted = 0
        self.evicted = 0
        self._on_lost: LostCallback | None = None
        self._lock = threading.Lock()  # guards the LRU and the counters
        self._write_lock = threading.Lock()  # serializes puts (write + account + evict)
        self._lru: OrderedDict[ObjectKey, int] = OrderedDict()  # key -> file bytes, LRU first
        self._used = 0
        self._scanned = shared  # a shared pool is not this node's to track
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_temp(stale_temp_seconds)

    def path_for(self, key: ObjectKey) -> Path:
        digest = key_digest(key)
        return self.root / digest[:2] / f"{digest}.kvc"

    def attach(self, on_found: FoundCallback, on_lost: LostCallback) -> None:
        self._on_lost = on_lost
        if not self.shared:
            self.rescan(on_found)

    def rescan(self, on_found: FoundCallback | None = None) -> list[ObjectKey]:
        """Rebuild the LRU and the byte count from the files really there (a private L2).

        Each file is read and verified; a truncated, corrupt or misnamed one is deleted and
        counted, never kept. ``on_found`` gets every good chunk (decoded, tokens included).
        Returns the keys held afterwards, least recently used first -- after evicting down to
        the cap if it shrank since the files were written. A shared pool returns ``[]``.
        """
        if self.shared:
            return []
        with self._write_lock:  # no put interleaves: the count matches the files
            found = self._scan_files(on_found)
            with self._lock:
                self._lru = OrderedDict((key, size) for _, key, size in found)
                self._used = sum(size for _, _, size in found)
                self._scanned = True
                lost = self._evict_locked(None)
                kept = list(self._lru)
        self._report(lost, EVICTED)
        return kept

    def _scan_files(self, on_found: FoundCallback | None) -> list[tuple[int, ObjectKey, int]]:
        """``(mtime_ns, key, bytes)`` of every good file, oldest first; bad ones deleted."""
        found: list[tuple[int, ObjectKey, int]] = []
        for path in self.root.glob("*/*.kvc"):
            try:
                st = path.stat()
                data = path.read_bytes()
            except OSError as exc:
                log.warning("fs L2 rescan: cannot read %s: %s", path, exc)
                continue
            try:
                chunk = decode_chunk(data)
                if self.path_for(chunk.key) != path:
                    raise ChunkDecodeError("the file name is not its key's digest")
            except ChunkDecodeError as exc:
                log.warning("fs L2 rescan: deleting corrupt %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                with self._lock:
                    self.corrupt_deleted += 1
                continue
            found.append((st.st_mtime_ns, chunk.key, st.st_size))
            if on_found is not None:
                on_found(chunk)
        return sorted(found, key=lambda f: f[0])

    def put(self, chunk: StoredChunk) -> None:
        data = encode_chunk(chunk)
        path = self.path_for(chunk.key)
        if self.max_bytes and len(data) > self.max_bytes:
            raise L2Unavailable(
                f"fs L2: a {len(data)}-byte chunk is larger than the cap of {self.max_bytes} bytes"
            )
        if not self._scanned:
            self.rescan()
        with self._write_lock:
            self._write(path, data)
            if self.shared:
                return
            with self._lock:
                self._used += len(data) - self._lru.pop(chunk.key, 0)
                self._lru[chunk.key] = len(data)
                lost = self._evict_locked(chunk.key)
        self._report(lost, EVICTED)

    def _write(self, path: Path, data: bytes) -> None:
        tmp: str | None = None
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(exist_ok=True)
                _fsync_dir(self.root)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".part")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            _fsync_dir(path.parent)
        except OSError as exc:
            raise L2Unavailable(f"fs L2 write to {path} failed: {exc}") from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _evict_locked(self, keep: ObjectKey | None) -> list[ObjectKey]:
        """Delete least-recently-used files (never ``keep``) until under the cap."""
        lost: list[ObjectKey] = []
        while self.max_bytes and self._used > self.max_bytes:
            victim = next((k for k in self._lru if k != keep), None)
            if victim is None:
                break
            self._used -= self._lru.pop(victim)
            with contextlib.suppress(FileNotFoundError):
                try:
                    self.path_for(victim).unlink()
                except OSError as exc:  # still counted as gone: the LRU no longer holds it
                    log.warning("fs L2 eviction of %s failed: %s", self.path_for(victim), exc)
            self.evicted += 1
            lost.append(victim)
        return lost

    def get(self, key: ObjectKey) -> StoredChunk | None:
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            self._forget(key, VANISHED)
            return None
        except OSError as exc:
            log.warning("fs L2 read of %s failed: %s", path, exc)
            return None
        chunk = _decode_for(key, data, str(path))
        if chunk is None:
            if self._remove_if_same(path, inode):
                with self._lock:
                    self.corrupt_deleted += 1
                self._forget(key, CORRUPT_DELETED)
            return None
        if not self.shared:
            with self._lock:
                if key in self._lru:
                    self._lru.move_to_end(key)
        return chunk

    def get_many(self, keys: Iterable[ObjectKey]) -> dict[ObjectKey, StoredChunk]:
        found: dict[ObjectKey, StoredChunk] = {}
        for key in keys:
            chunk = self.get(key)
            if chunk is not None:
                found[key] = chunk
        return found

    def delete(self, key: ObjectKey) -> bool:
        path = self.path_for(key)
        with self._write_lock:
            try:
                path.unlink()
                existed = True
            except FileNotFoundError:
                existed = False
            except OSError as exc:
                raise L2Unavailable(f"fs L2 delete of {path} failed: {exc}") from exc
            with self._lock:
                self._used -= self._lru.pop(key, 0)
        return existed

    def contains(self, key: ObjectKey) -> bool:
        """Existence only (no read): a corrupt file still counts until a ``get`` drops it."""
        return self.path_for(key).is_file()

    def stats(self) -> FsL2Stats:
        with self._lock:
            return FsL2Stats(
                len(self._lru), self._used, self.max_bytes, self.evicted, self.corrupt_deleted
            )

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own file."""

    def _forget(self, key: ObjectKey, cause: str) -> None:
        """``key``'s file is gone: drop it from the LRU and report it if this L2 held it."""
        if self.shared:  # the pool's, not tracked here: a missing file is just a miss
            if cause != VANISHED:
                self._report([key], cause)
            return
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._used -= size
        if size is not None:
            self._report([key], cause)

    def _report(self, keys: list[ObjectKey], cause: str) -> None:
        if self._on_lost is not None:
            for key in keys:
                self._on_lost(key, cause)

    @staticmethod
    def _remove_if_same(path: Path, inode: int) -> bool:
        """Drop a bad file -- unless a concurrent put already renamed a good one over it."""
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                path.unlink()
                return True
        return False

    def _sweep_temp(self, older_than: float) -> None:
        cutoff = time.time() - older_than
        for tmp in self.root.glob("*/.tmp-*.part"):
            with contextlib.suppress(OSError):
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation in ``path`` durable (the entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        return None if data is None else _decode_for(key, data, "redis")

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
                chunk = None if data is None else _decode_for(key, data, "redis")
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
