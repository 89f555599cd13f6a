"""L2 adapters: where chunks go beyond L1 -- a local directory (``fs``) or Redis (``redis``).

Both store the checksummed :func:`~kvatlas.node.stored_chunk.encode_chunk` bytes, so every L2
read is verified: a torn or corrupt value is a *miss*, never wrong KV.

Error contract, shared by all backends, because L2 is a cache and a cache that is down must
degrade to recomputation, not to failed requests:

* reads (``get``, ``get_many``, ``contains``) never raise for backend trouble -- an unreachable
  server, an I/O error or a corrupt value is a miss;
* writes (``put``, ``delete``) raise :class:`L2Unavailable` when the backend cannot take them,
  so the caller knows the chunk is *not* in L2 and must not report an L2 store event for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterable
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


class FsL2:
    """One file per key under ``root`` (``<root>/<d[:2]>/<d>.kvc``, ``d`` = :func:`key_digest`).

    Writes are crash-safe: the bytes go to a temp file in the target directory, are fsynced,
    renamed over the final name (atomic on POSIX) and the directory is fsynced -- so a crash
    leaves either the old file, the new file or an ignored temp file, never a half file under
    the final name. A file that is corrupt anyway (disk fault, foreign writer) is a miss and is
    removed. Temp files left by a crash are swept at start-up once older than
    ``stale_temp_seconds`` (young ones may belong to a live writer sharing the directory).

    ``shared=True`` declares ``root`` a fleet-wide pool (a directory every node mounts): its
    placements are then the pool's, not this node's, and survive the node.
    """

    def __init__(
        self,
        root: Path,
        name: str = "fs",
        *,
        shared: bool = False,
        stale_temp_seconds: float = 3600.0,
    ) -> None:
        self.root = Path(root)
        self.name = name
        self.shared = shared
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_temp(stale_temp_seconds)

    def path_for(self, key: ObjectKey) -> Path:
        digest = key_digest(key)
        return self.root / digest[:2] / f"{digest}.kvc"

    def put(self, chunk: StoredChunk) -> None:
        data = encode_chunk(chunk)
        path = self.path_for(chunk.key)
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

    def get(self, key: ObjectKey) -> StoredChunk | None:
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("fs L2 read of %s failed: %s", path, exc)
            return None
        chunk = _decode_for(key, data, str(path))
        if chunk is None:
            self._remove_if_same(path, inode)
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
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise L2Unavailable(f"fs L2 delete of {path} failed: {exc}") from exc
        return True

    def contains(self, key: ObjectKey) -> bool:
        """Existence only (no read): a corrupt file still counts until a ``get`` drops it."""
        return self.path_for(key).is_file()

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own file."""

    @staticmethod
    def _remove_if_same(path: Path, inode: int) -> None:
        """Drop a bad file -- unless a concurrent put already renamed a good one over it."""
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                path.unlink()

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
    """

    shared = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvatlas:kv:",
        name: str = "redis",
        ttl_seconds: int | None = None,
        socket_timeout: float = 2.0,
        connect_timeout: float = 0.5,
    ) -> None:
        import redis  # optional dependency (the ``redis`` extra)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.prefix = prefix
        self.name = name
        self.ttl_seconds = ttl_seconds
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self._redis: Any = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 1),
        )

    def redis_key(self, key: ObjectKey) -> str:
        return self.prefix + key_digest(key)

    def put(self, chunk: StoredChunk) -> None:
        try:
            self._redis.set(self.redis_key(chunk.key), encode_chunk(chunk), ex=self.ttl_seconds)
        except self._errors as exc:
            raise L2Unavailable(f"redis L2 write failed: {exc}") from exc

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
        try:
            return bool(self._redis.delete(self.redis_key(key)))
        except self._errors as exc:
            raise L2Unavailable(f"redis L2 delete failed: {exc}") from exc

    def contains(self, key: ObjectKey) -> bool:
        try:
            return bool(self._redis.exists(self.redis_key(key)))
        except self._errors:
            return False

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._redis.close()
