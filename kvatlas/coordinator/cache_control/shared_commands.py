"""The command log kept in Redis (:mod:`.shared_store`), shared by every replica: the same
methods as :class:`.CommandLog`, and leases so that one replica at a time works on a command.

- **One record per command**, stored as :class:`.Command` encodes it (msgpack, every field it
  has): a field added to the record is kept without a change here. Each change is one atomic
  script that also keeps the counts by kind and state, the set of unfinished commands and a
  revision per command; :meth:`update` (every read-modify-write) re-reads and re-applies its
  change when another replica changed the command in between, and a finished command stays
  finished (a late write of a stale copy cannot revive it).
- **Leases**: :meth:`claim` grants each unfinished command to one replica for ``lease_s``
  seconds, renewed at each of its passes and before each delivery; only the holder delivers
  it and finishes it from its directory. A replica that dies (``kill -9``) stops renewing, and
  another takes its commands over once their leases expire. The fleet eviction pass has its
  own lease (:meth:`leads`), so one replica at a time records evictions.
- **Reads** of unfinished commands fetch only those whose revision changed since this replica
  last read them (a pass over a quiet log is one ``HGETALL`` of ids and revisions).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import msgspec

from kvatlas.coordinator.cache_control.commands import (
    FINISHED,
    Command,
    CommandLog,
    Retry,
    encode_commands,
    restored_commands,
)
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.errors import Unavailable

_CONFLICT: Final = -1
_FINAL: Final = -2
_PRUNE_BATCH: Final = 500
_UPDATE_TRIES: Final = 20
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Command).decode


class SharedCommandLog(CommandLog):
    """:class:`.CommandLog` over a :class:`SharedStore`; ``lease_s``: how long a replica holds
    a command (or the eviction pass) without renewing it."""

    def __init__(
        self,
        store: SharedStore,
        *,
        lease_s: float = 30.0,
        retry: Retry | None = None,
        confirm_s: float = 30.0,
        retention_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] | None = None,
    ) -> None:
        options: dict[str, Any] = {} if jitter is None else {"jitter": jitter}
        super().__init__(
            retry=retry, confirm_s=confirm_s, retention_s=retention_s, clock=clock, **options
        )
        self.store = store
        self.lease_s = lease_s
        self._keys = store.command_keys
        self._cache: dict[str, tuple[int, Command]] = {}  # id -> (revision, record)
        self._cache_lock = threading.Lock()

    # ------------------------------------------------------------------ writes

    def record(self, command: Command) -> Command:
        return self._write(command, expected="")

    def update(self, command_id: str, change: Callable[[Command], Command]) -> Command:
        for _ in range(_UPDATE_TRIES):
            current, rev = self._read(command_id)
            if current is None:
                raise KeyError(command_id)
            new = change(current)
            if new == current:
                return current
            rev_after = self._script_record(new, str(rev))
            if rev_after == _CONFLICT:
                continue  # another replica changed it: read again, apply again
            if rev_after == _FINAL:
                return self._read(command_id)[0] or current
            return new
        raise Unavailable(f"command {command_id}: changed concurrently {_UPDATE_TRIES} times")

    def _write(self, command: Command, expected: str) -> Command:
        rev = self._script_record(command, expected)
        if rev == _FINAL:  # finished meanwhile: what Redis holds stands
            return self._read(command.command_id)[0] or command
        return command

    def _script_record(self, c: Command, expected: str, base: int = 0) -> int:
        finished = c.state in FINISHED
        args = [c.command_id, c.kind, c.state, _encode(c), "1" if finished else "0",
                repr(c.updated_at), expected, base]  # fmt: skip
        return int(self.store.script("record", [*self._keys, self.store.key("meta")], args))

    def seed(self, data: bytes) -> None:
        """Write the commands of a snapshot section (as a restart resumes them). Their
        revisions start from the time in ms, above any a replica may keep from before Redis
        lost them: a revision that started at 1 again would match another replica's copy of
        the old revision 1 (:meth:`unfinished` reads only what changed revision)."""
        base = time.time_ns() // 1_000_000
        for c in restored_commands(data):
            self._script_record(c, "", base)

    # ------------------------------------------------------------------ reads

    def get(self, command_id: str) -> Command | None:
        return self._read(command_id)[0]

    def _read(self, command_id: str) -> tuple[Command | None, int]:
        blob, meta = self.store.transaction(
            lambda pipe: (
                pipe.hget(self._keys[0], command_id),
                pipe.hget(self._keys[1], command_id),
            )
        )
        if blob is None or meta is None:
            return None, 0
        return _decode(blob), int(meta.rsplit(b"/", 1)[1])

    def unfinished(self) -> list[Command]:
        revisions: dict[bytes, bytes] = self.store.call("hgetall", self._keys[2])
        wanted = {i.decode(): int(r) for i, r in revisions.items()}
        with self._cache_lock:
            stale = [i for i, r in wanted.items() if self._cache.get(i, (-1,))[0] != r]
        if stale:
            blobs = self.store.call("hmget", self._keys[0], stale)
            fresh = {i: _decode(b) for i, b in zip(stale, blobs, strict=True) if b is not None}
        else:
            fresh = {}
        with self._cache_lock:
            for i, c in fresh.items():
                self._cache[i] = (wanted[i], c)
            self._cache = {i: v for i, v in self._cache.items() if i in wanted}
            found = [c for _r, c in self._cache.values()]
        return sorted(found, key=lambda c: c.created_at)

    def due(self) -> list[Command]:
        now = self._clock()
        return [c for c in self.unfinished() if self.is_due(c, now)]

    def counts(self) -> dict[tuple[str, str], int]:
        raw: dict[bytes, bytes] = self.store.call("hgetall", self._keys[3])
        out: dict[tuple[str, str], int] = {}
        for label, n in raw.items():
            kind, _, state = label.decode().partition("/")
            if int(n) > 0:
                out[(kind, state)] = int(n)
        return out

    def prune(self) -> int:
        cutoff = self._clock() - self.retention_s
        args = ["(" + repr(cutoff), _PRUNE_BATCH]  # finished before the cutoff, exclusive
        return int(self.store.script("prune", self._keys, args, write=False))

    def to_snapshot(self) -> bytes:
        blobs: dict[bytes, bytes] = self.store.call("hgetall", self._keys[0])
        return encode_commands([_decode(b) for b in blobs.values()])

    # ------------------------------------------------------------------ leases

    def claim(self, command_ids: Iterable[str]) -> set[str]:
        ids = list(command_ids)
        if not ids:
            return set()
        held = self._claim([self.store.key(f"lease:{i}") for i in ids])
        return {ids[int(n) - 1] for n in held}

    def release(self, command_ids: Iterable[str]) -> None:
        ids = list(command_ids)
        if ids:
            keys = [self.store.key(f"lease:{i}") for i in ids]
            self.store.script("release", keys, [self.store.owner], write=False)

    def leads(self, task: str) -> bool:
        return bool(self._claim([self.store.key(f"lease:{task}")]))

    def _claim(self, leases: list[str]) -> list[int]:
        """The 1-based indexes of ``leases`` this replica holds now (taken or renewed)."""
        args = [self.store.owner, int(self.lease_s * 1000), self.store.predecessor]
        return list(self.store.script("claim", leases, args, write=False))
