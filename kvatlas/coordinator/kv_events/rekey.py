"""Re-keying vLLM blocks into kvatlas chunks: engine events in, gated event batches out.

vLLM names a block by its own hash and says which block came before it; kvatlas names a chunk
by the chain hash of its tokens (``kvatlas.keys``). Per engine this keeps, for every block it
has seen stored, where the engine's token chain stands after that block (:mod:`.chain`), so a
child block continues its parent's chain, and a chunk is keyed once its last block arrives. A
block whose parent was never seen is counted and skipped: its chain cannot be known, and a
guess would name other tokens' KV.

A chunk with extra keys (multimodal identities, a LoRA adapter) never gets a text-only key,
and its tokens are never offered to the blend index; under ``blake3`` it is counted
un-indexable. Translation validates a whole batch before changing anything
(:mod:`.batch_checks`): a bad batch changes nothing and yields nothing. What it yields is
bounded per piece, never per message: a :class:`~kvatlas.events.vllm_wire.SplitBatch` is
decoded a group of events at a time, twice (validated whole first, then translated: only one
group's events are ever Python objects), and what comes out is gated batches of at most
``slice_entries`` entries each (a big engine batch becomes several, with consecutive seqs).
See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Final

from kvatlas.coordinator.kv_events.batch_checks import checked_tokens, decoded_once, groups
from kvatlas.coordinator.kv_events.chain import (
    BLOCK,
    START,
    Block,
    ChainPoint,
    Placed,
    advance,
    advance_run,
    partial,
    plain_run,
)
from kvatlas.coordinator.kv_events.changes import Cleared, Pending, entry_columns, net_effect
from kvatlas.events import ACCESS, STORE, ColumnBatch, EventBatch
from kvatlas.events.vllm_wire import BlockHash, BlockRemoved, BlockStored, KVEventBatch, SplitBatch
from kvatlas.keys import KeyScheme

log = logging.getLogger(__name__)

GPU_TIER: Final = "gpu"
CPU_TIER: Final = "engine-cpu"
ENGINE_BACKEND: Final = "vllm"
SLICE_ENTRIES: Final = 4096
"""Most entries in one gated batch the re-keyer yields (one directory lock hold)."""
RUNS = True
"""Store an event's new blocks of a plain chain as one run (:meth:`Rekeyer._stored_run`);
tests turn it off to compare with the block-by-block loop."""


_TIERS: Final[dict[tuple[str, ...], tuple[str, ...]]] = {}
"""The tiers tuples blocks hold, each kept once and shared by every block holding that
combination (a few: the engine tiers) instead of one per block."""


def _shared(tiers: tuple[str, ...]) -> tuple[str, ...]:
    return _TIERS.setdefault(tiers, tiers)


def engine_tier(medium: str | None) -> str:
    """``CPU`` (any case) → ``engine-cpu``; GPU, unset or anything else → ``gpu``."""
    return CPU_TIER if medium is not None and medium.lower() == "cpu" else GPU_TIER


Op = ColumnBatch | Cleared


@dataclass(slots=True)
class EngineState:
    instance_id: str
    incarnation: int
    seq: int = 0  # last kvatlas seq handed out
    blocks: OrderedDict[BlockHash, Block] = field(default_factory=OrderedDict)


class Rekeyer:
    """Per-engine block maps, bounded in total by ``max_blocks`` (oldest blocks go first;
    their chunks' placements are removed with them: the directory forgets a copy rather than
    keep one it can no longer take back)."""

    def __init__(
        self, scheme: KeyScheme, max_blocks: int, slice_entries: int = SLICE_ENTRIES
    ) -> None:
        self.scheme = scheme
        self.chunk_size = scheme.chunk_size
        self.max_blocks = max_blocks
        self.slice_entries = slice_entries
        self.engines: dict[str, EngineState] = {}
        self.total_blocks = 0
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ engine lifecycle

    def engine(self, instance_id: str) -> EngineState:
        state = self.engines.get(instance_id)
        if state is None:
            # Above any incarnation an earlier run of this coordinator used (snapshot cursors).
            incarnation = time.time_ns() // 1000
            state = self.engines[instance_id] = EngineState(instance_id, incarnation)
        return state

    def restart(self, instance_id: str) -> None:
        """The engine restarted (its seq went back): forget its blocks; the next batch opens a
        new incarnation, which fences the old one's placements."""
        state = self.engine(instance_id)
        self._forget_blocks(state)
        state.incarnation += 1
        state.seq = 0

    def marker(self, instance_id: str, missing: int = 0) -> ColumnBatch:
        """An empty batch that tells the gate now what happened: ``missing`` engine batches
        lost (a gap at the gate), or (after :meth:`restart`) a new incarnation (the old one's
        placements fenced). It changes no placement and is never re-published."""
        state = self.engine(instance_id)
        state.seq += missing + 1
        return ColumnBatch.of(EventBatch(instance_id, state.incarnation, state.seq, ACCESS,
                                         GPU_TIER, ENGINE_BACKEND, ts=time.time()))  # fmt: skip

    def _forget_blocks(self, state: EngineState) -> None:
        self.total_blocks -= len(state.blocks)
        state.blocks.clear()

    # ------------------------------------------------------------------ translation

    def translate(self, instance_id: str, model: str, batch: KVEventBatch | SplitBatch) -> list[Op]:
        """The ops one engine batch means, in order, each batch at most ``slice_entries``
        entries; :class:`~.batch_checks.BadBatch` (nothing changed) if any event of it is
        invalid."""
        batch = decoded_once(batch)
        tokens = checked_tokens(batch, self.chunk_size, self.max_blocks)
        state = self.engine(instance_id)
        pending = Pending()
        for start, events in groups(batch):
            for i, event in enumerate(events, start):
                if isinstance(event, BlockStored):
                    if i in tokens:
                        self._stored(state, model, event, tokens[i], pending)
                    else:  # no token ids: an offload's placeholder (batch_checks)
                        self.counts["tokenless_blocks"] += len(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._removed(state, event, pending)
                else:
                    self._forget_blocks(state)
                    pending.ops.append(Cleared(instance_id))
                    pending.deleted = None
                    self.counts["clears"] += 1
        return list(self._batches(pending, batch.ts))

    def _stored(
        self,
        state: EngineState,
        model: str,
        event: BlockStored,
        packed: bytes,
        pending: Pending,
    ) -> None:
        if event.group_idx not in (None, 0):
            self.counts["other_group_blocks"] += len(event.block_hashes)
            return
        if event.parent_block_hash is None:
            point = START
        else:
            parent = state.blocks.get(event.parent_block_hash)
            if parent is None:
                self.counts["unknown_parents"] += 1
                return
            state.blocks.move_to_end(event.parent_block_hash)
            point = parent[0]
        tier = engine_tier(event.medium)
        size = event.block_size
        if point[2] % size:  # a block size other than the partial chunk's: it would straddle
            self.counts["block_size_changes"] += 1  # the chunk boundary (a 48-token chunk)
            return
        lora = event.lora_name if event.lora_name is not None else event.lora_id
        self.counts["blocks_stored"] += len(event.block_hashes)
        if RUNS and self._new_run(state, event, point) and plain_run(point, size, lora):
            self._stored_run(state, model, event.block_hashes, packed, size, point, tier, pending)
            return
        extras = event.extra_keys or [None] * len(event.block_hashes)
        step = 4 * size
        for i, h in enumerate(event.block_hashes):
            before = point
            own = packed[i * step : (i + 1) * step]
            point, chunk = advance(self.scheme, point, h, own, extras[i], lora)
            self._remember(state, h, point, tier, pending)
            if chunk is None:  # the chunk is still partial
                continue
            prev, n_chunks, *_, plain, keyable = point
            if not keyable:
                self.counts["unindexable_chunks"] += 1
                continue
            blocks = [b[BLOCK] for b in (*partial(before), point)]
            if not all(bh is None or bh in state.blocks for bh in blocks):
                continue  # a full map evicted one of its blocks: a copy it could not take back
            placed = ((prev, model, tier),)  # (shared by the chunk's blocks)
            merged: dict[tuple[Placed, ...], tuple[Placed, ...]] = {}
            for bh in blocks:
                self._place(state, bh, placed, merged)
            offset = (n_chunks - 1) * self.chunk_size
            pending.add(
                state.instance_id, STORE, tier, (prev, model, offset, chunk if plain else None)
            )
            self.counts["chunks_stored"] += 1

    def _new_run(self, state: EngineState, event: BlockStored, point: ChainPoint) -> bool:
        """Whether ``event``'s blocks are all new to the map (and to each other), none has
        extra keys, the map takes them all without an eviction and still holds the blocks of
        the partial chunk they continue (:meth:`_stored` does not place a chunk one of whose
        blocks went): then they are stored as one run (:meth:`_stored_run`)."""
        hashes = event.block_hashes
        return (
            len(hashes) > 1  # (one block: the loop costs less)
            and self.total_blocks + len(hashes) <= self.max_blocks
            and not (event.extra_keys and any(event.extra_keys))
            and not any(map(state.blocks.__contains__, hashes))
            and len(set(hashes)) == len(hashes)
            and all(b[BLOCK] is None or b[BLOCK] in state.blocks for b in partial(point))
        )

    def _stored_run(
        self,
        state: EngineState,
        model: str,
        hashes: list[BlockHash],
        packed: bytes,
        size: int,
        point: ChainPoint,
        tier: str,
        pending: Pending,
    ) -> None:
        """:meth:`_stored`'s loop for new blocks of a plain chain (:func:`advance_run`): each
        block's map entry built once, with the chunk that holds it when the run completes
        that chunk; the blocks of the partial chunk the run started in get the first
        chunk's placement as the loop gives it to them."""
        points, done, chunks = advance_run(self.scheme, point, hashes, packed, size)
        placed = [((h, model, tier),) for h in done]
        _, n_chunks, fill, *_ = point
        per_chunk = self.chunk_size // size
        first = fill // size  # the run's first chunk's tokens before it, in its blocks
        held: list[tuple[Placed, ...]] = [()] * len(hashes)
        for i, p in enumerate(placed):
            lo = max(0, i * per_chunk - first)
            held[lo : (i + 1) * per_chunk - first] = [p] * ((i + 1) * per_chunk - first - lo)
        state.blocks.update(zip(hashes, zip(points, repeat(_shared((tier,))), held), strict=False))
        self.total_blocks += len(hashes)
        if done and fill:
            merged: dict[tuple[Placed, ...], tuple[Placed, ...]] = {}
            for b in partial(point):
                self._place(state, b[BLOCK], placed[0], merged)
        for i, (h, chunk) in enumerate(zip(done, chunks, strict=True)):
            offset = (n_chunks + i) * self.chunk_size
            pending.add(state.instance_id, STORE, tier, (h, model, offset, chunk))
            self.counts["chunks_stored"] += 1

    @staticmethod
    def _place(
        state: EngineState,
        bh: BlockHash | None,
        placed: tuple[Placed],
        merged: dict[tuple[Placed, ...], tuple[Placed, ...]],
    ) -> None:
        """Mark block ``bh`` (if still mapped) as held by the chunk ``placed`` (a 1-tuple,
        which a block held by no other chunk takes as it is; ``merged``: the chunk's blocks'
        placements with it so far, by what they were, shared among them)."""
        if bh is None or (held := state.blocks.get(bh)) is None or placed[0] in held[2]:
            return
        was = held[2]
        now = placed if not was else merged.setdefault(was, (*was, *placed))
        state.blocks[bh] = (held[0], held[1], now)

    def _remember(
        self, state: EngineState, h: BlockHash, point: ChainPoint, tier: str, pending: Pending
    ) -> None:
        block = state.blocks.get(h)
        if block is None:
            self.total_blocks += 1
            state.blocks[h] = (point, _shared((tier,)), ())
        else:  # stored again (same hash: same prefix, same chunks): now the newest
            state.blocks.move_to_end(h)  # (in place: a pop and an insert would leave a hole)
            if tier not in block[1]:  # in another medium
                state.blocks[h] = (block[0], _shared((*block[1], tier)), block[2])
        while self.total_blocks > self.max_blocks:
            self._evict_one(state, pending)

    def _evict_one(self, preferred: EngineState, pending: Pending) -> None:
        victim = preferred
        if len(preferred.blocks) <= 1:
            victim = max(self.engines.values(), key=lambda s: len(s.blocks))
        _, block = victim.blocks.popitem(last=False)
        self.total_blocks -= 1
        self.counts["evicted_blocks"] += 1
        n = self.counts["evicted_blocks"]
        if n & (n - 1) == 0:  # the first, then at powers of two: a full map evicts per block
            log.warning("kv events: the block map is full (--kv-events-max-blocks %d): %d "
                        "blocks evicted so far, oldest first, their chunks' placements with "
                        "them; raise the limit above the blocks the engines hold (GPU + CPU)",
                        self.max_blocks, n)  # fmt: skip
        for chunk_hash, model, tier in block[2]:
            pending.delete(victim.instance_id, tier, chunk_hash, model)

    def _removed(self, state: EngineState, event: BlockRemoved, pending: Pending) -> None:
        tier = engine_tier(event.medium)
        kept: dict[tuple[Placed, ...], tuple[Placed, ...]] = {}  # (shared, as placements are)
        for h in event.block_hashes:
            block = state.blocks.get(h)
            if block is None or tier not in block[1]:
                self.counts["unknown_removed_blocks"] += 1
                continue
            self.counts["blocks_removed"] += 1
            # The chunks placed in this tier are incomplete there now; copies in another tier
            # (the CPU offload of an evicted GPU block) stay.
            point, tiers, placed = block
            for chunk_hash, model, placed_in in placed:
                if placed_in == tier:
                    pending.delete(state.instance_id, tier, chunk_hash, model)
                    self.counts["chunks_removed"] += 1
            tiers = _shared(tuple(t for t in tiers if t != tier))
            if tiers:
                left = kept.get(placed)
                if left is None:
                    left = kept[placed] = tuple(p for p in placed if p[2] != tier)
                state.blocks[h] = (point, tiers, left)
            else:
                del state.blocks[h]
                self.total_blocks -= 1

    def _batches(self, pending: Pending, ts: float) -> Iterator[Op]:
        ts = ts if ts > 0 else time.time()
        for op in net_effect(pending.ops):
            if isinstance(op, Cleared):
                yield op
                continue
            instance_id, kind, tier, chunks = op
            state = self.engines[instance_id]
            for start in range(0, len(chunks), self.slice_entries):
                state.seq += 1
                header = EventBatch(instance_id, state.incarnation, state.seq, kind, tier,
                                    ENGINE_BACKEND, ts=ts)  # fmt: skip
                yield ColumnBatch(header, entry_columns(chunks[start : start + self.slice_entries]))
