"""Ingest gate: per-emitter ordering, duplicate suppression and incarnation fencing.

The gate only *decides* (:meth:`IngestGate.admit`) and *records* (:meth:`IngestGate.commit`);
the directory applies the batch between the two while holding its lock, so a batch and its
cursor move together (atomic per batch). A gap is applied, not held back: a missing batch
cannot be re-requested, and refusing the next ones would only make the directory staler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvatlas.events import EventBatch
from kvatlas.events.model import U64_MAX


class Outcome(enum.StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's verdict for one batch, before anything is applied."""

    outcome: Outcome
    fence_first: bool = False  # higher incarnation: drop the old incarnation's L1 first
    missing: int = 0  # batches skipped before this one (a gap)


@dataclass(frozen=True, slots=True)
class GapRecord:
    incarnation: int
    after_seq: int  # last seq seen before the gap
    seq: int  # first seq after the gap


@dataclass(slots=True)
class EmitterCursor:
    """Where one emitter stands; gap counters survive restarts until deregistration
    (``missing_batches`` stops at 2^64 − 1, the most a snapshot encodes)."""

    incarnation: int
    last_seq: int
    gaps: int = 0
    missing_batches: int = 0
    last_gap: GapRecord | None = None

    def copy(self) -> EmitterCursor:
        return EmitterCursor(
            self.incarnation, self.last_seq, self.gaps, self.missing_batches, self.last_gap
        )


_APPLY = Admission(Outcome.APPLIED)
_DUPLICATE = Admission(Outcome.DUPLICATE)
_STALE = Admission(Outcome.STALE)


class IngestGate:
    """Cursors per ``instance_id``; not thread-safe on its own (the directory's lock covers it)."""

    def __init__(self) -> None:
        self._cursors: dict[str, EmitterCursor] = {}

    def admit(self, batch: EventBatch) -> Admission:
        """Decide without changing anything."""
        cur = self._cursors.get(batch.instance_id)
        if cur is None:
            return Admission(Outcome.APPLIED, False, batch.seq - 1)
        if batch.incarnation < cur.incarnation:
            return _STALE
        if batch.incarnation > cur.incarnation:
            return Admission(Outcome.APPLIED, True, batch.seq - 1)
        if batch.seq <= cur.last_seq:
            return _DUPLICATE
        missing = batch.seq - cur.last_seq - 1
        return _APPLY if missing == 0 else Admission(Outcome.APPLIED, False, missing)

    def commit(self, batch: EventBatch, admission: Admission) -> None:
        """Advance the cursor after ``batch`` was applied (no-op for dropped batches)."""
        if admission.outcome is not Outcome.APPLIED:
            return
        cur = self._cursors.get(batch.instance_id)
        if cur is None:
            cur = self._cursors[batch.instance_id] = EmitterCursor(batch.incarnation, 0)
        elif admission.fence_first:
            cur.incarnation, cur.last_seq = batch.incarnation, 0
        if admission.missing or batch.dropped_events:  # events the emitter dropped: a gap too
            cur.gaps += 1
        if admission.missing:
            cur.missing_batches = min(U64_MAX, cur.missing_batches + admission.missing)
            cur.last_gap = GapRecord(batch.incarnation, cur.last_seq, batch.seq)
        cur.last_seq = batch.seq

    def forget(self, instance_id: str) -> None:
        self._cursors.pop(instance_id, None)

    def cursor(self, instance_id: str) -> EmitterCursor | None:
        cur = self._cursors.get(instance_id)
        return None if cur is None else cur.copy()

    def cursors(self) -> dict[str, EmitterCursor]:
        """A copy of every cursor (for snapshots, stats and the instances API)."""
        return {name: cur.copy() for name, cur in self._cursors.items()}

    def restore(self, cursors: dict[str, EmitterCursor]) -> None:
        self._cursors = {name: cur.copy() for name, cur in cursors.items()}
