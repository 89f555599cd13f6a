"""Quotas per cache salt, with LMCache's semantics: a salt's own limit when it has one, else the
default limit, where ``None`` means exempt (no eviction for it) and ``0`` means it may hold
nothing (everything it stores is evicted). In paths the empty salt is named ``_default``.
Limits are GB of 2^30 bytes, as LMCache reports them. Part of the coordinator's snapshot; each
change is written ahead to the journal (:attr:`QuotaTable.on_change`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Final, Protocol

from kvatlas.api.cache_control import DEFAULT_SALT_NAME
from kvatlas.keys import check_cache_salt

GB: Final = float(1 << 30)


def salt_of_path(segment: str) -> str:
    """The cache salt a ``/quota/{cache_salt}`` path names (``ValueError`` for a bad salt)."""
    return "" if segment == DEFAULT_SALT_NAME else check_cache_salt(segment)


class Quotas(Protocol):
    """The quota table's methods: :class:`QuotaTable` in memory, or
    :class:`~.shared_tables.SharedQuotaTable` in Redis (the Redis transport's replicas)."""

    @property
    def default_limit_gb(self) -> float | None: ...

    def set_default(self, limit_gb: float | None) -> None: ...

    def set(self, cache_salt: str, limit_gb: float) -> None: ...

    def remove(self, cache_salt: str) -> bool: ...

    def own(self, cache_salt: str) -> float | None: ...

    def effective_gb(self, cache_salt: str) -> float | None: ...

    def over_limit(self, cache_salt: str, used_bytes: int, watermark: float = 1.0) -> bool: ...

    def limits(self) -> dict[str, float]: ...


class QuotaTable:
    """The default limit and each salt's own limit, in GB."""

    def __init__(
        self, default_limit_gb: float | None = None, limits: Mapping[str, float] | None = None
    ) -> None:
        self._default = default_limit_gb
        self._limits: dict[str, float] = dict(limits or {})
        self._lock = threading.Lock()
        self.on_change: Callable[[str | None, float | None], object] | None = None
        """Called under the table's lock before a change is applied, with the salt (``None``:
        the default limit) and its new limit (``None``: exempt, or a salt's own removed);
        raising refuses the change (the journal's write-ahead)."""

    @property
    def default_limit_gb(self) -> float | None:
        with self._lock:
            return self._default

    def set_default(self, limit_gb: float | None) -> None:
        if limit_gb is not None and limit_gb < 0:
            raise ValueError("default_limit_gb must be >= 0 or null")
        with self._lock:
            if self.on_change is not None:
                self.on_change(None, limit_gb)
            self._default = limit_gb

    def set(self, cache_salt: str, limit_gb: float) -> None:
        if limit_gb < 0:
            raise ValueError("limit_gb must be >= 0")
        with self._lock:
            if self.on_change is not None:
                self.on_change(cache_salt, limit_gb)
            self._limits[cache_salt] = limit_gb

    def remove(self, cache_salt: str) -> bool:
        with self._lock:
            if cache_salt not in self._limits:
                return False
            if self.on_change is not None:
                self.on_change(cache_salt, None)
            del self._limits[cache_salt]
            return True

    def own(self, cache_salt: str) -> float | None:
        """The salt's own limit, ``None`` when it has none."""
        with self._lock:
            return self._limits.get(cache_salt)

    def effective_gb(self, cache_salt: str) -> float | None:
        """The limit that applies: its own, else the default; ``None`` = exempt."""
        with self._lock:
            return self._limits.get(cache_salt, self._default)

    def over_limit(self, cache_salt: str, used_bytes: int, watermark: float = 1.0) -> bool:
        """Whether eviction applies to the salt: usage at or above ``watermark`` x its limit
        (a limit of 0 with any usage does; an exempt salt never)."""
        limit = self.effective_gb(cache_salt)
        if limit is None:
            return False
        return used_bytes > 0 and used_bytes >= watermark * limit * GB

    def limits(self) -> dict[str, float]:
        with self._lock:
            return dict(self._limits)
