"""Runs of store batches that one bulk store takes.

A body a node posts holds a few batches of its newest chunks, one emitter's, one after the
other (four of 256 entries, as an LMCache node batches them). Stored one by one, each pays the
bulk store's fixed costs; a run of them is stored at once (``StoreRules.store_run``), then
each batch committed at the gate in order, as if applied one by one: the gate admits each
batch of a run once the one before it is committed, with no gap and no fence, and the entries
are stored as each batch would store them (placed as its header says).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvatlas.events import STORE, ColumnBatch


def run_length(batches: Sequence[ColumnBatch], i: int) -> int:
    """How many batches from ``batches[i]`` on form a run: ``batches[i]`` (a store batch the
    gate admits without a fence) and each batch right after it that continues the one
    before: the same emitter's next seq in the same incarnation, a store batch of the same
    tier, backend and sharing."""
    first = prev = batches[i].header
    if first.event_type != STORE:
        return 1
    j = i + 1
    while j < len(batches):
        h = batches[j].header
        if (
            h.event_type != STORE
            or h.seq != prev.seq + 1
            or (h.instance_id, h.incarnation, h.tier, h.backend, h.shared)
            != (first.instance_id, first.incarnation, first.tier, first.backend, first.shared)
        ):
            break
        prev = h
        j += 1
    return j - i
