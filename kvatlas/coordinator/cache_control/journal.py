"""The cache-control journal: every change of pins, quotas and commands written ahead, between
snapshots, so that what a coordinator acknowledged survives a ``kill -9`` however long ago its
last snapshot was (the HTTP transport; with Redis the state is Redis's).

Files beside the snapshot, ``<snapshot>.journal-<generation>``, each a run of records framed as
``<length u32><crc32 u32><msgpack>``, appended and ``fdatasync``'d before the change is applied
(the tables' ``on_change`` hooks call :meth:`Journal.write` under their locks, so a table's
records are in the order of its changes). A record is absolute, never a delta — a key's pin
count, a salt's limit, a command as the change left it — so replaying a record the snapshot
already holds changes nothing, and the last record of each thing wins.

A snapshot first :meth:`~Journal.rotate`\\ s to a new generation, then reads the state, and
records that generation in its cache-control section: every record of an older generation was
applied before the state was read, so once the snapshot is on disk the older files go
(:meth:`~Journal.forget_before`). A restart restores the snapshot, then replays every file from
the generation it names (all of them without a snapshot), then writes a new generation. A last
record cut by the kill (its write had not returned: the change was not acknowledged) is
ignored with a warning; a record that fails its checksum ends its file's replay, logged and
counted.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from kvatlas.api.cache_control import EncodedKey
from kvatlas.coordinator.cache_control.commands import Command, CommandLog, object_key, resumed
from kvatlas.coordinator.cache_control.pins import PinTable
from kvatlas.coordinator.cache_control.quotas import Quotas, QuotaTable
from kvatlas.coordinator.cache_control.service import CacheControl, wire_key
from kvatlas.durable import fsync_directory
from kvatlas.errors import Unavailable

log = logging.getLogger(__name__)
_FRAME: Final = struct.Struct("<II")  # length, crc32 of the payload
FAILURES: Final = ("write", "damaged", "orphaned")
"""Why a journal failed: a write the disk refused (the change refused with it), a record that
fails its checksum (its file's replay ends there), files without the snapshot they follow."""


class PinCounts(msgspec.Struct, tag="pins"):
    rows: list[tuple[EncodedKey, int]]


class Limit(msgspec.Struct, tag="limit"):
    """``salt`` ``None``: the default limit; ``limit_gb`` ``None``: exempt, or removed."""

    salt: str | None
    limit_gb: float | None


class CommandRecord(msgspec.Struct, tag="command"):
    command: Command


Record = PinCounts | Limit | CommandRecord
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Record).decode


@dataclass
class Replayed:
    """What a replay read: ``records`` applied, ``damaged`` files whose replay stopped at a
    record that failed its checksum or did not decode."""

    records: int = 0
    damaged: int = 0


class Journal:
    """The journal of the coordinator whose snapshot is ``snapshot_path``."""

    def __init__(
        self, snapshot_path: str | Path, failed: Callable[[str], object] = lambda _reason: None
    ) -> None:
        """``failed``: called with the reason of each failure (:data:`FAILURES`; counted)."""
        self.snapshot_path = Path(snapshot_path)
        self.failed = failed
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._sealed = False  # a refused record is whole in the file: no write until rotate
        self.generation = 0  # the file written now (once attached)

    def path(self, generation: int) -> Path:
        return self.snapshot_path.with_name(f"{self.snapshot_path.name}.journal-{generation:08d}")

    def generations(self) -> list[int]:
        """The generations on disk, oldest first."""
        prefix = f"{self.snapshot_path.name}.journal-"
        found: list[int] = []
        if not self.snapshot_path.parent.is_dir():
            return found
        for entry in os.scandir(self.snapshot_path.parent):
            number = entry.name[len(prefix) :]
            if entry.name.startswith(prefix) and number.isdigit():
                found.append(int(number))
        return sorted(found)

    # ------------------------------------------------------------------ restart

    def replay(self, control: CacheControl, start: int = 0) -> Replayed:
        """Apply every record of generations ``start`` and later to ``control``'s in-memory
        tables, oldest first (before :meth:`attach`: nothing is written meanwhile); ``start``
        below 0: none (the snapshot was written without a journal, on the Redis transport: any
        file beside it is from an earlier run on HTTP, older than the snapshot)."""
        pins = control.pins
        if not isinstance(pins, PinTable):
            raise TypeError("a journal replays into the in-memory tables")
        done = Replayed()
        for generation in self.generations():
            if start < 0 or generation < start:
                continue
            path = self.path(generation)
            for record in self._records(path, done):
                _apply(record, pins, control.quotas, control.commands)
                done.records += 1
        return done

    def _records(self, path: Path, done: Replayed) -> list[Record]:
        data = path.read_bytes()
        records: list[Record] = []
        at = 0
        while at < len(data):
            if at + _FRAME.size > len(data):
                break
            length, crc = _FRAME.unpack_from(data, at)
            payload = data[at + _FRAME.size : at + _FRAME.size + length]
            if len(payload) < length:
                break
            try:
                if zlib.crc32(payload) != crc:
                    raise ValueError("checksum mismatch")
                records.append(_decode(payload))
            except (ValueError, msgspec.MsgspecError) as exc:
                done.damaged += 1
                self.failed("damaged")
                log.error("cache-control journal %s: record at byte %d unreadable (%s); "
                          "the rest of this file is not replayed", path, at, exc)  # fmt: skip
                return records
            at += _FRAME.size + length
        if at < len(data):
            log.warning("cache-control journal %s: the last %d bytes are not a whole record "
                        "(a write cut by a crash, never acknowledged): ignored",
                        path, len(data) - at)  # fmt: skip
        return records

    def attach(self, control: CacheControl, restored_generation: int = 0) -> None:
        """Open a new generation and write every later change of ``control`` ahead to it;
        ``restored_generation``: the one the restored snapshot names. The new one is later
        than it and than every file on disk: a snapshot brought back without its journal
        files (moved, or from a backup) names one the next restart replays from, and changes
        written to an earlier one would be skipped."""
        known = self.generations()
        self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._open_locked(max(known[-1] if known else 0, restored_generation) + 1)
        pins, quotas = control.pins, control.quotas
        if not isinstance(pins, PinTable) or not isinstance(quotas, QuotaTable):
            raise TypeError("a journal records the in-memory tables")
        pins.on_change = lambda rows: self.write(PinCounts([(wire_key(k), n) for k, n in rows]))
        quotas.on_change = lambda salt, gb: self.write(Limit(salt, gb))
        control.commands.on_change = lambda command: self.write(CommandRecord(command))

    # ------------------------------------------------------------------ writing

    def write(self, record: Record) -> None:
        """Append ``record`` and sync it to disk (``Unavailable``: it could not be; the change
        is refused, logged and counted). What a failed write left is cut off the file, so the
        next record follows the last whole one. A file that cannot be cut may hold the refused
        record whole: it is sealed, and every change is refused until a snapshot starts a new
        generation (the snapshot, which does not hold the change, then replaces the sealed
        file; only a crash before it would replay the record)."""
        payload = _encode(record)
        frame = _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            target, end = self.generation, None
            try:
                if self._sealed:
                    raise OSError("a refused record could not be cut off: sealed until the next "
                                  "snapshot")  # fmt: skip
                if self._fd is None:
                    target = self.generation + 1
                    self._open_locked(target)
                assert self._fd is not None
                end = os.lseek(self._fd, 0, os.SEEK_END)
                written = os.write(self._fd, frame)
                if written != len(frame):
                    raise OSError(f"short write ({written} of {len(frame)} bytes)")
                os.fdatasync(self._fd)
            except OSError as exc:
                self._cut_locked(end)
                error = f"cache-control journal {self.path(target)}: {exc}"
                log.error("%s: the change is refused", error)
                self.failed("write")
                raise Unavailable(error) from None

    def rotate(self) -> int:
        """Start the next generation (a snapshot does, before it reads the state); returns it."""
        with self._lock:
            self._open_locked(self.generation + 1)
            self._sealed = False
            return self.generation

    def forget_before(self, generation: int) -> None:
        """Remove the files older than ``generation`` (a snapshot holding them is on disk)."""
        for old in self.generations():
            if old < generation:
                self.path(old).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _open_locked(self, generation: int) -> None:
        path = self.path(generation)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fsync_directory(path.parent)
        except BaseException:
            os.close(fd)
            raise
        self._close_locked()
        self._fd, self.generation = fd, generation

    def _cut_locked(self, end: int | None) -> None:
        """Cut the file back to ``end`` (its length before a failed write); one that cannot
        be cut is closed and, if the write may have reached it, sealed."""
        if self._fd is None or end is None:
            return
        try:
            os.ftruncate(self._fd, end)
        except OSError:
            self._close_locked()
            self._sealed = True

    def _close_locked(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _apply(record: Record, pins: PinTable, quotas: Quotas, commands: CommandLog) -> None:
    if isinstance(record, PinCounts):
        pins.set_counts([(object_key(k), n) for k, n in record.rows])
    elif isinstance(record, Limit):
        if record.salt is None:
            quotas.set_default(record.limit_gb)
        elif record.limit_gb is None:
            quotas.remove(record.salt)
        else:
            quotas.set(record.salt, record.limit_gb)
    else:
        commands.record(resumed(record.command))


__all__ = ["Journal", "Replayed"]
