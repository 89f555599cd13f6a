"""Pins and quotas kept in Redis (:mod:`.shared_store`): the same methods as :class:`.PinTable`
and :class:`.QuotaTable`, every read from Redis (pins: a copy kept up to date from the log of
changes), every change one atomic step there, so every replica answers the same the moment a
change is acknowledged.

A key is packed as msgpack ``(chunk hash bytes, model, kv_rank, object group, salt)``: one
byte string per key, the same for every replica, decoded back to an :class:`ObjectKey`.
"""

from __future__ import annotations

import secrets
import struct
import threading
from collections.abc import Container, Iterable, Iterator
from typing import Any, Final

import msgspec

from kvatlas.coordinator.cache_control.quotas import GB
from kvatlas.coordinator.cache_control.shared_store import SharedStore
from kvatlas.errors import Unavailable
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


LOG_WEIGHT: Final = 65_536
"""What ``pins:log`` keeps: changes of at most this many keys in all (each counts its keys + 1),
the oldest dropped first; a single larger change is not logged (replicas read every pin)."""
_ENTRY_HEAD: Final = struct.Struct(">Idd")


def _changes(blob: bytes) -> Iterator[tuple[bytes, int, int]]:
    """One ``pins:log`` entry's keys: (packed key, count now, first-pinned seq or -1)."""
    at = 0
    while at < len(blob):
        size, count, seq = _ENTRY_HEAD.unpack_from(blob, at)
        at += _ENTRY_HEAD.size
        yield blob[at : at + size], int(count), int(seq)
        at += size


class SharedPinTable:
    """Reference counts per key in Redis, in first-pinned order (:class:`.PinTable`'s rules).
    Reads come from a copy of every pin, brought up to date only when ``meta.pins_version``
    moved (one ``HGET`` per read otherwise): a node's pin pages, delete and eviction checks stay
    at memory speed while nobody pins. A change is applied to the copy from ``pins:log`` (the
    keys each change touched, with their counts then); every pin is read again only at the
    first read, after a seed, or when the log no longer holds every change since the copy's
    version (this replica fell behind more than :data:`LOG_WEIGHT` keys of changes)."""

    VERSION_FIELD: Final = "pins_version"
    EPOCH_FIELD: Final = "pins_epoch"
    """Set by the first change (or seed) a Redis holds: a copy of another epoch is read anew
    (a Redis that lost its data counts versions from 0 again)."""

    def __init__(self, store: SharedStore, *, log_weight: int = LOG_WEIGHT) -> None:
        self.store = store
        self.log_weight = log_weight
        self._pins = store.key("pins")
        self._order = store.key("pins:order")
        self._meta = store.key("meta")
        self._log = store.key("pins:log")
        self._lock = threading.Lock()
        self._version: int | None = None  # of the copy (None: none yet)
        self._epoch: bytes | None = None  # of the copy
        self._counts: dict[ObjectKey, int] = {}  # the copy, in first-pinned order
        self.full_reads = 0
        """How many times every pin was read (the first read, a seed, a gap in the log)."""

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        return self._change("pin", keys)

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        return self._change("unpin", keys)

    def _change(self, script: str, keys: Iterable[ObjectKey]) -> int:
        unique = list(dict.fromkeys(pack_key(k) for k in keys))
        if unique:
            self.store.script(
                script, [self._pins, self._order, self._meta, self._log],
                [self.log_weight, *unique],
            )  # fmt: skip
        return len(unique)

    def count(self, key: ObjectKey) -> int:
        self._refresh()
        with self._lock:
            return self._counts.get(key, 0)

    def pinned(self, keys: Iterable[ObjectKey]) -> set[ObjectKey]:
        self._refresh()
        with self._lock:
            counts = self._counts
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
        self._refresh()
        with self._lock:
            return list(self._counts.items())

    def _refresh(self) -> None:
        """Bring the copy up to the version Redis holds: the changes since from the log, or
        every pin when the log cannot say."""
        try:
            raw, epoch = self.store.call("hmget", self._meta, self.VERSION_FIELD, self.EPOCH_FIELD)
            version = int(raw or 0)
            with self._lock:  # a copy of a Redis never changed (no epoch yet) is the empty
                mine = self._epoch  # state every epoch's log starts from
                same = mine == epoch or (mine is None and self._version == 0)
                have = self._version if same else None
            if have == version and mine == epoch:
                return
            if have is not None and self._apply_log(have, mine, epoch):
                return
            self._read_all()
        except Unavailable:
            with self._lock:  # Redis may come back holding other pins: read every pin then
                self._version = None
            raise

    def _apply_log(self, have: int, mine: bytes | None, epoch: bytes | None) -> bool:
        """Apply the logged changes of ``epoch`` after version ``have`` to the copy (of
        ``mine``: ``epoch``, or none at version 0); ``False`` when the log lacks one of them
        (trimmed, too large to log, a seed) or the copy moved meanwhile."""
        entries, raw, now_epoch = self.store.transaction(
            lambda pipe: (
                pipe.zrangebyscore(self._log, f"({have}", "+inf"),
                pipe.hget(self._meta, self.VERSION_FIELD),
                pipe.hget(self._meta, self.EPOCH_FIELD),
            )
        )
        if now_epoch != epoch:
            return False
        version = int(raw or 0)
        found: list[bytes] = []
        for expected, member in enumerate(entries, have + 1):
            v, _weight, blob = member.split(b":", 2)
            if int(v) != expected:
                return False
            found.append(blob)
        if have + len(found) != version:
            return False
        with self._lock:
            if self._version != have or self._epoch != mine:  # another thread, meanwhile
                return (
                    self._epoch == epoch and self._version is not None and self._version >= version
                )
            counts = self._counts
            self._version = None  # until every change is in
            for blob in found:
                for packed, count, seq in _changes(blob):
                    key = unpack_key(packed)
                    if count <= 0:
                        counts.pop(key, None)
                    elif seq < 0:
                        if key not in counts:
                            return False  # not the copy the change was made to: read all
                        counts[key] = count
                    else:  # pinned anew: last in first-pinned order
                        counts.pop(key, None)
                        counts[key] = count
            self._version, self._epoch = version, epoch
        return True

    def _read_all(self) -> None:
        order, counts, raw, epoch = self.store.transaction(
            lambda pipe: (
                pipe.zrange(self._order, 0, -1),
                pipe.hgetall(self._pins),
                pipe.hget(self._meta, self.VERSION_FIELD),
                pipe.hget(self._meta, self.EPOCH_FIELD),
            )
        )
        copy = {unpack_key(f): int(counts[f]) for f in order if f in counts}
        with self._lock:
            self._counts, self._version, self._epoch = copy, int(raw or 0), epoch
            self.full_reads += 1

    def seed(self, rows: list[tuple[ObjectKey, int]]) -> None:
        """Write ``rows`` (a snapshot's pins, in order) as they are: counts set, not added
        (not logged: replicas read every pin after it)."""
        if not rows:
            return

        def build(pipe: Any) -> None:
            pipe.hset(self._pins, mapping={pack_key(k): n for k, n in rows})
            pipe.zadd(self._order, {pack_key(k): i + 1 for i, (k, _n) in enumerate(rows)})
            pipe.hset(self._meta, "pin_seq", len(rows))
            pipe.hsetnx(self._meta, self.EPOCH_FIELD, secrets.token_hex(8))
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
        value = None if limit_gb is None else repr(float(limit_gb))
        self.store.set_field("meta", self.DEFAULT_FIELD, value)

    def set(self, cache_salt: str, limit_gb: float) -> None:
        if limit_gb < 0:
            raise ValueError("limit_gb must be >= 0")
        self.store.set_field("quotas", cache_salt, repr(float(limit_gb)))

    def remove(self, cache_salt: str) -> bool:
        return bool(self.store.set_field("quotas", cache_salt, None))

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
