"""An engine batch checked whole before any of it is re-keyed: everything that could fail
later fails here, so a bad batch changes nothing (:class:`BadBatch` names the counter it lands
in). Bounded per piece, never per message: a :class:`~kvatlas.events.vllm_wire.SplitBatch` is
decoded a group of events at a time (:func:`groups`) and token ids are converted
:data:`TOKEN_PIECE` at a time. See docs/kv-events.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Final

import numpy as np

from kvatlas.events.vllm_wire import (
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventBatch,
    SplitBatch,
    VllmWireError,
)
from kvatlas.keys.tokens import TokenArray, tokens_be_bytes

_MAX_TOKEN: Final = (1 << 32) - 1
TOKEN_PIECE: Final = 1 << 16
"""Token ids converted per numpy call (a bounded GIL-holding call, whatever the event)."""


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


def checked_tokens(
    batch: KVEventBatch | SplitBatch, chunk_size: int, max_blocks: int
) -> dict[int, bytes]:
    """Check everything that could fail later; returns each stored event's token ids,
    packed big-endian (the hashing form). A group's token ids are converted together:
    engines with CPU offload send one event per block, and a conversion per event would
    cost more than the rest of its re-keying."""
    tokens: dict[int, bytes] = {}
    if not math.isfinite(batch.ts):
        raise BadBatch("invalid", f"ts must be a finite number, got {batch.ts}")
    blocks = 0
    try:
        for start, events in groups(batch):
            ids: dict[int, list[int]] = {}
            for i, event in enumerate(events, start):
                blocks += _check(event, i, chunk_size, ids)
            tokens.update(_packed_tokens(ids))
    except VllmWireError as exc:
        raise BadBatch(exc.kind, exc.reason) from None
    if blocks > max_blocks:
        raise BadBatch(
            "too_many_blocks", f"{blocks} blocks in one batch (--kv-events-max-blocks "
            f"{max_blocks})"
        )  # fmt: skip
    return tokens


def _check(event: KVEvent, i: int, chunk_size: int, tokens: dict[int, list[int]]) -> int:
    """One event's checks; its blocks (a stored event's token ids go into ``tokens``)."""
    if isinstance(event, AllBlocksCleared):
        return 0
    for h in event.block_hashes:
        if isinstance(h, bytes) and not 0 < len(h) <= 64:
            raise BadBatch("invalid", f"events[{i}]: block hash of {len(h)} bytes")
    n = len(event.block_hashes)
    if not isinstance(event, BlockStored):
        return n
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
    tokens[i] = event.token_ids
    return n


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
