"""What one engine batch changes in the directory: collected while it is translated
(:class:`Pending`), then reduced to its net effect (:func:`net_effect`) before it is cut into
gated batches. ``AllBlocksCleared`` (:class:`Cleared`) separates the runs; nothing moves across
a clear. See docs/kv-events.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvatlas.events import DELETE, STORE, CacheEntry
from kvatlas.keys import ObjectKey


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: drop every placement of the engine (the directory's fence)."""

    instance_id: str


class Change(NamedTuple):
    """Entries of one kind (store / delete) for one engine tier, becoming one batch."""

    instance_id: str
    kind: str
    tier: str
    entries: list[CacheEntry]


@dataclass(slots=True)
class Pending:
    """Ops collected while translating one batch (adjacent same-kind changes merged; a chunk
    deleted again before anything else is stored is deleted once: every block of an evicted or
    removed chunk names it)."""

    ops: list[Change | Cleared] = field(default_factory=list)
    deleted: tuple[str, str, ObjectKey] | None = None  # the last delete added

    def delete(self, instance_id: str, tier: str, entry: CacheEntry) -> None:
        what = (instance_id, tier, entry.key)
        if what != self.deleted:
            self.deleted = what
            self.add(instance_id, DELETE, tier, entry)

    def add(self, instance_id: str, kind: str, tier: str, entry: CacheEntry) -> None:
        if kind == STORE:
            self.deleted = None
        last = self.ops[-1] if self.ops else None
        if isinstance(last, Change) and last[:3] == (instance_id, kind, tier):
            last.entries.append(entry)
        else:
            self.ops.append(Change(instance_id, kind, tier, [entry]))


def net_effect(ops: list[Change | Cleared]) -> list[Change | Cleared]:
    """The same changes as their net effect: between two clears, each (instance, tier, key)
    only by its last change, and per instance and tier the deletes before the stores. The
    directory ends in the same state, in a few batches instead of one per change (an engine
    batch that evicts as it stores alternates a delete and a store at every chunk, and each
    block of an evicted chunk deletes it again)."""
    out: list[Change | Cleared] = []
    last: dict[tuple[str, str, ObjectKey], tuple[str, CacheEntry]] = {}

    def flush() -> None:
        runs: dict[tuple[str, str, str], list[CacheEntry]] = {}
        for (instance_id, tier, _), (kind, entry) in last.items():
            runs.setdefault((instance_id, kind, tier), []).append(entry)
        for (instance_id, kind, tier), entries in sorted(
            runs.items(), key=lambda r: r[0][1] != DELETE
        ):
            out.append(Change(instance_id, kind, tier, entries))
        last.clear()

    for op in ops:
        if isinstance(op, Cleared):
            flush()
            out.append(op)
            continue
        for entry in op.entries:
            key = (op.instance_id, op.tier, entry.key)
            last.pop(key, None)
            last[key] = (op.kind, entry)
    flush()
    return out
