"""What the status page shows of cache control (docs/operator.md, docs/cache-control.md):
quotas and pins per salt, commands by kind and state, the oldest unfinished commands, and each
salt's L2 usage, counted at most every few seconds (:class:`SaltUsageCache`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

from kvatlas.coordinator.cache_control.commands import Command, CommandKind, CommandState
from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.coordinator.cache_control.service import CacheControl
from kvatlas.directory import KeyDirectory


@dataclass(frozen=True, slots=True)
class QuotaRow:
    """One salt: its L2 bytes (what its quota counts), the limit that applies in bytes
    (``None``: exempt), whether that is its own or the default, and its pinned keys."""

    cache_salt: str
    usage_bytes: int
    limit_bytes: float | None
    own: bool
    pinned_keys: int


@dataclass(frozen=True, slots=True)
class CommandCount:
    """How many commands of a kind are in a state (every kind and state, 0 when none)."""

    kind: str
    state: str
    count: int


@dataclass(frozen=True, slots=True)
class MoveProgress:
    """Where a move stands (as ``GET /cache/moves/{move_id}`` says): its phase, the keys the
    target holds (``loaded``), those no tier had (``missing``), the source copies removed
    (``deleted``) and those left pinned (``skipped``)."""

    phase: str
    loaded: int
    missing: int
    deleted: int
    skipped: int


@dataclass(frozen=True, slots=True)
class OpenCommand:
    """An unfinished cache-control command: where it stands and why (its last error); a
    move's progress (``None``: another kind)."""

    command_id: str
    kind: str
    targets: tuple[str, ...]
    keys: int
    state: str
    attempts: int
    age_s: float
    last_error: str
    move: MoveProgress | None = None


CACHE_ROWS = 50
"""Salts and unfinished commands the page lists at most (the most used / oldest first)."""


USAGE_MIN_AGE_S = 5.0
USAGE_COST_FACTOR = 20
"""Each salt's L2 bytes are counted by a pass over the whole directory (its cost grows with the
keys: docs/operator.md): the page reuses the last count until it is :data:`USAGE_MIN_AGE_S` old and
:data:`USAGE_COST_FACTOR` times as old as that pass took, so however large the directory and
however many tabs refresh, counting takes at most a twentieth of one core."""


@dataclass(frozen=True, slots=True)
class SaltUsage:
    bytes: dict[str, int]
    age_s: float


class SaltUsageCache:
    """The last count of each salt's L2 bytes, renewed by the rule above (``clock``: the
    service's monotonic clock)."""

    def __init__(self, count: Callable[[], dict[str, int]], clock: Callable[[], float]) -> None:
        self._count, self._clock = count, clock
        self._lock = threading.Lock()
        self._last: tuple[float, float, dict[str, int]] | None = None  # (at, took_s, bytes)

    def get(self) -> SaltUsage:
        with self._lock:  # a second reader waits for the pass under way, then shares it
            last = self._last
            now = self._clock()
            if last is None or now - last[0] >= max(USAGE_MIN_AGE_S, USAGE_COST_FACTOR * last[1]):
                counted = self._count()
                done = self._clock()
                last = self._last = (done, done - now, counted)
            return SaltUsage(last[2], max(self._clock() - last[0], 0.0))


@dataclass(frozen=True, slots=True)
class CacheControlStatus:
    """Quotas and pins per salt, and commands by kind and state (docs/cache-control.md)."""

    default_limit_bytes: float | None
    usage_age_s: float  # the usage is counted at most every few seconds (SaltUsage)
    quotas: tuple[QuotaRow, ...]
    salts: int  # how many salts there are; ``quotas`` lists at most CACHE_ROWS of them
    pinned_keys: int
    pinned_bytes: int  # the bytes of every copy of the pinned keys, every tier
    commands: tuple[CommandCount, ...]
    unfinished: tuple[OpenCommand, ...]
    unfinished_total: int


def cache_control_status(
    control: CacheControl, directory: KeyDirectory, usage: SaltUsage, now: float
) -> CacheControlStatus:
    """What the page shows of cache control; ``now`` is wall-clock (commands' times are)."""
    pins = control.pins.rows()
    pinned: dict[str, int] = {}
    for key, _count in pins:
        pinned[key.cache_salt] = pinned.get(key.cache_salt, 0) + 1
    default = control.quotas.default_limit_gb
    own = control.quotas.limits()
    rows = []
    for salt in set(usage.bytes) | set(own) | set(pinned):
        limit = own.get(salt, default)
        rows.append(QuotaRow(
            salt, usage.bytes.get(salt, 0), None if limit is None else limit * GB, salt in own,
            pinned.get(salt, 0),
        ))  # fmt: skip
    rows.sort(key=lambda r: (-_pressure(r), -r.usage_bytes, r.cache_salt))
    pinned_bytes = sum(
        p.size_bytes for found in directory.lookup([k for k, _ in pins]) for p in found.placements
    )
    counts = control.commands.counts()
    unfinished = control.commands.unfinished()  # oldest first
    return CacheControlStatus(
        default_limit_bytes=None if default is None else default * GB,
        usage_age_s=usage.age_s,
        quotas=tuple(rows[:CACHE_ROWS]),
        salts=len(rows),
        pinned_keys=len(pins),
        pinned_bytes=pinned_bytes,
        commands=tuple(
            CommandCount(k, s, counts.get((k, s), 0))
            for k in get_args(CommandKind)
            for s in get_args(CommandState)
        ),
        unfinished=tuple(_open(c, now) for c in unfinished[:CACHE_ROWS]),
        unfinished_total=len(unfinished),
    )


def _open(c: Command, now: float) -> OpenCommand:
    move = None
    if c.kind == "move":
        move = MoveProgress(c.phase, c.found_keys or 0, c.missing, c.deleted, c.skipped)
    return OpenCommand(
        c.command_id, c.kind, c.targets, len(c.keys), c.state, c.attempts,
        max(now - c.created_at, 0.0), c.last_error, move,
    )  # fmt: skip


def _pressure(row: QuotaRow) -> float:
    """Usage over limit (a limit of 0 with usage: infinitely over; exempt: 0)."""
    if row.limit_bytes is None:
        return 0.0
    if row.limit_bytes == 0:
        return float("inf") if row.usage_bytes else 0.0
    return row.usage_bytes / row.limit_bytes
