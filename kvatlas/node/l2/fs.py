"""The ``fs`` L2: one file per key in a directory -- private to a node (byte cap, LRU,
restart rescan) or a shared pool every node mounts (see :class:`FsL2`)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvatlas.durable import fsync_directory
from kvatlas.keys import ObjectKey
from kvatlas.logs import Throttle
from kvatlas.node.l2.backend import (
    CORRUPT_DELETED,
    EVICTED,
    UNREADABLE,
    VANISHED,
    FoundCallback,
    L2FullOfPins,
    L2Unavailable,
    LostCallback,
    decode_for,
    key_digest,
)
from kvatlas.node.stored_chunk import ChunkDecodeError, StoredChunk, decode_chunk, encode_chunk

log = logging.getLogger(__name__)

_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})
"""Read errors that say nothing of the file: a miss now, the file kept for the next read."""


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
    removed and counted (``corrupt_deleted``). Temp files left by a crash are swept at start-up:
    all of them in a private L2 (its one writer is this node, starting), those older than
    ``stale_temp_seconds`` in a shared pool (young ones may belong to another node's write).

    A private L2 (``shared=False``) keeps an LRU of its files (recency from reads and writes;
    after a restart, from the files' modification times) and, with ``max_bytes > 0``, a put
    that would pass the cap evicts least-recently-used files first (never the one being
    written); a chunk larger than the whole cap is refused. The LRU is rebuilt from the files
    really there by :meth:`rescan` (the node calls it through :meth:`attach`; a capped L2 that
    was never attached scans on its first put). Puts are serialized: the byte count and the
    files never disagree. A file whose chunk the rescan's ``on_found`` refuses (another KV
    layout's) stays on disk and in the LRU (the cap covers it; it is evicted like any other),
    but is not held: :meth:`contains`, :meth:`get` and :meth:`keys` pass it over until a put
    of its key replaces it.

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
        self._say = Throttle()  # a WARNING a minute per errno of the reads that failed for now
        self._lock = threading.Lock()  # guards the LRU and the counters
        self._write_lock = threading.Lock()  # serializes puts (write + account + evict)
        self._lru: OrderedDict[ObjectKey, int] = OrderedDict()  # key -> file bytes, LRU first
        self._foreign: set[ObjectKey] = set()  # in the LRU, on disk, refused by on_found
        # the operator's pins (the node sets it: kvatlas.node.pins); the cap never evicts them
        self.pinned: Collection[ObjectKey] = frozenset()
        self._used = 0
        self._scanned = shared  # a shared pool is not this node's to track
        self.root.mkdir(parents=True, exist_ok=True)
        # a private L2's one writer is this node, starting: every temp file is a dead write
        self._sweep_temp(stale_temp_seconds if shared else 0.0)

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
        counted, never kept. ``on_found`` gets every good chunk (decoded, tokens included);
        one it refuses stays on disk, not held. Returns the keys held afterwards, least
        recently used first -- after evicting down to the cap if it shrank since the files were
        written. A shared pool returns ``[]``.
        """
        if self.shared:
            return []
        with self._write_lock:  # no put interleaves: the count matches the files
            found, foreign = self._scan_files(on_found)
            with self._lock:
                self._lru = OrderedDict((key, size) for _, key, size in found)
                self._foreign = foreign
                self._used = sum(size for _, _, size in found)
                self._scanned = True
                lost = self._evict_locked(None)
                kept = [key for key in self._lru if key not in self._foreign]
        self._report(lost, EVICTED)
        return kept

    def _scan_files(
        self, on_found: FoundCallback | None
    ) -> tuple[list[tuple[int, ObjectKey, int]], set[ObjectKey]]:
        """``(mtime_ns, key, bytes)`` of every good file, oldest first (bad ones deleted), and
        the keys of those ``on_found`` refused."""
        found: list[tuple[int, ObjectKey, int]] = []
        foreign: set[ObjectKey] = set()
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
            if on_found is not None and not on_found(chunk):
                foreign.add(chunk.key)
        return sorted(found, key=lambda f: f[0]), foreign

    def put(self, chunk: StoredChunk) -> None:
        data = encode_chunk(chunk)
        path = self.path_for(chunk.key)
        if self.max_bytes and len(data) > self.max_bytes:
            raise L2Unavailable(
                f"fs L2: a {len(data)}-byte chunk is larger than the cap of {self.max_bytes} bytes"
            )
        if not self._scanned:
            self.rescan()
        lost: list[ObjectKey] = []
        try:
            with self._write_lock:
                if not self.shared:  # room first: the disk never holds more than the cap
                    with self._lock:
                        incoming = len(data) - self._lru.get(chunk.key, 0)
                        self._refuse_if_pins_fill(chunk.key, incoming)
                        lost = self._evict_locked(chunk.key, incoming)
                self._write(path, data)
                if self.shared:
                    return
                with self._lock:
                    self._used += len(data) - self._lru.pop(chunk.key, 0)
                    self._lru[chunk.key] = len(data)
                    self._foreign.discard(chunk.key)
        finally:
            self._report(lost, EVICTED)  # gone whether or not the write succeeded

    def _write(self, path: Path, data: bytes) -> None:
        tmp: str | None = None
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(exist_ok=True)
                fsync_directory(self.root)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".part")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            fsync_directory(path.parent)
        except OSError as exc:
            raise L2Unavailable(f"fs L2 write to {path} failed: {exc}") from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _refuse_if_pins_fill(self, keep: ObjectKey, incoming: int) -> None:
        """Refuse a put that could only fit by evicting pinned files (nothing is evicted)."""
        if not self.max_bytes or self._used + incoming <= self.max_bytes:
            return
        pins = self.pinned  # one read: the node may replace it meanwhile
        if not pins:  # the common case costs nothing
            return
        kept = sum(self._lru.get(k, 0) for k in pins)  # O(pins), not O(files)
        if keep not in pins:
            kept += self._lru.get(keep, 0)
        if kept + incoming > self.max_bytes:
            raise L2FullOfPins(
                f"fs L2: {kept} of its {self.max_bytes} bytes are pinned (or being rewritten); "
                f"a {incoming}-byte chunk does not fit"
            )

    def _evict_locked(self, keep: ObjectKey | None, incoming: int = 0) -> list[ObjectKey]:
        """Delete least-recently-used files (never ``keep`` nor a pinned one) until
        ``incoming`` more bytes fit under the cap."""
        lost: list[ObjectKey] = []
        while self.max_bytes and self._used + incoming > self.max_bytes:
            victim = next((k for k in self._lru if k != keep and k not in self.pinned), None)
            if victim is None:
                break
            self._used -= self._lru.pop(victim)
            self._foreign.discard(victim)
            with contextlib.suppress(FileNotFoundError):
                try:
                    self.path_for(victim).unlink()
                except OSError as exc:  # still counted as gone: the LRU no longer holds it
                    log.warning("fs L2 eviction of %s failed: %s", self.path_for(victim), exc)
            self.evicted += 1
            lost.append(victim)
        return lost

    def get(self, key: ObjectKey) -> StoredChunk | None:
        if key in self._foreign:  # another layout's, not held
            return None
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            self._forget(key, VANISHED)
            return None
        except OSError as exc:
            if exc.errno in _TRANSIENT:  # a full descriptor table, memory: a miss, file kept
                if self._say(str(exc.errno)):
                    log.warning("fs L2 read of %s failed: %s", path, exc)
                return None
            # (EIO, EACCES, ...): not held any more, so the next put of the key writes it again
            log.warning("fs L2 file %s cannot be read (%s): dropped", path, exc)
            with contextlib.suppress(OSError):
                path.unlink()
            self._forget(key, UNREADABLE)
            return None
        chunk = decode_for(key, data, str(path))
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
                self._foreign.discard(key)
        return existed

    def contains(self, key: ObjectKey) -> bool:
        """Existence only (no read): a corrupt file still counts until a ``get`` drops it; one
        the rescan left unheld (another layout's) does not."""
        return key not in self._foreign and self.path_for(key).is_file()

    def keys(self) -> list[ObjectKey]:
        """The keys of a private L2's files, least recently used first (a shared pool:
        ``[]``, its files are not this node's; nor are files the rescan left unheld)."""
        with self._lock:
            return [key for key in self._lru if key not in self._foreign]

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
            self._foreign.discard(key)
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
