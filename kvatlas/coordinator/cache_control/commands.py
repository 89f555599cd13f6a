"""Durable cache-control commands: every delete, eviction, prefetch and move is a record that
lives until the directory shows its effect, not a request fired and forgotten.

A command is ``pending`` until it has been delivered to every target instance (the holder of a
private copy, one live member of a shared pool), ``sent`` while the coordinator waits for the
resulting cache events, ``completed`` once the directory shows them (or the keys went away by
other means) and ``failed`` only when it cannot ever apply (its instance left the fleet). A
delivery that fails leaves it ``pending`` with ``attempts`` + 1 and ``next_attempt_at`` pushed
out by a jittered exponential backoff (capped), so an instance that is down for an hour is
asked a handful of times, and a ``sent`` command whose events do not come within
``confirm_s`` is delivered again (node deletes and prefetches are idempotent).

Times are wall-clock seconds (``time.time``): they must mean the same after a restart. This
log keeps the commands in the process's memory and the coordinator's snapshot
(:meth:`CommandLog.to_snapshot`), each change written ahead to the journal between snapshots
(:attr:`CommandLog.on_change`); with the Redis transport the replicas share one log kept in
Redis instead (:class:`~.shared_commands.SharedCommandLog`: the same methods, every change
through :meth:`CommandLog.record` or :meth:`CommandLog.update`, and a lease so that one replica
at a time works on a command: :meth:`CommandLog.claim`). Finished commands are kept
``retention_s`` (their status stays readable), then dropped.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Final, Literal

import msgspec

from kvatlas.api.cache_control import EncodedKey, TierName
from kvatlas.keys import ObjectKey, parse_chunk_hash_hex

CommandKind = Literal["delete", "evict", "prefetch", "move"]
CommandState = Literal["pending", "sent", "completed", "failed"]
MovePhase = Literal["queued", "loading", "holding", "deleting", "done"]
"""Where a move stands (``docs/cache-control.md``, "Moves"): recorded; asking the target to
load and hold the keys; the target holds them, the directory does not show them yet; deleting
the source's L1 copies (only those the target holds); finished."""
FINISHED: Final = frozenset({"completed", "failed"})


class Command(msgspec.Struct, frozen=True, kw_only=True):
    """One command and where it stands (its own wire and snapshot form)."""

    command_id: str
    kind: CommandKind
    targets: tuple[str, ...]
    keys: tuple[EncodedKey, ...]
    tier: TierName = "all"
    force: bool = False
    source: str = ""  # a move's source instance
    state: CommandState = "pending"
    attempts: int = 0
    next_attempt_at: float = 0.0
    created_at: float = 0.0
    updated_at: float = 0.0
    last_error: str = ""
    remote_ids: tuple[str, ...] = ()  # what each target named it (a prefetch's request id)
    found_keys: int | None = None  # a completed prefetch: how many keys the target holds
    token_ids: tuple[int, ...] = ()  # a prefetch's tokens (an MP server resolves its keys)
    world_size: int = 1
    # a move's progress (found_keys: the keys the target holds)
    keep_source: bool = False  # a copy: the source's copies stay
    phase: MovePhase = "queued"
    missing: int = 0  # keys neither the target's tiers nor the source had
    deleted: int = 0  # source copies removed
    skipped: int = 0  # source copies left: pinned
    moving: tuple[int, ...] = ()  # indices in ``keys`` of the source copies being deleted
    source_left: bool = False  # the source deregistered or was fenced (seen by any replica)
    held_at: float = 0.0  # when the target last confirmed holding the keys (wall clock)


def object_key(k: EncodedKey) -> ObjectKey:
    """A command's wire key as the directory's key."""
    return ObjectKey(
        parse_chunk_hash_hex(k.chunk_hash_hex), k.model_name, k.kv_rank, k.object_group_id,
        k.cache_salt,
    )  # fmt: skip


class Retry(msgspec.Struct, frozen=True):
    """Backoff between deliveries: ``initial_s`` doubling up to ``cap_s``, each wait 50-100%
    of its step (as :class:`kvatlas.backoff.Backoff`), so a fleet's commands spread out."""

    initial_s: float = 1.0
    cap_s: float = 60.0

    def wait_s(self, attempts: int, jitter: float) -> float:
        step = min(self.initial_s * float(1 << max(attempts - 1, 0)), self.cap_s)
        return step * (0.5 + jitter / 2)


class _Snapshot(msgspec.Struct):
    version: int
    commands: list[Command]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Snapshot)


class CommandLog:
    """The commands by id, thread-safe; every change goes through :meth:`record`."""

    def __init__(
        self,
        commands: Iterable[Command] = (),
        *,
        retry: Retry | None = None,
        confirm_s: float = 30.0,
        retention_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.retry = retry or Retry()
        self.confirm_s = confirm_s
        self.retention_s = retention_s
        self._clock = clock
        self._jitter = jitter
        self._lock = threading.Lock()
        self._commands: dict[str, Command] = {c.command_id: c for c in commands}
        self.on_change: Callable[[Command], object] | None = None
        """Called under the log's lock with each command as a change leaves it, before the
        change is applied (the journal's write-ahead): raising refuses the change."""

    def new(
        self,
        kind: CommandKind,
        targets: Iterable[str],
        keys: Iterable[EncodedKey],
        **fields: object,
    ) -> Command:
        now = self._clock()
        command = Command(
            command_id=uuid.uuid4().hex, kind=kind, targets=tuple(targets), keys=tuple(keys),
            created_at=now, updated_at=now, next_attempt_at=now, **fields,  # type: ignore[arg-type]
        )  # fmt: skip
        return self.record(command)

    def record(self, command: Command) -> Command:
        with self._lock:
            if self.on_change is not None:
                self.on_change(command)
            self._commands[command.command_id] = command
        return command

    def get(self, command_id: str) -> Command | None:
        with self._lock:
            return self._commands.get(command_id)

    def due(self) -> list[Command]:
        """Commands to deliver now: pending ones whose time has come, and sent ones whose
        events are overdue (delivered again), oldest first."""
        now = self._clock()
        with self._lock:
            found = [c for c in self._commands.values() if self.is_due(c, now)]
        return sorted(found, key=lambda c: c.created_at)

    def is_due(self, c: Command, now: float) -> bool:
        return (c.state == "pending" and c.next_attempt_at <= now) or (
            c.state == "sent" and now - c.updated_at > self.confirm_s
        )

    def update(self, command_id: str, change: Callable[[Command], Command]) -> Command:
        """Record ``change`` of the command as it stands now (``KeyError``: no such command).
        Every read-modify-write goes through here: the shared log applies it atomically (a
        concurrent change by another replica makes it read again and re-apply ``change``).
        A finished command's state never changes (as in the shared log): such a change leaves
        the command as it stands."""
        with self._lock:
            current = self._commands.get(command_id)
            if current is None:
                raise KeyError(command_id)
            new = change(current)
            if new == current or (current.state in FINISHED and new.state != current.state):
                return current
            if self.on_change is not None:
                self.on_change(new)
            self._commands[command_id] = new
        return new

    def now(self) -> float:
        """The log's clock (wall-clock seconds)."""
        return self._clock()

    def claim(self, command_ids: Iterable[str]) -> set[str]:
        """Those of ``command_ids`` this coordinator may deliver and finish now: all of them
        here; the shared log grants each to one replica at a time (a lease)."""
        return set(command_ids)

    def release(self, command_ids: Iterable[str]) -> None:
        """Give up this coordinator's hold on ``command_ids`` (nothing to do here; the shared
        log frees their leases, so another replica may take them at once)."""

    def leads(self, task: str) -> bool:
        """Whether this coordinator runs ``task`` (the fleet eviction pass) now: always here;
        with the shared log, the one replica holding its lease."""
        return True

    def delivery_failed(self, command_id: str, error: str) -> Command:
        """A delivery did not reach its target: pending, retried after the backoff."""
        now = self._clock()
        jitter = self._jitter()

        def change(c: Command) -> Command:
            attempts = c.attempts + 1
            return msgspec.structs.replace(
                c, state="pending", attempts=attempts,
                next_attempt_at=now + self.retry.wait_s(attempts, jitter),
                updated_at=now, last_error=error,
            )  # fmt: skip

        return self.update(command_id, change)

    def due_now(self, command_id: str) -> Command:
        """Deliver a pending command at the next pass (its instance is back)."""
        now = self._clock()
        return self.update(command_id, lambda c: msgspec.structs.replace(
            c, next_attempt_at=now, updated_at=now) if c.state == "pending" else c)  # fmt: skip

    def delivered(self, command_id: str, remote_ids: tuple[str, ...] = ()) -> Command:
        now = self._clock()
        return self.update(command_id, lambda c: msgspec.structs.replace(
            c, state="sent", attempts=c.attempts + 1, updated_at=now,
            remote_ids=remote_ids or c.remote_ids, last_error="",
        ))  # fmt: skip

    def finish(
        self,
        command_id: str,
        state: Literal["completed", "failed"],
        error: str = "",
        found_keys: int | None = None,
    ) -> Command:
        now = self._clock()
        return self.update(command_id, lambda c: msgspec.structs.replace(
            c, state=state, updated_at=now, last_error=error or c.last_error,
            found_keys=found_keys if found_keys is not None else c.found_keys,
        ))  # fmt: skip

    def prune(self) -> int:
        """Drop finished commands older than ``retention_s``; returns how many."""
        cutoff = self._clock() - self.retention_s
        with self._lock:
            old = [
                i
                for i, c in self._commands.items()
                if c.state in FINISHED and c.updated_at < cutoff
            ]
            for i in old:
                del self._commands[i]
        return len(old)

    def progress(self, command_id: str, **fields: object) -> Command:
        """Record what a delivered command learnt (a prefetch's ``found_keys``) without
        changing its state."""
        return self.update(
            command_id,
            lambda c: msgspec.structs.replace(c, **fields),  # type: ignore[arg-type]
        )

    def unfinished(self) -> list[Command]:
        """Every command not yet completed or failed, oldest first."""
        with self._lock:
            found = [c for c in self._commands.values() if c.state not in FINISHED]
        return sorted(found, key=lambda c: c.created_at)

    def counts(self) -> dict[tuple[str, str], int]:
        """Commands by (kind, state): the metric's figures."""
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for c in self._commands.values():
                out[(c.kind, c.state)] = out.get((c.kind, c.state), 0) + 1
        return out

    def to_snapshot(self) -> bytes:
        with self._lock:
            commands = list(self._commands.values())
        return encode_commands(commands)

    @classmethod
    def from_snapshot(cls, data: bytes, **options: object) -> CommandLog:
        """The log a snapshot held: unfinished commands are due again at once (what was
        ``sent`` before the restart is delivered again: the events may never come)."""
        return cls(restored_commands(data), **options)  # type: ignore[arg-type]


def encode_commands(commands: list[Command]) -> bytes:
    """The snapshot form of ``commands`` (:func:`restored_commands` reads it)."""
    return _encoder.encode(_Snapshot(1, commands))


def restored_commands(data: bytes) -> list[Command]:
    """The commands of :meth:`CommandLog.to_snapshot`'s bytes, as a restart resumes them:
    what was ``sent`` is pending and due at once (``ValueError``: another version)."""
    snap = _decoder.decode(data)
    if snap.version != 1:
        raise ValueError(f"command snapshot version {snap.version} is not 1")
    return [resumed(c) for c in snap.commands]


def resumed(c: Command) -> Command:
    """A command as a restart resumes it: what was ``sent`` is pending and due at once (its
    events may never come)."""
    return (
        msgspec.structs.replace(c, state="pending", next_attempt_at=0.0) if c.state == "sent" else c
    )
