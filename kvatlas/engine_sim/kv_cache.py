"""A paged prefix cache shaped like vLLM's v1 block pool, with an optional CPU offload tier.

Invariants (vLLM's): only full blocks are cached, under the hash of their whole prefix; a block
with a reference is never evicted; unreferenced blocks stay cached in a free queue and the
least recently used goes first (a finished request frees its blocks tail first, so its last
blocks go before its first); block 0 is vLLM's null block and never holds KV. Every change a
router could see becomes an event in vLLM's form: ``BlockStored`` (hashes, parent, token ids;
group 0, full attention), ``BlockRemoved`` (one per hash, as vLLM emits them) and
``AllBlocksCleared`` on reset. The CPU tier (vLLM's offloading connector, medium ``CPU``) is
written through when a GPU block is cached and evicts its own least recently used block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

GPU: Final = "GPU"
CPU: Final = "CPU"
SPEC_KIND: Final = "full_attention"


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(slots=True)
class CacheCounts:
    """Cumulative counters (``/metrics``)."""

    gpu_evictions: int = 0
    cpu_evictions: int = 0
    cpu_stores: int = 0
    cpu_loads: int = 0


def stored_event(hashes: list[BlockHash], parent: bytes | None, tokens: list[int], block_size: int,
                 medium: str, extra_keys: list[list[Any] | None]) -> BlockStored:  # fmt: skip
    return BlockStored(hashes, parent, tokens, block_size, None, medium, None, extra_keys,
                       group_idx=0, kv_cache_spec_kind=SPEC_KIND)  # fmt: skip


def removed_event(block_hash: bytes, medium: str) -> BlockRemoved:
    return BlockRemoved([block_hash], medium, group_idx=0)


class CpuTier:
    """The offload tier: hashes in LRU order, at most ``capacity`` blocks."""

    def __init__(self, capacity: int, events: list[KVEvent], counts: CacheCounts) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._events = events
        self._counts = counts

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def touch(self, block_hash: bytes) -> None:
        self._lru.move_to_end(block_hash)

    def store(self, block_hash: bytes, parent: bytes | None, tokens: list[int], block_size: int,
              extra: list[Any] | None) -> None:  # fmt: skip
        if self.capacity <= 0:
            return
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        while len(self._lru) >= self.capacity:
            old, _ = self._lru.popitem(last=False)
            self._events.append(removed_event(old, CPU))
            self._counts.cpu_evictions += 1
        self._lru[block_hash] = None
        self._counts.cpu_stores += 1
        self._events.append(stored_event([block_hash], parent, tokens, block_size, CPU, [extra]))

    def clear(self) -> None:
        self._lru.clear()


@dataclass(slots=True)
class BlockPool:
    num_gpu_blocks: int
    block_size: int
    cpu_blocks: int = 0
    events: list[KVEvent] = field(default_factory=list)
    counts: CacheCounts = field(default_factory=CacheCounts)
    blocks: list[Block] = field(init=False)
    cached: dict[bytes, int] = field(init=False, default_factory=dict)
    free: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)
    cpu: CpuTier = field(init=False)

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 2:
            raise ValueError("gpu blocks must be at least 2 (block 0 is vLLM's null block)")
        self.blocks = [Block(i) for i in range(self.num_gpu_blocks)]
        self.free.update((i, None) for i in range(1, self.num_gpu_blocks))
        self.cpu = CpuTier(self.cpu_blocks, self.events, self.counts)

    # ------------------------------------------------------------------ queries

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the share of blocks referenced by requests."""
        return 1.0 - self.free_blocks / self.usable_blocks

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The GPU blocks holding the longest cached prefix of ``hashes``."""
        found: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cpu_run(self, hashes: Sequence[bytes], start: int) -> int:
        """How many blocks from ``start`` on the CPU tier holds, consecutively."""
        n = 0
        for h in hashes[start:]:
            if h not in self.cpu:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ changes

    def touch(self, block_ids: Sequence[int]) -> None:
        """A request reuses these cached blocks: referenced, so out of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free[block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, evicting the least recently used cached ones; ``None`` if fewer than
        ``n`` are free (nothing changes then)."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                self.events.append(removed_event(block.block_hash, GPU))
                self.counts.gpu_evictions += 1
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """A request is done with its blocks: tail first into the free queue."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block_id] = None

    def cache(self, block_ids: Sequence[int], hashes: Sequence[bytes], first: int, end: int,
              tokens: Sequence[int], extra: Sequence[list[Any] | None]) -> None:  # fmt: skip
        """Blocks ``first..end-1`` of a request became full: cache them (one ``BlockStored``, as
        vLLM's ``cache_full_blocks``) and write them through to the CPU tier."""
        if first >= end:
            return
        bs = self.block_size
        new: list[BlockHash] = []
        for i in range(first, end):
            block = self.blocks[block_ids[i]]
            h = hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block.block_id
            new.append(h)
        parent = hashes[first - 1] if first else None
        self.events.append(stored_event(new, parent, list(tokens[first * bs : end * bs]), bs, GPU,
                                        list(extra[first:end])))  # fmt: skip
        if self.cpu.capacity <= 0:
            return
        for i in range(first, end):
            self.cpu.store(hashes[i], hashes[i - 1] if i else None,
                           list(tokens[i * bs : (i + 1) * bs]), bs, extra[i])  # fmt: skip

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: refused (False) while any block is referenced."""
        if self.free_blocks != self.usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.cpu.clear()
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        out = list(self.events)
        self.events.clear()
        return out
