"""What one engine batch changes in the directory: collected while it is translated
(:class:`Pending`), reduced to its net effect (:func:`net_effect`), then cut into gated
batches whose entries are columns (:func:`entry_columns`: no ``CacheEntry``, ``ObjectKey`` or
token array per chunk). ``AllBlocksCleared`` (:class:`Cleared`) separates the runs; nothing
moves across a clear. See docs/kv-events.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np

from kvatlas.api.events import UNKNOWN_OFFSET
from kvatlas.events import DELETE, STORE
from kvatlas.events.columns import EntryColumns
from kvatlas.keys import pack_kv_rank

ENGINE_RANK: Final = pack_kv_rank(1, 0, 1, 0)
"""The kv_rank of every engine chunk's key (an engine's KV is one whole-model object)."""

Chunk = tuple[bytes, str, int, bytes | None]
"""One engine chunk's change, a plain tuple: (chunk hash, model, token offset, tokens as
big-endian ``uint32`` bytes or ``None``: content not offered). Its key is
``ObjectKey(chunk_hash, model, ENGINE_RANK)``; a delete's offset is unknown, its tokens
``None``."""


def gone(chunk_hash: bytes, model: str) -> Chunk:
    """The delete of an engine chunk."""
    return (chunk_hash, model, UNKNOWN_OFFSET, None)


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: drop every placement of the engine (the directory's fence)."""

    instance_id: str


class Change(NamedTuple):
    """Chunks of one kind (store / delete) for one engine tier, becoming one batch."""

    instance_id: str
    kind: str
    tier: str
    chunks: list[Chunk]


@dataclass(slots=True)
class Pending:
    """Ops collected while translating one batch (adjacent same-kind changes merged; a chunk
    deleted again before anything else is stored is deleted once: every block of an evicted or
    removed chunk names it)."""

    ops: list[Change | Cleared] = field(default_factory=list)
    deleted: tuple[str, str, bytes, str] | None = None  # the last delete added

    def delete(self, instance_id: str, tier: str, chunk_hash: bytes, model: str) -> None:
        what = (instance_id, tier, chunk_hash, model)
        if what != self.deleted:
            self.deleted = what
            self.add(instance_id, DELETE, tier, gone(chunk_hash, model))

    def add(self, instance_id: str, kind: str, tier: str, chunk: Chunk) -> None:
        if kind == STORE:
            self.deleted = None
        last = self.ops[-1] if self.ops else None
        if isinstance(last, Change) and last[:3] == (instance_id, kind, tier):
            last.chunks.append(chunk)
        else:
            self.ops.append(Change(instance_id, kind, tier, [chunk]))


def net_effect(ops: list[Change | Cleared]) -> list[Change | Cleared]:
    """The same changes as their net effect: between two clears, each (instance, tier, key)
    only by its last change, and per instance and tier the deletes before the stores. The
    directory ends in the same state, in a few batches instead of one per change (an engine
    batch that evicts as it stores alternates a delete and a store at every chunk, and each
    block of an evicted chunk deletes it again)."""
    out: list[Change | Cleared] = []
    last: dict[tuple[str, str, bytes, str], tuple[str, Chunk]] = {}

    def flush() -> None:
        runs: dict[tuple[str, str, str], list[Chunk]] = {}
        for (instance_id, tier, _, _), (kind, chunk) in last.items():
            runs.setdefault((instance_id, kind, tier), []).append(chunk)
        for (instance_id, kind, tier), chunks in sorted(
            runs.items(), key=lambda r: r[0][1] != DELETE
        ):
            out.append(Change(instance_id, kind, tier, chunks))
        last.clear()

    for op in ops:
        if isinstance(op, Cleared):
            flush()
            out.append(op)
            continue
        for chunk in op.chunks:
            key = (op.instance_id, op.tier, chunk[0], chunk[1])
            last.pop(key, None)
            last[key] = (op.kind, chunk)
    flush()
    return out


def entry_columns(chunks: list[Chunk]) -> EntryColumns:
    """The chunks as a batch's entries, checked as a decoded body's are
    (:meth:`EntryColumns.checked`: ``ValueError`` if a model name is not a valid key's; the
    subscriber checks it before translating): sizes 0, and the offered tokens in one native
    ``uint32`` arena, converted from big-endian in one call."""
    packed = [c[3] for c in chunks]
    lengths = np.array([0 if p is None else len(p) >> 2 for p in packed], np.int64)
    columns = EntryColumns.checked(
        [c[0] for c in chunks],
        [(c[1], ENGINE_RANK, 0, "") for c in chunks],
        [0] * len(chunks),
        [c[2] for c in chunks],
        np.frombuffer(b"".join([p for p in packed if p]), ">u4").astype(np.uint32),
        np.cumsum(lengths) - lengths,
        lengths,
    )
    if columns is None:
        raise ValueError(f"not a valid model name among {sorted({c[1] for c in chunks})!r:.200}")
    return columns
