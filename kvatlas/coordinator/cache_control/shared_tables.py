"""Pins and quotas kept in Redis (:mod:`.shared_store`): the same methods as :class:`.PinTable`
and :class:`.QuotaTable`, every read from Redis, every change one atomic step there, so every
replica answers the same the moment a change is acknowledged.

A key is packed as msgpack ``(chunk hash bytes, model, kv_rank, object group, salt)``: one
byte string per key, the same for every replica, decoded back to an :class:`ObjectKey`.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Iterable
from typing import Any, Final

import msgspec

from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.keys import ObjectKey

_Packed = tuple[bytes, str, int, int, str]
_decode_key = msgspec.msgpack.Decoder(_Packed).decode


def pack_key(key: ObjectKey) -> bytes:
    return msgspec.msgpack.encode(
        (key.chunk_hash, key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
    )


def unpack_key(data: bytes) -> ObjectKey:
    chunk_hash, model, rank, group, salt = _decode_key(data)
    return ObjectKey(chunk_hash, model, rank, group, salt)


class SharedPinTable:
    """Reference counts per key in Redis, in first-pinned order (:class:`.PinTable`'s rules).
    Reads come from a copy of every pin, fetched again only when ``meta.pins_version`` moved
    (one ``HGET`` per read otherwise): a node's pin pages, delete and eviction checks stay at
    memory speed while nobody pins."""

    VERSION_FIELD: Final = "pins_version"

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self._pins = store.key("pins")
        self._order = store.key("pins:order")
        self._meta = store.key("meta")
        self._lock = threading.Lock()
        self._copy: tuple[bytes | None, list[tuple[ObjectKey, int]], dict[ObjectKey, int]] | None
        self._copy = None

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        unique = list(dict.fromkeys(pack_key(k) for k in keys))
        if unique:
            self.store.script("pin", [self._pins, self._order, self._meta], unique)
        return len(unique)

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        unique = list(dict.fromkeys(pack_key(k) for k in keys))
        if unique:
            self.store.script("unpin", [self._pins, self._order, self._meta], unique)
        return len(unique)

    def count(self, key: ObjectKey) -> int:
        return self._current()[1].get(key, 0)

    def pinned(self, keys: Iterable[ObjectKey]) -> set[ObjectKey]:
        counts = self._current()[1]
        return {k for k in keys if k in counts}

    def page(
        self,
        cache_salt: str | None,
        model_name: str | None,
        offset: int,
        limit: int,
        *,
        salts: Container[str] | None = None,
    ) -> tuple[int, list[tuple[ObjectKey, int]]]:
        rows = [
            (k, n)
            for k, n in self.rows()
            if (cache_salt is None or k.cache_salt == cache_salt)
            and (model_name is None or k.model_name == model_name)
            and (salts is None or k.cache_salt in salts)
        ]
        return len(rows), rows[offset : offset + limit]

    def rows(self) -> list[tuple[ObjectKey, int]]:
        """Every pinned key and its count, first pinned first."""
        return list(self._current()[0])

    def _current(self) -> tuple[list[tuple[ObjectKey, int]], dict[ObjectKey, int]]:
        version = self.store.call("hget", self._meta, self.VERSION_FIELD)
        with self._lock:
            copy = self._copy
        if copy is not None and copy[0] == version:
            return copy[1], copy[2]
        order, counts, version = self.store.transaction(
            lambda pipe: (
                pipe.zrange(self._order, 0, -1),
                pipe.hgetall(self._pins),
                pipe.hget(self._meta, self.VERSION_FIELD),
            )
        )
        rows = [(unpack_key(f), int(counts[f])) for f in order if f in counts]
        by_key = dict(rows)
        with self._lock:
            self._copy = (version, rows, by_key)
        return rows, by_key

    def seed(self, rows: list[tuple[ObjectKey, int]]) -> None:
        """Write ``rows`` (a snapshot's pins, in order) as they are: counts set, not added."""
        if not rows:
            return

        def build(pipe: Any) -> None:
            pipe.hset(self._pins, mapping={pack_key(k): n for k, n in rows})
            pipe.zadd(self._order, {pack_key(k): i + 1 for i, (k, _n) in enumerate(rows)})
            pipe.hset(self._meta, "pin_seq", len(rows))
            pipe.hincrby(self._meta, self.VERSION_FIELD, 1)

        self.store.transaction(build, write=True)


class SharedQuotaTable:
    """The default limit and each salt's own limit in Redis (:class:`.QuotaTable`'s rules)."""

    DEFAULT_FIELD: Final = "default_limit_gb"

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self._limits = store.key("quotas")
        self._meta = store.key("meta")

    @property
    def default_limit_gb(self) -> float | None:
        return _gb(self.store.call("hget", self._meta, self.DEFAULT_FIELD))

    def set_default(self, limit_gb: float | None) -> None:
        if limit_gb is not None and limit_gb < 0:
            raise ValueError("default_limit_gb must be >= 0 or null")
        if limit_gb is None:
            self.store.call("hdel", self._meta, self.DEFAULT_FIELD, write=True)
        else:
            self.store.call(
                "hset", self._meta, self.DEFAULT_FIELD, repr(float(limit_gb)), write=True
            )

    def set(self, cache_salt: str, limit_gb: float) -> None:
        if limit_gb < 0:
            raise ValueError("limit_gb must be >= 0")
        self.store.call("hset", self._limits, cache_salt, repr(float(limit_gb)), write=True)

    def remove(self, cache_salt: str) -> bool:
        return bool(self.store.call("hdel", self._limits, cache_salt, write=True))

    def own(self, cache_salt: str) -> float | None:
        return _gb(self.store.call("hget", self._limits, cache_salt))

    def effective_gb(self, cache_salt: str) -> float | None:
        own, default = self.store.transaction(
            lambda pipe: (
                pipe.hget(self._limits, cache_salt),
                pipe.hget(self._meta, self.DEFAULT_FIELD),
            )
        )
        return _gb(own) if own is not None else _gb(default)

    def over_limit(self, cache_salt: str, used_bytes: int, watermark: float = 1.0) -> bool:
        limit = self.effective_gb(cache_salt)
        if limit is None:
            return False
        return used_bytes > 0 and used_bytes >= watermark * limit * GB

    def limits(self) -> dict[str, float]:
        raw: dict[bytes, bytes] = self.store.call("hgetall", self._limits)
        return {salt.decode(): float(gb) for salt, gb in raw.items()}


def _gb(raw: bytes | None) -> float | None:
    return None if raw is None else float(raw)
