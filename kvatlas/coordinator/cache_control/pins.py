"""Pins: a reference count per key. A pinned key is skipped by a delete without ``force`` (and,
once nodes learn their pins, by every eviction); each pin adds one, each unpin removes one and
never goes below zero, so two operators pinning the same document must both unpin it.

Listing follows LMCache's coordinator: keys in the order they were first pinned (a key whose
count reached zero is gone; pinning it again appends it), filtered by salt and model, paged by
``offset``/``limit``. The table is part of the coordinator's snapshot (:meth:`PinTable.rows`),
and each change of it is written ahead to the journal (:attr:`PinTable.on_change`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Iterable
from typing import Protocol

from kvatlas.keys import ObjectKey


class Pins(Protocol):
    """The pin table's methods: :class:`PinTable` in memory, or
    :class:`~.shared_tables.SharedPinTable` in Redis (the Redis transport's replicas)."""

    def pin(self, keys: Iterable[ObjectKey]) -> int: ...

    def unpin(self, keys: Iterable[ObjectKey]) -> int: ...

    def count(self, key: ObjectKey) -> int: ...

    def pinned(self, keys: Iterable[ObjectKey]) -> set[ObjectKey]: ...

    def page(
        self,
        cache_salt: str | None,
        model_name: str | None,
        offset: int,
        limit: int,
        *,
        salts: Container[str] | None = None,
    ) -> tuple[int, list[tuple[ObjectKey, int]]]: ...

    def rows(self) -> list[tuple[ObjectKey, int]]: ...


class PinTable:
    """Thread-safe reference counts per :class:`ObjectKey`, in first-pinned order."""

    def __init__(self, rows: Iterable[tuple[ObjectKey, int]] = ()) -> None:
        self._counts: dict[ObjectKey, int] = {k: n for k, n in rows if n > 0}
        self._lock = threading.Lock()
        self.on_change: Callable[[list[tuple[ObjectKey, int]]], object] | None = None
        """Called under the table's lock with the new count of each key a change sets, before
        the change is applied (the journal's write-ahead): raising refuses the change."""

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        """Add one pin to each of ``keys``; returns how many keys (duplicates count once)."""
        unique = list(dict.fromkeys(keys))
        with self._lock:
            self._set([(k, self._counts.get(k, 0) + 1) for k in unique])
        return len(unique)

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        """Remove one pin from each of ``keys`` (floored at zero: an unpinned key stays so);
        returns how many keys were named, as LMCache counts them."""
        unique = list(dict.fromkeys(keys))
        with self._lock:
            self._set([(k, self._counts[k] - 1) for k in unique if k in self._counts])
        return len(unique)

    def set_counts(self, rows: Iterable[tuple[ObjectKey, int]]) -> None:
        """Set each key's count (0 unpins it; a key newly pinned goes last): the journal's
        records replayed."""
        with self._lock:
            self._set(list(rows))

    def _set(self, rows: list[tuple[ObjectKey, int]]) -> None:
        if self.on_change is not None and rows:
            self.on_change(rows)
        for key, n in rows:
            if n > 0:
                self._counts[key] = n
            else:
                self._counts.pop(key, None)

    def count(self, key: ObjectKey) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def pinned(self, keys: Iterable[ObjectKey]) -> set[ObjectKey]:
        """Those of ``keys`` that hold at least one pin."""
        with self._lock:
            return {k for k in keys if k in self._counts}

    def page(
        self,
        cache_salt: str | None,
        model_name: str | None,
        offset: int,
        limit: int,
        *,
        salts: Container[str] | None = None,
    ) -> tuple[int, list[tuple[ObjectKey, int]]]:
        """``(total matching, the page's (key, count) rows)``; ``salts`` (``None``: any)
        narrows further (a salt-bound node token's own)."""
        with self._lock:
            rows = [
                (k, n)
                for k, n in self._counts.items()
                if (cache_salt is None or k.cache_salt == cache_salt)
                and (model_name is None or k.model_name == model_name)
                and (salts is None or k.cache_salt in salts)
            ]
        return len(rows), rows[offset : offset + limit]

    def rows(self) -> list[tuple[ObjectKey, int]]:
        """Every pinned key and its count, in order (what a snapshot keeps)."""
        with self._lock:
            return list(self._counts.items())
