"""Freeing restored token slabs: a base class of :class:`~kvatlas.directory.chunk_table.ChunkTable`.

A restore cuts every chunk's content as a read-only view of one slab
(:class:`~kvatlas.directory.token_store.TokenSlab`). Once more than half of a slab's views are
gone, the table copies the live ones out to arrays of their own, a bounded step per change
(moving the blend index to the copies), and the slab is freed. See docs/directory.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvatlas.directory.blend import AddOp, BlendIndex, RemoveChunkOp
from kvatlas.directory.chunk_counts import PARTS, Partition
from kvatlas.directory.chunk_removals import RemovalRules
from kvatlas.directory.records import rebound, record_indexed, record_offset, record_stored_tokens
from kvatlas.directory.token_store import TokenSlab, owned_copy

_RECLAIM_WORK = 16_384
"""Work per reclaim step (:meth:`ChunkTable.flush_index`): a record looked at costs 1, a
content copied out of a slab 16, so one step copies at most 1,024 contents."""


@dataclass(slots=True)
class _Reclaim:
    """Copying the live contents out of mostly dead token slabs, a bounded step per change
    (the records are visited partition by partition, each partition's keys listed first)."""

    slabs: list[TokenSlab]
    buffers: set[int]  # ids of the slabs' buffers (kept alive by ``slabs``)
    part_no: int = 0
    pending: list[bytes] = field(default_factory=list)


class SlabReclaim(RemovalRules):
    """The slab-freeing step of the chunk table's change flush (a base class: it changes
    the table's records and queued index writes)."""

    parts: list[Partition]
    slabs: list[TokenSlab]
    released: list[TokenSlab]
    _reclaim: _Reclaim | None

    def flush_index(self, index: BlendIndex | None) -> None:
        """Apply the index writes queued since the last call to ``index`` (if on), in order,
        as one batch; then a step of freeing mostly dead token slabs (after the writes, so the
        views the index let go of count), whose index writes (a remove + re-add per content
        copied) are one more batch."""
        self._apply_ops(index)
        if self.slabs or self._reclaim is not None:
            self._reclaim_step()
            self._apply_ops(index)
            released, self.released = self.released, []
            for slab in released:  # a content of several chunks may still be a view of it
                if index is not None:
                    index.copy_out(slab.buffer)

    def _apply_ops(self, index: BlendIndex | None) -> None:
        ops = self._ops
        if ops:
            self._ops = []
            if index is not None:
                index.apply(ops)

    def _reclaim_step(self) -> None:
        """Once more than half of a slab's views are gone, copy its live contents out to
        arrays of their own, a bounded step at a time; then nothing refers to it and it is
        freed. Each slab is copied out at most once (see token_store.TokenSlab)."""
        r = self._reclaim
        if r is None:
            due = [s for s in self.slabs if s.mostly_dead()]
            if not due:
                return
            self.slabs = [s for s in self.slabs if s not in due]
            r = self._reclaim = _Reclaim(due, {id(s.buffer) for s in due})
        work = 0
        while work < _RECLAIM_WORK:
            if not r.pending:
                if r.part_no == PARTS:
                    self._reclaim = None
                    self.released += r.slabs
                    return
                r.pending = list(self.parts[r.part_no])
                r.part_no += 1
                continue
            h = r.pending.pop()
            work += 1
            part = self.parts[h[0]]
            rec = part.get(h)
            tokens = None if rec is None else record_stored_tokens(rec)
            if rec is None or tokens is None or id(tokens.base) not in r.buffers:
                continue
            work += 15
            self._preserve(h, rec)
            owned, offset, indexed = owned_copy(tokens), record_offset(rec), record_indexed(rec)
            if indexed and self.indexing:  # the index holds the view: move it to the copy
                self._ops.append(RemoveChunkOp(tokens, h))
                self._ops += [AddOp(owned, h, offset, ns) for ns in self._namespaces(rec)]
            part[h] = rebound(rec, owned, offset, indexed)
