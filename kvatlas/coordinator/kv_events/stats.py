"""The KV-event links' counters as frozen views (``/healthz`` → ``kv_events``, ``/metrics`` →
``kvatlas_kv_events_<side>_total{counter=…}``). The threads count into a ``Counter`` by field
name; a view is taken field by field, so a reader never iterates a dict being written."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Final, TypeVar


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    batches: int = 0  # engine batches applied
    slices: int = 0  # gated batches they were applied as (at most SLICE_ENTRIES entries each)
    disconnects: int = 0  # publishers' connections closed (gone, or a frame above the limit)
    duplicates: int = 0  # a seq seen again (dropped)
    engine_restarts: int = 0  # a seq going back: new incarnation
    gaps: int = 0  # seq jumps not recovered
    missing_batches: int = 0  # the batches they lost
    replayed_batches: int = 0
    replay_failures: int = 0
    clears: int = 0  # AllBlocksCleared
    blocks_stored: int = 0
    blocks_removed: int = 0
    chunks_stored: int = 0
    chunks_removed: int = 0
    unknown_parents: int = 0  # BlockStored skipped: parent never seen
    block_size_changes: int = 0  # BlockStored skipped: its blocks straddle a chunk boundary
    unknown_removed_blocks: int = 0
    unindexable_chunks: int = 0  # extra keys / adapter the scheme cannot carry
    other_group_blocks: int = 0  # KV-cache groups other than 0
    tokenless_blocks: int = 0  # BlockStored skipped: no token ids (an offload's placeholder)
    evicted_blocks: int = 0  # beyond --kv-events-max-blocks
    errors: int = 0  # unexpected exceptions (logged)
    rejected_frames: int = 0
    rejected_topic: int = 0  # no engine or model in it
    rejected_foreign: int = 0  # names a node, another endpoint's engine, or not this one's
    rejected_engine_cap: int = 0  # one engine more than the endpoint may speak for
    rejected_malformed: int = 0
    rejected_unknown_event: int = 0
    rejected_invalid: int = 0
    rejected_block_size: int = 0
    rejected_token_range: int = 0
    rejected_too_many_blocks: int = 0
    engines: int = 0  # gauges from here on
    tracked_blocks: int = 0
    max_blocks: int = 0  # --kv-events-max-blocks: tracked_blocks at it means evicted_blocks grows


@dataclass(frozen=True, slots=True)
class PublisherStats:
    messages: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    replay_requests: int = 0
    replayed_messages: int = 0
    errors: int = 0
    dropped_batches: int = 0  # waiting beyond the bound (republished by the overflow's resync)
    overflows: int = 0
    withheld_entries: int = 0  # under a cache salt the stream may not show
    seq: int = 0  # gauges from here on
    queued: int = 0
    queued_entries: int = 0


@dataclass(frozen=True, slots=True)
class KvEventsStats:
    subscriber: SubscriberStats | None
    publisher: PublisherStats | None


GAUGES: Final = frozenset(
    {"engines", "tracked_blocks", "max_blocks", "seq", "queued", "queued_entries"}
)
REJECT_KINDS: Final = tuple(
    f.name.removeprefix("rejected_")
    for f in fields(SubscriberStats)
    if f.name.startswith("rejected_")
)
_S = TypeVar("_S", SubscriberStats, PublisherStats)


def zeroed(cls: type[Any]) -> Counter[str]:
    """A counter with every counted field of ``cls`` at zero."""
    return Counter({f.name: 0 for f in fields(cls) if f.name not in GAUGES})


def view(cls: type[_S], *counts: Counter[str], **gauges: int) -> _S:
    """``cls`` from the sum of ``counts`` (looked up field by field) and the gauges."""
    values = {f.name: sum(c[f.name] for c in counts) for f in fields(cls) if f.name not in GAUGES}
    return cls(**values, **gauges)
