"""Stream retention (convergence.md §2): the event stream keeps what some replica still needs,
and no more.

Each replica with durable snapshots records, in the Redis hash ``<stream>:replicas`` (field:
its consumer group, value: a stream id), the position its last snapshot covers; after each
snapshot it trims the stream by ``MINID`` to the smallest recorded position — the oldest entry
any registered replica would replay after a restart. Emitters cap the stream on their side with
an approximate ``MAXLEN`` (``--stream-max-len``), so a replica that stays away for too long
cannot make the stream grow without bound: when it comes back, the entries after its snapshot
may be gone (:meth:`StreamRetention.trimmed_after`), and it rebuilds through resync instead of
replay (readiness ``resyncing``). The cap also trims what a running replica that fell behind
has not read: :func:`unread_trimmed` tells, from Redis 7's counters.

A replica with snapshots registers when it starts (:meth:`StreamRetention.register`: what it
restored, ``0-0`` without a snapshot), so it is never unprotected before its first record. A
replica without snapshots does not register (a restart replays nothing it kept; it always
relies on resync after a trim). A replica retired for good must have its field removed
(``HDEL <stream>:replicas <group>``), or it holds trimming back (the MAXLEN cap still bounds
the stream).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from kvatlas.backoff import Backoff
from kvatlas.errors import Unavailable
from kvatlas.redis_clients import redis_client

log = logging.getLogger(__name__)


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    """A stream id ``ms-seq`` as a comparable pair (``ValueError`` if it is not one)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class StreamRetention:
    """The replica registry and the ``MINID`` trimmer of one stream, for one replica."""

    def __init__(self, client: Any, stream: str, replica: str) -> None:
        """``client`` is a ``redis.Redis``; its errors surface as :class:`Unavailable`."""
        import redis

        self._errors = redis.RedisError
        self.client = client
        self.stream = stream
        self.replica = replica
        self.key = f"{stream}:replicas"

    @classmethod
    def connect(cls, redis_url: str, stream: str, replica: str) -> StreamRetention:
        """A retention over a new client of ``redis_url`` (connects lazily)."""
        return cls(redis_client(redis_url, socket_timeout=5), stream, replica)

    def record(self, position: str) -> None:
        """This replica's last durable snapshot covers the stream up to ``position``."""
        self._call("hset", self.key, self.replica, position)

    def register(self, position: str | None) -> bool:
        """At start-up: this replica needs the stream from ``position`` (what it restored;
        ``None``: everything, recorded as ``0-0``) unless its previous run recorded a position
        already (never newer than its snapshot, ``HSETNX``). Without it, a replica that dies
        before its first snapshot records anything would have its entries trimmed by the
        others. Returns whether a record was added."""
        return bool(self._call("hsetnx", self.key, self.replica, position or "0-0"))

    def register_when_reachable(self, position: str | None, stop: threading.Event) -> None:
        """:meth:`register`, retried with :class:`~kvatlas.backoff.Backoff` while Redis is
        away, until it succeeds or ``stop`` is set."""
        backoff = Backoff(0.1, 2.0)
        while not stop.is_set():
            try:
                self.register(position)
                return
            except Unavailable as exc:
                log.debug("retention registration postponed: %s", exc)
                stop.wait(backoff.next_wait())

    def needed(self) -> str | None:
        """The oldest position a registered replica still needs (``None``: none registered)."""
        positions: dict[bytes, bytes] = self._call("hgetall", self.key)
        valid = []
        for replica, pos in positions.items():
            try:
                valid.append((parse_id(pos), pos.decode()))
            except ValueError:
                log.warning("ignoring %s in %s: bad stream id %r", replica, self.key, pos)
        return min(valid)[1] if valid else None

    def trim(self) -> int:
        """Trim the stream by ``MINID`` to :meth:`needed`; returns the entries removed."""
        oldest = self.needed()
        if oldest is None:
            return 0
        removed: int = self._call("xtrim", self.stream, minid=oldest, approximate=False)
        if removed:
            log.info("trimmed %d entries of %s before %s", removed, self.stream, oldest)
        return removed

    def trimmed_after(self, position: str | None) -> bool:
        """Whether entries after ``position`` (``None``: the beginning) may have been trimmed
        away, i.e. replaying from there could miss some. Conservative: the stream's first entry
        lying after ``position`` counts (our own trimming always keeps ``position`` itself), so
        does an empty stream whose last id lies after it. Redis 7.0 records no id for trims
        (``max-deleted-entry-id`` stays ``0-0``), hence the comparison with what is left."""
        info: dict[Any, Any] = self._call("xinfo_stream", self.stream)
        length = int(info.get("length", 0))
        if position is None:
            added = info.get("entries-added")  # Redis >= 7
            return added is not None and int(added) > length
        if length == 0:
            return parse_id(info.get("last-generated-id") or "0-0") > parse_id(position)
        first = info.get("first-entry")
        return first is not None and parse_id(first[0]) > parse_id(position)

    def behind(self, position: str | None) -> bool:
        """:meth:`trimmed_after`, logged when true; False when Redis cannot tell right now
        (replay is then all a replica can do)."""
        try:
            behind = self.trimmed_after(position)
        except Unavailable as exc:
            log.warning("could not tell whether the stream was trimmed: %s", exc)
            return False
        if behind:
            log.warning(
                "entries of %s after position %s were trimmed: rebuilding through resync",
                self.stream, position,
            )  # fmt: skip
        return behind

    def _call(self, command: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, command)(*args, **kwargs)
        except self._errors as exc:
            raise Unavailable(f"redis {command} on {self.stream}: {exc}") from exc


def unread_trimmed(
    stream: Mapping[str, Any], group: Mapping[str, Any]
) -> tuple[int | None, int] | None:
    """Entries trimmed from the stream before ``group`` read them, from one consistent
    ``XINFO STREAM`` and ``XINFO GROUPS`` row (Redis >= 7: ``entries-added``, the group's
    ``entries-read``); ``None`` when none were (or Redis cannot tell). Else ``(lost,
    entries_read)``: how many (``None``: some, Redis cannot count them: the group's counter is
    not valid, and the stream's first entry lies after its last delivered id) and the
    group's counter that makes its ``lag`` right again (``XGROUP SETID ... ENTRIESREAD``, so
    one trim is counted once). Retention's ``MINID`` never trims past a replica's delivered id
    (what it records is what its snapshot covers, at most what it applied): these are the
    emitters' ``MAXLEN ~`` cap or an operator's ``XTRIM`` past a replica that fell behind."""
    added = stream.get("entries-added")
    if added is None:
        return None
    delivered = parse_id(group.get("last-delivered-id") or "0-0")
    length = int(stream.get("length", 0))
    behind = delivered < parse_id(stream.get("last-generated-id") or "0-0")
    unread = 0
    if behind:
        first = stream.get("recorded-first-entry-id") or (stream.get("first-entry") or [None])[0]
        if length and first is not None and parse_id(first) <= delivered:
            return None  # the stream still holds everything after the group's position
        unread = length  # everything the stream holds lies after it
    entries_read = int(added) - unread
    read = group.get("entries-read")
    if isinstance(read, int):
        return (entries_read - read, entries_read) if entries_read > read else None
    return (None, entries_read) if behind else None  # caught up: Redis's estimate is exact


__all__ = ["StreamRetention", "parse_id", "unread_trimmed"]
