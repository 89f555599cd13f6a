"""An engine batch checked whole before any of it is re-keyed: everything that could fail
later fails here, so a bad batch changes nothing (:class:`BadBatch` names the counter it lands
in). Bounded per piece, never per message: a :class:`~kvatlas.events.vllm_wire.SplitBatch` is
decoded a group of events at a time (:func:`groups`) and token ids are converted
:data:`TOKEN_PIECE` at a time. See docs/kv-events.md.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import Final

from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventBatch,
    SplitBatch,
    VllmWireError,
)

TOKEN_PIECE: Final = 1 << 16
"""Token ids packed per ``struct`` call (a bounded GIL-holding call, whatever the event)."""


class BadBatch(ValueError):
    """A batch that cannot be applied as a whole; ``kind`` is the counter it lands in."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def groups(batch: KVEventBatch | SplitBatch) -> Iterator[tuple[int, list[KVEvent]]]:
    """A batch's events, one decoded group at a time (a decoded batch: one group)."""
    if isinstance(batch, SplitBatch):
        return batch.groups()
    return iter([(0, batch.events)])


def decoded_once(batch: KVEventBatch | SplitBatch) -> KVEventBatch | SplitBatch:
    """A split batch of one group (every real vLLM step) as that group decoded: the checks
    and the translation then read one decoding instead of two (either way only one group's
    events are ever Python objects); :class:`BadBatch` if it does not decode."""
    if not isinstance(batch, SplitBatch) or len(batch.bodies) != 1:
        return batch
    try:
        ((_, events),) = batch.groups()
    except VllmWireError as exc:
        raise BadBatch(exc.kind, exc.reason) from None
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


def checked_tokens(
    batch: KVEventBatch | SplitBatch, chunk_size: int, max_blocks: int
) -> dict[int, bytes]:
    """Check everything that could fail later; returns each stored event's token ids,
    packed big-endian (the hashing form), by event index."""
    tokens: dict[int, bytes] = {}
    if not math.isfinite(batch.ts):
        raise BadBatch("invalid", f"ts must be a finite number, got {batch.ts}")
    blocks = 0
    try:
        for start, events in groups(batch):
            for i, event in enumerate(events, start):
                blocks += _check(event, i, chunk_size, tokens)
    except VllmWireError as exc:
        raise BadBatch(exc.kind, exc.reason) from None
    if blocks > max_blocks:
        raise BadBatch(
            "too_many_blocks", f"{blocks} blocks in one batch (--kv-events-max-blocks "
            f"{max_blocks})"
        )  # fmt: skip
    return tokens


def _check(event: KVEvent, i: int, chunk_size: int, tokens: dict[int, bytes]) -> int:
    """One event's checks; its blocks (a stored event's token ids, packed, go into
    ``tokens``)."""
    if isinstance(event, AllBlocksCleared):
        return 0
    hashes = event.block_hashes
    sizes = [len(h) for h in hashes if isinstance(h, bytes)]  # (an int hash has no size)
    if sizes and not (min(sizes) > 0 and max(sizes) <= 64):
        bad = next(n for n in sizes if not 0 < n <= 64)
        raise BadBatch("invalid", f"events[{i}]: block hash of {bad} bytes")
    n = len(hashes)
    if not isinstance(event, BlockStored):
        return n
    if n and not event.token_ids:  # a placeholder (an offloading connector's): no ids to
        return n  # re-key it by, whatever its block size; skipped and counted, not the batch's
    size = event.block_size
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
    tokens[i] = _packed(event.token_ids, i)
    return n


def _packed(token_ids: list[int], i: int) -> bytes:
    """``token_ids`` packed as big-endian ``uint32`` (one ``struct`` call per
    :data:`TOKEN_PIECE` ids, each id checked by it), or :class:`BadBatch` (``token_range``)
    naming event ``i`` if any is not an integer in ``[0, 2^32)``."""
    try:
        if len(token_ids) <= TOKEN_PIECE:
            return struct.pack(f">{len(token_ids)}I", *token_ids)
        pieces = [token_ids[at : at + TOKEN_PIECE] for at in range(0, len(token_ids), TOKEN_PIECE)]
        return b"".join([struct.pack(f">{len(p)}I", *p) for p in pieces])
    except struct.error:
        raise BadBatch("token_range", f"events[{i}]: token id outside [0, 2^32)") from None
