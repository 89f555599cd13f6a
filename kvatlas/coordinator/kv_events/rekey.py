"""Re-keying vLLM blocks into kvatlas chunks: engine events in, gated event batches out.

vLLM names a block by its own hash and says which block came before it; kvatlas names a chunk
by the chain hash of its tokens (``kvatlas.keys``). Per engine this keeps, for every block it
has seen stored, where the engine's token chain stands after that block (:class:`ChainPoint`:
the last complete chunk's hash and the tokens since), so a child block continues its parent's
chain, and a chunk is keyed once its last block arrives (``chunk_size`` is a multiple of
``block_size``; a partial chunk waits in the point). A block whose parent was never seen is
counted and skipped: its chain cannot be known, and a guess would name other tokens' KV.

Extra keys (multimodal identities, a LoRA adapter) change the KV without changing the token
ids. Under ``blake3-x1`` they enter the chunk hash (each block's identities as an item spanning
that block, the adapter as the request key ``lora``); under ``blake3`` such a chain is counted
un-indexable. Either way such a chunk never gets a text-only key, and its tokens are never
offered to the blend index. Translation validates a whole batch before changing anything:
a bad batch changes nothing and yields nothing. What it yields is bounded per piece, never per
message: a :class:`~kvatlas.events.vllm_wire.SplitBatch` is decoded a group of events at a
time, twice (validated whole first, then translated: only one group's events are ever Python
objects), token ids are converted :data:`TOKEN_PIECE` at a time, and what comes out is gated
batches of at most ``slice_entries`` entries each (a big engine batch becomes several, with
consecutive seqs). See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np

from kvatlas.coordinator.kv_events.changes import Cleared, Pending, net_effect
from kvatlas.events import ACCESS, STORE, CacheEntry, EventBatch
from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    SplitBatch,
    VllmWireError,
)
from kvatlas.keys import NONE_HASH, KeyScheme, MMItem, ObjectKey, pack_kv_rank
from kvatlas.keys.chunk_hash import chain_hashes
from kvatlas.keys.extra_keys import x1_chunk_suffix_fn
from kvatlas.keys.tokens import TokenArray, tokens_be_bytes

log = logging.getLogger(__name__)

GPU_TIER: Final = "gpu"
CPU_TIER: Final = "engine-cpu"
ENGINE_BACKEND: Final = "vllm"
ENGINE_RANK: Final = pack_kv_rank(1, 0, 1, 0)
_MAX_TOKEN: Final = (1 << 32) - 1
SLICE_ENTRIES: Final = 4096
"""Most entries in one gated batch the re-keyer yields (one directory lock hold)."""
TOKEN_PIECE: Final = 1 << 16
"""Token ids converted per numpy call (a bounded GIL-holding call, whatever the event)."""


def engine_tier(medium: str | None) -> str:
    """``CPU`` (any case) → ``engine-cpu``; GPU, unset or anything else → ``gpu``."""
    return CPU_TIER if medium is not None and medium.lower() == "cpu" else GPU_TIER


class BadBatch(ValueError):
    """A batch that cannot be applied as a whole; ``kind`` is the counter it lands in."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


Op = EventBatch | Cleared


# A chain point and a block are plain tuples, not objects: CPython stops tracking a tuple of
# atoms (bytes, int, str, bool, None and such tuples) at its first collection, so the block map
# of text chains adds nothing to full collections. As tracked objects, a block map at the
# bound (--kv-events-max-blocks) would lengthen every full collection by its walk: a stall for
# every client. Their layouts are private to this module.

ChainPoint = tuple[
    bytes,  # prev: hash of the last complete chunk (NONE_HASH before the first)
    int,  # n_chunks: complete chunks so far
    int,  # fill: tokens after the last chunk boundary (fewer than chunk_size)
    "ChainPoint | None",  # back: the point before this one in the partial chunk
    BlockHash | None,  # block: the block this point comes after
    bytes,  # packed: this block's tokens, big-endian uint32 (only while fill > 0)
    tuple[MMItem, ...],  # items: this block's extra keys, as items with absolute spans
    str | int | None,  # lora: the chain's adapter
    bool,  # plain: no extra keys and no adapter anywhere in the chain
    bool,  # keyable: False: the scheme cannot carry what the chain holds
]
"""Where an engine's token chain stands after one block. Inside a partial chunk a point holds
only its own block (``packed``, ``items``) and links to the point before it, so a block costs
its own tokens, not the whole partial chunk."""

_FILL: Final = 2  # (named positions of the fields read one at a time)
_BACK: Final = 3
_BLOCK: Final = 4
_PACKED: Final = 5
_ITEMS: Final = 6

START: Final[ChainPoint] = (NONE_HASH, 0, 0, None, None, b"", (), None, True, True)

Placed = tuple[bytes, str, str]  # a chunk holding a block: (chunk hash, model, tier placed in)

_Block = tuple[ChainPoint, tuple[str, ...], tuple[Placed, ...]]
"""A stored block: its chain point, the tiers the engine holds it in (GPU, and maybe its CPU
offload too), and the chunks holding it: one per continuation (requests that share a block
inside a chunk and then diverge make two chunks, both gone with the block) and per tier."""


def _partial(point: ChainPoint) -> list[ChainPoint]:
    """The points of the partial chunk up to ``point``, oldest first."""
    out: list[ChainPoint] = []
    p: ChainPoint | None = point
    while p is not None and p[_FILL]:
        out.append(p)
        p = p[_BACK]
    return out[::-1]


@dataclass(slots=True)
class EngineState:
    instance_id: str
    incarnation: int
    seq: int = 0  # last kvatlas seq handed out
    blocks: OrderedDict[BlockHash, _Block] = field(default_factory=OrderedDict)


def _token_array(token_ids: list[int], i: int) -> TokenArray:
    """``token_ids`` as uint32, or :class:`BadBatch` (``token_range``) if any is outside;
    converted :data:`TOKEN_PIECE` at a time."""
    out = np.empty(len(token_ids), np.uint32)
    for start in range(0, len(token_ids), TOKEN_PIECE):
        try:
            arr = np.asarray(token_ids[start : start + TOKEN_PIECE])
        except (OverflowError, ValueError):
            arr = np.asarray([-1])
        if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > _MAX_TOKEN:
            raise BadBatch("token_range", f"events[{i}]: token id outside [0, 2^32)")
        out[start : start + len(arr)] = arr
    return out


def _packed_tokens(ids: dict[int, list[int]]) -> dict[int, bytes]:
    """Each event's token ids (``ids``: event index → ids) as big-endian uint32 bytes, all
    converted at once; :class:`BadBatch` (``token_range``) names the first event with an id
    outside ``[0, 2^32)``."""
    if not ids:
        return {}
    every = [t for token_ids in ids.values() for t in token_ids]
    try:
        packed = tokens_be_bytes(_token_array(every, -1))
    except BadBatch:
        for i, token_ids in ids.items():
            _token_array(token_ids, i)
        raise
    out: dict[int, bytes] = {}
    at = 0
    for i, token_ids in ids.items():
        end = at + 4 * len(token_ids)
        out[i] = packed[at:end]
        at = end
    return out


def _groups(batch: KVEventBatch | SplitBatch) -> Iterator[tuple[int, list[KVEvent]]]:
    """A batch's events, one decoded group at a time (a decoded batch: one group)."""
    if isinstance(batch, SplitBatch):
        return batch.groups()
    return iter([(0, batch.events)])


def _gone(chunk_hash: bytes, model: str) -> CacheEntry:
    """The delete entry of an engine chunk."""
    return CacheEntry(ObjectKey(chunk_hash, model, ENGINE_RANK))


def _identity(value: Any) -> str:
    """One extra key as an item identifier: a string as it is, anything else (any value
    msgpack decodes to) as ``m:`` + the hex of its msgpack encoding."""
    return value if isinstance(value, str) else "m:" + msgspec.msgpack.encode(value).hex()


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

    def marker(self, instance_id: str, missing: int = 0) -> EventBatch:
        """An empty batch that tells the gate now what happened: ``missing`` engine batches
        lost (a gap at the gate), or (after :meth:`restart`) a new incarnation (the old one's
        placements fenced). It changes no placement and is never re-published."""
        state = self.engine(instance_id)
        state.seq += missing + 1
        return EventBatch(instance_id, state.incarnation, state.seq, ACCESS, GPU_TIER,
                          ENGINE_BACKEND, ts=time.time())  # fmt: skip

    def _forget_blocks(self, state: EngineState) -> None:
        self.total_blocks -= len(state.blocks)
        state.blocks.clear()

    # ------------------------------------------------------------------ translation

    def translate(self, instance_id: str, model: str, batch: KVEventBatch | SplitBatch) -> list[Op]:
        """The ops one engine batch means, in order, each batch at most ``slice_entries``
        entries; :class:`BadBatch` (nothing changed) if any event of it is invalid."""
        tokens = self._validate(batch)
        state = self.engine(instance_id)
        pending = Pending()
        for start, events in _groups(batch):
            for i, event in enumerate(events, start):
                if isinstance(event, BlockStored):
                    self._stored(state, model, event, tokens[i], pending)
                elif isinstance(event, BlockRemoved):
                    self._removed(state, event, pending)
                else:
                    self._forget_blocks(state)
                    pending.ops.append(Cleared(instance_id))
                    pending.deleted = None
                    self.counts["clears"] += 1
        return list(self._batches(pending, batch.ts))

    def _validate(self, batch: KVEventBatch | SplitBatch) -> dict[int, bytes]:
        """Check everything that could fail later; returns each stored event's token ids,
        packed big-endian (the hashing form). A group's token ids are converted together:
        engines with CPU offload send one event per block, and a conversion per event would
        cost more than the rest of its re-keying."""
        tokens: dict[int, bytes] = {}
        if not math.isfinite(batch.ts):
            raise BadBatch("invalid", f"ts must be a finite number, got {batch.ts}")
        blocks = 0
        try:
            for start, events in _groups(batch):
                ids: dict[int, list[int]] = {}
                for i, event in enumerate(events, start):
                    blocks += self._check(event, i, ids)
                tokens.update(_packed_tokens(ids))
        except VllmWireError as exc:
            raise BadBatch(exc.kind, exc.reason) from None
        if blocks > self.max_blocks:
            raise BadBatch(
                "too_many_blocks", f"{blocks} blocks in one batch (--kv-events-max-blocks "
                f"{self.max_blocks})"
            )  # fmt: skip
        return tokens

    def _check(self, event: KVEvent, i: int, tokens: dict[int, list[int]]) -> int:
        """One event's checks; its blocks (a stored event's token ids go into ``tokens``)."""
        if isinstance(event, AllBlocksCleared):
            return 0
        for h in event.block_hashes:
            if isinstance(h, bytes) and not 0 < len(h) <= 64:
                raise BadBatch("invalid", f"events[{i}]: block hash of {len(h)} bytes")
        n = len(event.block_hashes)
        if not isinstance(event, BlockStored):
            return n
        size, chunk_size = event.block_size, self.chunk_size
        if size < 1 or size > chunk_size or chunk_size % size:
            raise BadBatch(
                "block_size",
                f"events[{i}]: block_size {size} does not divide chunk size {chunk_size}",
            )
        if n == 0 or len(event.token_ids) != n * size:
            raise BadBatch(
                "invalid", f"events[{i}]: {len(event.token_ids)} token ids for {n} blocks of {size}"
            )
        if event.extra_keys is not None and len(event.extra_keys) != n:
            raise BadBatch("invalid", f"events[{i}]: extra_keys for {len(event.extra_keys)}"
                           f" of {n} blocks")  # fmt: skip
        tokens[i] = event.token_ids
        return n

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
        lora = event.lora_name if event.lora_name is not None else event.lora_id
        extras = event.extra_keys or [None] * len(event.block_hashes)
        step = 4 * size
        self.counts["blocks_stored"] += len(event.block_hashes)
        for i, h in enumerate(event.block_hashes):
            before = point
            own = packed[i * step : (i + 1) * step]
            point, chunk = self._advance(point, h, own, extras[i], lora)
            self._remember(state, h, point, tier, pending)
            if chunk is None:  # the chunk is still partial
                continue
            prev, n_chunks, *_, plain, keyable = point
            if not keyable:
                self.counts["unindexable_chunks"] += 1
                continue
            placed = (prev, model, tier)
            for b in (*_partial(before), point):
                bh = b[_BLOCK]
                if bh is None or (held := state.blocks.get(bh)) is None or placed in held[2]:
                    continue
                state.blocks[bh] = (held[0], held[1], (*held[2], placed))
            tokens_of = np.frombuffer(chunk, dtype=">u4").astype(np.uint32) if plain else None
            offset = (n_chunks - 1) * self.chunk_size
            entry = CacheEntry(ObjectKey(prev, model, ENGINE_RANK), 0, tokens_of, offset)
            pending.add(state.instance_id, STORE, tier, entry)
            self.counts["chunks_stored"] += 1

    def _advance(
        self,
        point: ChainPoint,
        h: BlockHash,
        packed: bytes,
        extra: list[Any] | None,
        lora: str | int | None,
    ) -> tuple[ChainPoint, bytes | None]:
        """The chain after one more block, and the chunk it completed (``None``: partial)."""
        prev, n_chunks, fill, _, _, _, _, point_lora, point_plain, point_keyable = point
        n = len(packed) // 4
        items: tuple[MMItem, ...] = ()
        if extra:
            start = n_chunks * self.chunk_size + fill
            items = tuple(MMItem.of(_identity(v), start, n) for v in extra)
        plain = point_plain and not items and lora is None
        keyable = (
            point_keyable
            and (lora == point_lora or point is START)
            and (plain or self.scheme.carries_extra_keys)
        )
        if fill + n < self.chunk_size:
            back = point if fill else None
            return (prev, n_chunks, fill + n, back, h, packed, items, lora, plain, keyable), None
        earlier = _partial(point)
        chunk = b"".join([p[_PACKED] for p in earlier] + [packed])
        suffix = None
        if self.scheme.carries_extra_keys:
            all_items = [it for p in earlier for it in p[_ITEMS]] + list(items)
            request = {"lora": lora} if lora is not None else None
            suffix = x1_chunk_suffix_fn(self.chunk_size, all_items, request)
        prev = chain_hashes(chunk, self.chunk_size, prev, n_chunks, suffix)[0]
        return (prev, n_chunks + 1, 0, None, h, b"", (), lora, plain, keyable), chunk

    def _remember(
        self, state: EngineState, h: BlockHash, point: ChainPoint, tier: str, pending: Pending
    ) -> None:
        block = state.blocks.pop(h, None)
        if block is None:
            self.total_blocks += 1
            block = (point, (tier,), ())
        elif tier not in block[1]:  # stored again (same hash: same prefix, same chunks)
            block = (block[0], (*block[1], tier), block[2])  # in another medium
        state.blocks[h] = block
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
            pending.delete(victim.instance_id, tier, _gone(chunk_hash, model))

    def _removed(self, state: EngineState, event: BlockRemoved, pending: Pending) -> None:
        tier = engine_tier(event.medium)
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
                    pending.delete(state.instance_id, tier, _gone(chunk_hash, model))
                    self.counts["chunks_removed"] += 1
            tiers = tuple(t for t in tiers if t != tier)
            if tiers:
                state.blocks[h] = (point, tiers, tuple(p for p in placed if p[2] != tier))
            else:
                del state.blocks[h]
                self.total_blocks -= 1

    def _batches(self, pending: Pending, ts: float) -> Iterator[Op]:
        ts = ts if ts > 0 else time.time()
        for op in net_effect(pending.ops):
            if isinstance(op, Cleared):
                yield op
                continue
            instance_id, kind, tier, entries = op
            state = self.engines[instance_id]
            for start in range(0, len(entries), self.slice_entries):
                state.seq += 1
                yield EventBatch(
                    instance_id, state.incarnation, state.seq, kind, tier, ENGINE_BACKEND,
                    ts=ts, entries=tuple(entries[start : start + self.slice_entries]),
                )  # fmt: skip
