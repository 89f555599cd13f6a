"""Ingestion: every transport's batches (``POST /events``, the Redis stream, vLLM KV events)
through one admission and the gate.

Admission is decided for the whole request before anything is applied — the incarnation bound
(:func:`~kvatlas.coordinator.emitters.check_incarnations`), the engine namespace and the
emitter cap (:func:`~kvatlas.coordinator.emitters.admit`) — so a refused request changes
nothing; then each batch goes through the gate atomically. Engines (the KV-event subscriber's
batches) are capped per endpoint, never against nodes' capacity. See docs/coordinator.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvatlas.auth import Principal, TokenAuth
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.emitters import (
    EmitterBook,
    IncarnationAhead,
    admit,
    check_incarnations,
)
from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.kv_events.links import KvEventsLinks
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.query import refused_salts, salt_entries
from kvatlas.coordinator.stream_auth import UnsignedEntry
from kvatlas.directory import IngestCounts, KeyDirectory, Outcome
from kvatlas.errors import Conflict, Forbidden, KvatlasError, Unauthorized
from kvatlas.events import RESYNC, ColumnBatch, EventBatch
from kvatlas.logs import Throttle

log = logging.getLogger(__name__)

LIVE_STALE_S = 60.0
"""A stale batch sent this recently (its ``ts``) is a live process's, logged (older ones are
history: a replica reading the stream after a restart)."""


def rejection_reason(exc: KvatlasError) -> str:
    """The ``reason`` label of a refused stream entry or ``POST /events`` body
    (docs/security.md, "Redis transport")."""
    if isinstance(exc, UnsignedEntry):
        return "unsigned"
    if isinstance(exc, Unauthorized):
        return "bad_signature"
    if isinstance(exc, IncarnationAhead):
        return "incarnation_ahead"
    if isinstance(exc, Forbidden):  # an instance outside the sender's, unregistered; a salt
        return "cache_salt" if exc.extra.get("cache_salts") else "forbidden"
    if isinstance(exc, Conflict):
        return "emitter_cap"
    return "too_large" if exc.status == 413 else "invalid"


def refuse_engine_ids(instance_ids: Iterable[str], is_engine: Callable[[str], bool]) -> None:
    """Engine ids are their own namespace: a node (or its emitter) under one is refused."""
    for instance_id in sorted(instance_ids):
        if is_engine(instance_id):
            raise Conflict(
                f"{instance_id!r} is a vLLM engine's id (KV events): nodes use other ids"
            )


@dataclass(slots=True)
class Ingestion:
    config: CoordinatorConfig
    directory: KeyDirectory
    instances: InstanceRegistry
    emitters: EmitterBook
    metrics: CoordinatorMetrics
    auth: TokenAuth | None
    clock: Callable[[], float]
    kv_events: KvEventsLinks | None = None  # set once the links exist (they ingest through us)
    stale_runs: dict[str, int] = field(default_factory=dict)
    """Live stale batches in a row, by instance (until one of its batches is applied)."""
    salt_refused: int = 0
    """Entries of stream entries left out for their salt (:meth:`ingest_as`), listings not."""
    _say: Throttle = field(default_factory=lambda: Throttle(60.0))

    def ingest(
        self,
        batches: Sequence[EventBatch | ColumnBatch],
        *,
        registered: bool = True,
        engine: bool = False,
    ) -> IngestCounts:
        """Apply batches (wire bodies as columns) through the gate, each atomically, in one
        directory call, after the request's admission (``registered=False``: no
        registration check; ``engine``: the KV-event subscriber's, capped per endpoint)."""
        decoded = [b if isinstance(b, ColumnBatch) else ColumnBatch.of(b) for b in batches]
        headers = [b.header for b in decoded]
        check_incarnations(headers, time.time_ns() + int(self.config.max_clock_skew_s * 1e9))
        if not engine:
            self._admit(headers, registered)
        applied = duplicates = stale = 0
        now, tick = time.time(), self.clock()
        self.emitters.received(headers, tick)
        for cb, outcome in zip(decoded, self.directory.apply_columns(decoded), strict=True):
            batch = cb.header
            self.metrics.batches.labels(batch.instance_id, outcome.value).inc()
            if outcome is Outcome.APPLIED:
                applied += 1
                self.stale_runs.pop(batch.instance_id, None)
                if batch.event_type == RESYNC:
                    self.instances.digest_done(batch.instance_id)
                self.metrics.entries.inc(cb.n_entries)
                self.emitters.applied(batch, now, tick)
            elif outcome is Outcome.DUPLICATE:
                duplicates += 1
            else:
                stale += 1
                if abs(now - batch.ts) < LIVE_STALE_S:
                    self._stale(batch)
        return IngestCounts(applied, duplicates, stale)

    def _stale(self, batch: EventBatch) -> None:
        """A live batch refused as stale: logged at the first of a run and every power of two
        after (the metric counts each)."""
        n = self.stale_runs[batch.instance_id] = self.stale_runs.get(batch.instance_id, 0) + 1
        if n & (n - 1):
            return
        cursor = self.directory.gap_state(batch.instance_id)
        log.warning(
            "%s: %d live batch(es) in a row refused as stale: incarnation %d, older than the "
            "%s it follows. Two processes emit as %s (two nodes given one --instance-id: each "
            "start fences the other's copies), or it restarted with its clock stepped back "
            "(an incarnation is the emitter's start time): its copies are not seen until it "
            "restarts with a later clock, under its own id",
            batch.instance_id, n, batch.incarnation,
            "incarnation" if cursor is None else f"incarnation {cursor.incarnation}",
            batch.instance_id,
        )  # fmt: skip

    def ingest_as(
        self, who: Principal | None, batches: Sequence[EventBatch | ColumnBatch]
    ) -> IngestCounts:
        """Apply a stream entry's batches as ``who`` (its signer; ``None``: auth off): the
        checks of ``POST /events``. An instance the signer may not act for refuses the entry
        whole; entries under a salt it may not store for are left out, the rest applied,
        every batch's seq with it (over HTTP the node's sink does this after a 403; a stream
        entry's producer cannot be answered, and refusing the entry whole lost the allowed
        salts' entries and left a gap, whose digest exchange listed the same salts and was
        refused again). A signed entry stands for a registration: a replica that never saw
        the node register (it registered with another one) admits its entries all the same."""
        if who is None:
            return self.ingest(batches)
        columns = [b if isinstance(b, ColumnBatch) else ColumnBatch.of(b) for b in batches]
        foreign = refused_salts(who, columns)
        if not foreign:
            return self.ingest(columns, registered=False)
        counts = self.ingest([b.without_salts(foreign) for b in columns], registered=False)
        self._left_out(who, columns, foreign)  # (not when the entry was refused whole)
        return counts

    def _left_out(
        self, who: Principal, batches: Sequence[ColumnBatch], salts: frozenset[str]
    ) -> None:
        """Count (a resync's listing not again) and log, once a minute per signer and salt,
        entries of a stream entry left out for their salt."""
        n = salt_entries(batches, salts)
        self.metrics.refused_entries.labels("stream", "cache_salt").inc(n)
        self.salt_refused += n
        instances = sorted({b.header.instance_id for b in batches})
        for salt in sorted(salts):
            if self._say(f"{who.name} {salt}"):
                log.warning(
                    "stream entries of %s signed by %r hold keys under cache_salt %r, which "
                    "that token may not store for: applied without them (%d such entries so "
                    "far; logged once a minute per token and salt; give the node's coordinator "
                    "token the salt, or store no KV under it)",
                    ", ".join(instances), who.name, salt, self.salt_refused,
                )  # fmt: skip

    def _admit(self, batches: Sequence[EventBatch], registered: bool) -> None:
        """Refuse the whole request when it would add an emitter under an engine's id, or one
        the directory cannot take; engines do not count against nodes' capacity."""
        directory = self.directory
        new = {b.instance_id for b in batches if directory.gap_state(b.instance_id) is None}
        if not new:
            return
        engines = 0
        if self.kv_events is not None:
            refuse_engine_ids(new, self.kv_events.is_engine)
            engines = sum(directory.gap_state(e) is not None for e in self.kv_events.engines())
        known = self.instances.known if self.auth is not None and registered else None
        admit(new, len(directory.emitters()) - engines, known, self.config.max_instances)
