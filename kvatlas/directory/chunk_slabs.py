"""Freeing restored token slabs: a collaborator of :class:`~kvatlas.directory.chunk_table.ChunkTable`.

A restore cuts every chunk's content as a read-only view of one slab
(:class:`~kvatlas.directory.token_slab.TokenSlab`). Once more than half of a slab's views are
gone, the table copies the live ones out to arrays of their own, a bounded step per change
(moving the blend index to the copies), and the slab is freed. See docs/directory.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvatlas.directory.blend import AddOp, BlendIndex, BlendOp, RemoveChunkOp
from kvatlas.directory.chunk_counts import PARTS
from kvatlas.directory.chunk_state import ChunkState
from kvatlas.directory.records import rebound, record_indexed, record_offset, record_stored_tokens
from kvatlas.directory.token_slab import TokenSlab
from kvatlas.directory.token_store import owned_copy

_RECLAIM_WORK = 16_384
"""Work per reclaim step (:meth:`SlabReclaim.step`): a record looked at costs 1, a
content copied out of a slab 16, so one step copies at most 1,024 contents."""


@dataclass(slots=True)
class Reclaim:
    """Copying the live contents out of mostly dead token slabs, a bounded step per change
    (the records are visited partition by partition, each partition's keys listed first)."""

    slabs: list[TokenSlab]
    buffers: set[int]  # ids of the slabs' buffers (kept alive by ``slabs``)
    part_no: int = 0
    pending: list[bytes] = field(default_factory=list)


class SlabReclaim:
    """The slab-freeing step of a chunk table's change flush (its collaborator: it changes
    the table's records and queues index writes). Owns the slabs the table's restored
    contents are views of, the copy-out in progress and the slabs copied out."""

    def __init__(self, table: ChunkState) -> None:
        self._table = table
        self.slabs: list[TokenSlab] = []  # restored contents (see token_slab.TokenSlab)
        self.progress: Reclaim | None = None  # a copy-out in progress
        self._released: list[TokenSlab] = []  # copied out: the index must let go of them too

    @property
    def active(self) -> bool:
        """Whether there are slabs to watch or copy out (else :meth:`step` does nothing)."""
        return bool(self.slabs) or self.progress is not None

    def restart(self, slabs: Sequence[TokenSlab]) -> None:
        """Watch ``slabs`` (a restore's) instead of any earlier ones."""
        self.slabs, self.progress, self._released = list(slabs), None, []

    def step(self) -> None:
        """Once more than half of a slab's views are gone, copy its live contents out to
        arrays of their own, a bounded step at a time (queuing the index's moves); then
        nothing refers to it and it is freed. Each slab is copied out at most once (see
        token_slab.TokenSlab)."""
        table = self._table
        r = self.progress
        if r is None:
            due = [s for s in self.slabs if s.mostly_dead()]
            if not due:
                return
            self.slabs = [s for s in self.slabs if s not in due]
            r = self.progress = Reclaim(due, {id(s.buffer) for s in due})
        work = 0
        while work < _RECLAIM_WORK:
            if not r.pending:
                if r.part_no == PARTS:
                    self.progress = None
                    self._released += r.slabs
                    return
                r.pending = list(table.parts[r.part_no])
                r.part_no += 1
                continue
            h = r.pending.pop()
            work += 1
            part = table.parts[h[0]]
            rec = part.get(h)
            tokens = None if rec is None else record_stored_tokens(rec)
            if rec is None or tokens is None or id(tokens.base) not in r.buffers:
                continue
            work += 15
            table.preserve(h, rec)
            owned, offset, indexed = owned_copy(tokens), record_offset(rec), record_indexed(rec)
            if indexed and table.indexing:  # the index holds the view: move it to the copy
                ops: list[BlendOp] = [RemoveChunkOp(tokens, h)]
                ops += [AddOp(owned, h, offset, ns) for ns in table.namespaces(rec)]
                table.queue(ops)
            part[h] = rebound(rec, owned, offset, indexed)

    def release(self, index: BlendIndex | None) -> None:
        """Let go of the slabs copied out (after the index applied the step's writes): the
        index copies out a content several chunks share that is still a view of one."""
        released, self._released = self._released, []
        for slab in released:
            if index is not None:
                index.copy_out(slab.buffer)
