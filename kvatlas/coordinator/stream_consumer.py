"""Redis Streams transport: read event batches through a consumer group, apply, acknowledge.

Durability argument: an entry is acknowledged only after it was applied; the snapshot records
the last applied stream id; on start the group is rewound to that id (``XGROUP SETID``), so
everything after the snapshot is delivered again. Entries applied after the snapshot but before
a crash come back too, and the gate drops them as duplicates. Nothing is lost, nothing is
applied twice. Each coordinator replica uses its own group and so builds the full view. See
docs/coordinator.md ("Durability and transports").

Start order and Redis restarts: a replica started before Redis serves its snapshot
(``waiting_for_redis``) and joins when Redis appears; after any Redis error it prepares the
group again. A Redis that lost events (restarted without persistence, or from an older RDB
file) is detected (:func:`stream_loss`) and the replica resyncs from the nodes' digests rather
than stay silently wrong; so are entries trimmed from the stream before a running replica read
them (:meth:`StreamConsumer._check_trim`).

One live consumer per group: :mod:`.consumer_group`.

The consumer knows nothing of the service that runs it: it is handed an ingest function, a
callback for the last applied stream id, a readiness setter and a stop event.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter

from kvatlas.auth import Principal
from kvatlas.backoff import Backoff
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.consumer_group import (
    GroupHeld,
    ensure_group_free,
    group_consumers,
    text_of,
)
from kvatlas.coordinator.ingestion import rejection_reason
from kvatlas.coordinator.query import check_entry_count
from kvatlas.coordinator.retention import parse_id, unread_trimmed
from kvatlas.coordinator.views import Readiness
from kvatlas.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    KvatlasError,
    Unauthorized,
    Unavailable,
)
from kvatlas.events import (
    ColumnBatch,
    EventDecodeError,
    EventValidationError,
    decode_stream_columns,
)
from kvatlas.logs import Throttle
from kvatlas.redis_clients import redis_client

log = logging.getLogger(__name__)

READ_COUNT = 256
"""The most entries one read asks for (a stream of small entries: one round trip per 256)."""
READ_BYTES = 8 << 20
"""About how many bytes of entries a read asks for: each read's count is this over the mean
size of the previous read's entries (1 to :data:`READ_COUNT`; :data:`READ_FIRST` before
any). A reply is held whole in memory and parsed at once, so a backlog of large entries
(bodies of a thousand entries, ≈1 MB each in msgpack) read 256 at a time was a reply of
≈280 MB; at ≈8 MB it stays below the allocator's mmap threshold (``c_heap.MMAP_THRESHOLD``)
and its memory is reused read after read instead of mapped and faulted in each time
(docs/performance.md, "Service: design figures")."""
READ_FIRST = 1
"""The count of a consumer's first read, before it has seen an entry's size (an emitter's
entry may be up to 64 batches: tens of MB)."""
BLOCK_MS = 500
LAG_PERIOD_S = 1.0
"""How often a replica that is behind asks Redis how far (``XINFO GROUPS``), and how often a
replica asks whether entries it has not read were trimmed away (:meth:`StreamConsumer._check_trim`)."""
TOUCHES_PER_HEARTBEAT = 4
"""A live consumer shows itself to Redis this often per heartbeat, idle stream or busy: a
read of its own pending entries (``XREADGROUP ... 0``), which refreshes the consumer's idle
time on every Redis version (a blocking read that returns nothing does not before 7.2). Its
blocking read waits at most one such period, and a long apply stops to show itself too."""


RETRY_MAX_S = 2.0
"""The longest wait between attempts to reach Redis (capped further by the touch period)."""


def stream_loss(
    client: Any, stream: str, group: str, position: str | None, *, joined: bool
) -> tuple[str, str | None]:
    """Where the group must (re)start, and why events after ``position`` (the last applied
    id) may be gone from Redis (``None``: nothing was lost).

    Redis forgot entries this replica had applied (the stream's last id lies before
    ``position``: a restart without persistence, or from an older RDB file); the group this
    replica had joined is gone (a restart without persistence, whatever the nodes added since);
    or the group was delivered less than this replica applied (an older RDB file). Entries
    added after such a loss carry ids after what Redis still has, so the group starts at the
    smaller of ``position`` and the stream's last id: nothing still in the stream is skipped,
    nothing applied is delivered again (the gate would drop it anyway)."""
    import redis

    if position is None:
        return "0", None
    try:
        info = client.xinfo_stream(stream)
    except redis.ResponseError as exc:
        if "no such key" not in str(exc):
            raise
        return "0", "the stream is gone"
    last = text_of(info.get("last-generated-id") or b"0-0")
    if parse_id(last) < parse_id(position):
        return last, f"the stream ends at {last}, before the {position} this replica applied"
    groups = {text_of(g["name"]): g for g in client.xinfo_groups(stream)}
    ours = groups.get(group)
    if ours is None:
        return position, "its consumer group is gone" if joined else None
    delivered = text_of(ours.get("last-delivered-id") or b"0-0")
    if parse_id(delivered) < parse_id(position):
        return position, f"the group was delivered up to {delivered} only"
    return position, None


class StreamConsumer:
    """Consumes ``config.event_stream`` from ``position`` (the snapshot's stream id; ``None``
    = from the beginning) until ``stop`` is set.

    ``attribute`` says who an entry's raw fields speak for (a principal; ``None`` with auth
    off), before anything is decoded, or refuses it (unsigned, bad signature); ``ingest``
    applies the decoded batches (entries as columns but a resync's, as ``POST /events``
    bodies) as that principal; ``on_position`` is told each entry id once the entry is
    applied (the snapshot records it); ``set_readiness(SERVING)`` is called once, when the
    consumer first reaches the end of the stream; ``errors`` counts failures by kind
    (``redis``, ``decode``, ``internal``, ``group_held``: another live replica joined the group
    first, and this one stops consuming rather than share it). Every entry passes the checks a
    ``POST /events`` body passes (``--max-batch-entries``; the signer's instances and salts,
    the incarnation bound and the emitter admission inside ``ingest``): a producer with
    stream access cannot do more than the emitter whose key it holds over HTTP. A refused
    entry is counted in ``rejected`` by reason, acknowledged and never applied (entries under
    a salt the signer may not store for are left out by ``ingest``, the rest applied)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        attribute: Callable[[Mapping[bytes, bytes]], Principal | None],
        ingest: Callable[[Principal | None, Sequence[ColumnBatch]], object],
        position: str | None,
        on_position: Callable[[str], None],
        set_readiness: Callable[[Readiness], None],
        stop: threading.Event,
        errors: Counter,
        rejected: Counter,
    ) -> None:
        import redis

        self._redis_mod = redis
        self._attribute = attribute
        self._ingest = ingest
        self._on_position = on_position
        self._set_readiness = set_readiness
        self._stop = stop
        self._errors = errors
        self._rejected = rejected
        self.max_entries = config.max_batch_entries
        self.position = position
        self.stream = config.event_stream
        self.group = config.group_name
        self.heartbeat_s = config.consumer_heartbeat_s
        self._touch_s = config.consumer_heartbeat_s / TOUCHES_PER_HEARTBEAT
        # Back within one touch period of Redis's return: a twin watching the group after a
        # Redis restart sees this replica alive before it would take the group over.
        self.retry_max_s = min(RETRY_MAX_S, self._touch_s)
        self._block_ms = max(1, min(BLOCK_MS, int(self._touch_s * 1000)))
        self._count = READ_FIRST  # the next read's count (read_count)
        self._more = False  # the last read was full: more entries may be waiting
        # One name per process run: a second replica with this group is never taken for us.
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.client = redis_client(config.redis_url or "", socket_timeout=self._block_ms / 1000 + 5)
        self.applied_entries = 0
        self.bad_entries = 0
        self.rejected_entries = 0
        self._say = Throttle(60.0)  # a refusal's WARNING: once a minute a reason
        self.lag_entries: int | None = None
        """Entries of the stream this replica's group has not read (``None``: not known)."""
        self._lag_at = self._trim_at = -math.inf
        self._caught_up = False
        self._shown_at = -math.inf
        self.fatal: Unavailable | None = None
        """Why this replica must not run on (:meth:`run` returned): Redis answered, before it
        was joined, and refused the credentials (as at start-up: ``refuse_held_group``)."""
        self.on_fatal: Callable[[Unavailable], object] = lambda _exc: None
        """Told :attr:`fatal` (``kvatlas coordinator`` stops, exit 1; set it, then read
        :attr:`fatal`: one of the two sees the other)."""

    def _prepare_group(self, joined: bool) -> None:
        """Create the group, or rewind it, to the last applied position ("0" = everything);
        :class:`GroupHeld` if another live replica consumes it; dead consumers are removed
        (what they read unacknowledged lies after the rewound position: it comes again).
        Events Redis lost since (:func:`stream_loss`; ``joined``: this process had joined the
        group before) turn the replica to ``resyncing``."""
        ensure_group_free(self.client, self.stream, self.group, self.heartbeat_s, own=self.consumer)
        if joined:  # a trim past this replica before the error that brought it here
            self._check_trim(now=True)
        start, lost = stream_loss(
            self.client, self.stream, self.group, self.position, joined=joined
        )
        if lost is not None:
            self._errors.labels("lost").inc()
            log.warning(
                "redis lost events of %s after %s (%s): resyncing from the nodes' digests",
                self.stream, self.position, lost,
            )  # fmt: skip
            self._caught_up = False  # the rewound group is read to its end again first
            self._set_readiness(Readiness.RESYNCING)
        try:
            self.client.xgroup_create(self.stream, self.group, id=start, mkstream=True)
        except self._redis_mod.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            self.client.xgroup_setid(self.stream, self.group, id=start)
        # What lies before the position the group starts from is the join's to judge (the
        # restored position against the trim: service._behind_trim; stream_loss above)
        self._check_trim(now=True, count=False)
        self._show_alive(now=True)  # from here on this replica holds the group
        for name, idle_ms in group_consumers(self.client, self.stream, self.group):
            if name != self.consumer and idle_ms >= self.heartbeat_s * 1000:
                self.client.xgroup_delconsumer(self.stream, self.group, name)
                log.info("removed dead consumer %s (idle %d ms) of %s", name, idle_ms, self.group)
        log.info(
            "consuming %s as group %s (consumer %s) from %s",
            self.stream, self.group, self.consumer, start,
        )  # fmt: skip

    def run(self) -> None:
        """Consume until ``stop``. Redis down (not up yet, or restarting) is waited for with
        capped, jittered backoff (one log line per new wait length); after any Redis error the
        group is prepared again (:meth:`_prepare_group`: the twin check, a lost group or
        stream). Readiness: ``waiting_for_redis`` until Redis first answers, ``catching_up``
        once joined, ``serving`` at the end of the stream, ``group_held`` if a live twin holds
        the group."""
        backoff = Backoff(0.1, self.retry_max_s)
        prepared = joined = False
        stop = self._stop
        while not stop.is_set():
            try:
                if not prepared:
                    self._prepare_group(joined)
                    if not joined:
                        self._set_readiness(Readiness.CATCHING_UP)
                    prepared = joined = True
                    backoff.reset()
                caught_up = self._read_once()
                if caught_up and not self._caught_up:
                    self._caught_up = True
                    self._set_readiness(Readiness.SERVING)
                    log.info("caught up with %s at %s", self.stream,
                             self.position or "its start (nothing read yet)")  # fmt: skip
            except GroupHeld as exc:  # a live twin holds the group (joined while we restored)
                self._errors.labels("group_held").inc()
                self._set_readiness(Readiness.GROUP_HELD)
                log.error("not consuming: %s", exc)
                return
            except self._redis_mod.RedisError as exc:
                self._errors.labels("redis").inc()
                if not joined and self._refused(exc):
                    return
                if not joined:
                    self._set_readiness(Readiness.WAITING_FOR_REDIS)
                prepared = False  # Redis may have restarted: check the group and stream again
                if backoff.report():
                    log.warning(
                        "redis stream %s unavailable (%s); serving what this replica holds, "
                        "retrying every %.3g s at most", self.stream, exc, backoff.step,
                    )  # fmt: skip
                stop.wait(backoff.next_wait())
            except Exception:  # a bug: keep the transport alive, the entry stays pending
                self._errors.labels("internal").inc()
                log.exception("stream consumer error; retrying")
                stop.wait(backoff.next_wait())
        if joined:
            self._leave()

    def _refused(self, exc: Exception) -> bool:
        """Whether ``exc`` is Redis refusing the credentials (or an ACL user's command): not an
        outage to wait out but a setting, which stops a replica waiting to join as it stops one
        at start-up (docs/coordinator.md, "Readiness, start order and Redis restarts")."""
        redis = self._redis_mod
        errors = redis.exceptions
        refused = (errors.AuthenticationError, errors.AuthorizationError, errors.NoPermissionError)
        if not isinstance(exc, refused):
            return False
        self.fatal = Unavailable(f"redis refused this coordinator's credentials: {exc}")
        log.error("not starting: %s", self.fatal)
        self.on_fatal(self.fatal)
        return True

    def _leave(self) -> None:
        """A clean stop removes this consumer, so the replica may restart at once."""
        try:
            self.client.xgroup_delconsumer(self.stream, self.group, self.consumer)
        except self._redis_mod.RedisError as exc:
            log.warning("could not remove consumer %s (%s): it expires as dead", self.consumer, exc)

    def _refuse(self, entry_id: bytes, exc: KvatlasError) -> None:
        self.rejected_entries += 1
        reason = rejection_reason(exc)
        self._rejected.labels(reason).inc()
        if self._say(reason):  # (anyone who can write to the stream can add refused entries)
            log.warning(
                "stream entry %s refused (%d refused so far, logged once a minute a reason): %s",
                entry_id.decode(), self.rejected_entries, exc.detail,
            )  # fmt: skip

    def _show_alive(self, now: bool = False) -> None:
        """Refresh this consumer's idle time in Redis, at most once per touch period."""
        if now or time.monotonic() - self._shown_at >= self._touch_s:
            self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=1)
            self._shown_at = time.monotonic()

    def _read_once(self) -> bool:
        """Read, apply and acknowledge one batch of entries; True when the stream had no more.
        A read waits for new entries (up to the block time) only when the one before it
        reached the end: after a full read, whether more follow is asked without waiting, so
        a backlog read to its end is ``serving`` at once, not a block time later."""
        self._show_alive()
        self._check_trim()
        count = self._count
        block = None if self._more else self._block_ms
        reply: Any = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block
        )
        if not reply:
            self.lag_entries = 0
            self._more = False
            return True
        _, entries = reply[0]
        self._count = read_count(entries)
        for entry_id, fields in entries:
            self._apply(entry_id, fields)
            self._show_alive()
        self._more = len(entries) == count
        self._note_lag(not self._more)
        return not self._more

    def _note_lag(self, at_end: bool) -> None:
        """:attr:`lag_entries`: 0 after a read that reached the stream's end; while behind,
        the group's ``lag`` as Redis counts it (``XINFO GROUPS``, Redis 7; ``None`` where it
        cannot tell), asked at most every :data:`LAG_PERIOD_S`."""
        if at_end:
            self.lag_entries = 0
            return
        now = time.monotonic()
        if now - self._lag_at < LAG_PERIOD_S:
            return
        self._lag_at = now
        for row in self.client.xinfo_groups(self.stream):
            if text_of(row["name"]) == self.group:
                lag = row.get("lag")
                self.lag_entries = lag if isinstance(lag, int) else None

    def _check_trim(self, now: bool = False, count: bool = True) -> None:
        """Whether entries this replica has not read were trimmed from the stream (an
        emitter's ``MAXLEN ~ --stream-max-len`` cap or an ``XTRIM`` while it was behind:
        paused, slow, a burst above the cap; :func:`~.retention.unread_trimmed`): counted as
        ``trimmed``, logged, and the replica resyncs as after a Redis that lost events. Asked
        at most every :data:`LAG_PERIOD_S` (``now``: at once); cheap while the group's
        ``lag`` is 0. The group's counter is set right afterwards, so one trim counts once
        (``count`` False: only that, on joining)."""
        if not now and time.monotonic() - self._trim_at < LAG_PERIOD_S:
            return
        self._trim_at = time.monotonic()
        try:
            row = self._group_row(self.client.xinfo_groups(self.stream))
            if row is None or "entries-read" not in row or row.get("lag") == 0:
                return  # no group yet, Redis < 7 (cannot tell), or nothing unread
            pipe = self.client.pipeline(transaction=True)
            pipe.xinfo_stream(self.stream)
            pipe.xinfo_groups(self.stream)
            info, rows = pipe.execute()
        except self._redis_mod.ResponseError as exc:
            if "no such key" in str(exc):
                return  # the stream is gone: stream_loss's to judge when the group is prepared
            raise
        row = self._group_row(rows)
        if row is None or (found := unread_trimmed(info, row)) is None:
            return
        lost, entries_read = found
        delivered = text_of(row.get("last-delivered-id") or b"0-0")
        self.client.xgroup_setid(self.stream, self.group, id=delivered, entries_read=entries_read)
        if not count:
            return
        self._errors.labels("trimmed").inc()
        log.warning(
            "%s entries of %s after %s were trimmed before this replica read them (the "
            "emitters' --stream-max-len or an XTRIM while it was behind): resyncing from the "
            "nodes' digests", "some" if lost is None else lost, self.stream, delivered,
        )  # fmt: skip
        self._caught_up = False  # what the stream still has is read to its end first
        self._set_readiness(Readiness.RESYNCING)

    def _group_row(self, rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
        return next((row for row in rows if text_of(row["name"]) == self.group), None)

    def _apply(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            who = self._attribute(fields)  # the MAC before any decoding
            batches = decode_stream_columns(fields)
        except Unauthorized as exc:
            self._refuse(entry_id, exc)
        except (EventDecodeError, EventValidationError) as exc:
            # A malformed entry can never become valid: skip it rather than block the stream.
            self.bad_entries += 1
            self._errors.labels("decode").inc()
            log.error("stream entry %s rejected: %s", entry_id.decode(), exc)
        else:
            try:
                check_entry_count(batches, self.max_entries)
                self._ingest(who, batches)
            except (InvalidInput, Forbidden, Conflict) as exc:
                self._refuse(entry_id, exc)
            else:
                self.applied_entries += 1
        self.position = entry_id.decode()
        self._on_position(self.position)
        self.client.xack(self.stream, self.group, entry_id)


def read_count(entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]]) -> int:
    """The count of the read after one that returned ``entries`` (not empty): about
    :data:`READ_BYTES` of entries of their mean size, 1 to :data:`READ_COUNT`."""
    size = sum(len(value) for _, fields in entries for value in fields.values())
    return max(1, min(READ_COUNT, READ_BYTES * len(entries) // max(1, size)))
