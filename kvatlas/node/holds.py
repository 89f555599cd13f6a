"""Holds: keys a move keeps in this node's L1 until the coordinator has deleted the source's
copy, so that a move never leaves the fleet with zero copies (``docs/cache-control.md``,
"Moves").

A hold is named by its move (``PUT /cache/holds/{hold_id}``) and lasts until it is released
(``DELETE /cache/holds/{hold_id}``) or ``ttl_s`` after it was last set, whichever comes first:
a coordinator that dies mid-move and never returns does not keep the keys unevictable forever
(the source's copy is deleted only after the target confirmed its hold, so an expired hold
leaves two copies, never none). While held, a key is passed by L1's LRU as a pinned one is
(:class:`~kvatlas.node.l1.L1Cache`'s ``held``); an explicit delete without ``force`` skips it.

Reads (``in``, iteration) take no lock on the hot path: the held set is one frozenset swapped
whole on every change, and expiry is checked against the earliest deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Protocol

from kvatlas.keys import ObjectKey

RELEASED_KEEP_S: Final = 3600.0
"""How long a released hold's id is remembered: a hold call of that move still loading (or
arriving late) sets nothing under it meanwhile (a move releases its hold only once finished)."""


class KeptKeys(Protocol):
    """What L1 asks of a set of keys its LRU must pass by."""

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[ObjectKey]: ...


class MoveHolds:
    """Holds by id, each a set of keys and a deadline (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, tuple[frozenset[ObjectKey], float]] = {}
        self._missing: dict[str, frozenset[ObjectKey]] = {}
        self._released: dict[str, float] = {}  # hold id -> until when it stays released
        self._keys: frozenset[ObjectKey] = frozenset()
        self._next_expiry = float("inf")

    def hold(self, hold_id: str, keys: Iterable[ObjectKey], ttl_s: float) -> bool:
        """Hold ``keys`` under ``hold_id`` for ``ttl_s`` from now (replacing what it held);
        ``False`` (nothing held) once ``hold_id`` was released (for :data:`RELEASED_KEEP_S`:
        a release that came while a hold call loaded is not undone by its end)."""
        with self._lock:
            self._rebuild()
            if hold_id in self._released:
                return False
            self._holds[hold_id] = (frozenset(keys), self._clock() + ttl_s)
            self._rebuild()
            return True

    def release(self, hold_id: str) -> int:
        """Drop the hold; returns how many keys it held (0: unknown or expired)."""
        with self._lock:
            found = self._holds.pop(hold_id, None)
            self._missing.pop(hold_id, None)
            self._released[hold_id] = self._clock() + RELEASED_KEEP_S
            self._rebuild()
        return 0 if found is None else len(found[0])

    def missing(self, hold_id: str) -> frozenset[ObjectKey]:
        """The keys earlier calls of a live hold found nowhere (not asked again: a large move
        loads over several calls, each must go on from where the last one stopped)."""
        with self._lock:
            self._rebuild()
            return (
                self._missing.get(hold_id, frozenset()) if hold_id in self._holds else frozenset()
            )

    def note_missing(self, hold_id: str, keys: Iterable[ObjectKey]) -> None:
        """Remember the keys a call of ``hold_id`` found nowhere (only while it is held)."""
        with self._lock:
            if hold_id in self._holds:
                self._missing[hold_id] = frozenset(keys)

    def __contains__(self, key: object) -> bool:
        if self._clock() >= self._next_expiry:
            with self._lock:
                self._rebuild()
        return key in self._keys

    def __iter__(self) -> Iterator[ObjectKey]:
        if self._clock() >= self._next_expiry:
            with self._lock:
                self._rebuild()
        return iter(self._keys)

    def __len__(self) -> int:
        if self._clock() >= self._next_expiry:
            with self._lock:
                self._rebuild()
        return len(self._keys)

    def holds(self) -> int:
        with self._lock:
            self._rebuild()
            return len(self._holds)

    def _rebuild(self) -> None:
        """Drop expired holds and recompute the held set (the caller holds the lock)."""
        now = self._clock()
        for hold_id in [h for h, (_, until) in self._holds.items() if until <= now]:
            del self._holds[hold_id]
            self._missing.pop(hold_id, None)
        for hold_id in [h for h, until in self._released.items() if until <= now]:
            del self._released[hold_id]
        keys: set[ObjectKey] = set()
        for held, _ in self._holds.values():
            keys |= held
        self._keys = frozenset(keys)
        self._next_expiry = min((until for _, until in self._holds.values()), default=float("inf"))


class AnyOf:
    """Keys kept by any of several sets (the operator's pins and the moves' holds)."""

    def __init__(self, *sets: KeptKeys) -> None:
        self._sets = sets

    def __contains__(self, key: object) -> bool:
        return any(key in s for s in self._sets)

    def __iter__(self) -> Iterator[ObjectKey]:
        seen: set[ObjectKey] = set()
        for s in self._sets:
            seen.update(s)
        return iter(seen)
