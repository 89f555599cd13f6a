"""A move's target side: load a request's chunks into L1 and hold them there
(:mod:`kvatlas.node.holds`) until the coordinator has deleted the source's copy
(``docs/cache-control.md``, "Moves"; ``PUT /cache/holds/{hold_id}``).

Each key L1 lacks comes from this node's own L2 (the prefetch path), else from the source's
L1, else its private L2 (the peer fetch path), a batch at a time for a bounded time per call; a
chunk from the source must prove its key and tokens
(:func:`~kvatlas.node.chunk_digest.rejection`) and is stored with the request's tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from kvatlas.keys import ObjectKey, RequestTracker
from kvatlas.node.chunk_digest import rejection
from kvatlas.node.emitter import BatchSink
from kvatlas.node.fleet_view import FleetView
from kvatlas.node.holds import MoveHolds
from kvatlas.node.kv_layout import KVLayout
from kvatlas.node.l1 import L1Cache
from kvatlas.node.l2 import L2Backend
from kvatlas.node.results import Loaded
from kvatlas.node.stored_chunk import StoredChunk
from kvatlas.node.tier_writes import TierWrites
from kvatlas.node.tiered_fetch import TieredFetch

MOVE_BATCH = 256
"""Keys a move's target asks its source for in one peer fetch at most."""
MOVE_BATCH_BYTES = 16 << 20
"""...and KV bytes at most: each fetch has the peer deadline (``--peer-fetch-deadline-s``, 2 s
by default), so a batch must arrive well within it on a busy host."""
MOVE_BUDGET_S = 4.0
"""How long one hold call loads before it answers with the rest ``unfinished`` (well inside the
coordinator's 10 s MP-server timeout)."""
MOVE_FLUSH_S = 2.0
"""How long a move's load waits for its store events to be delivered before it replies."""


class MoveTarget:
    """Loads and holds a move's keys in one node's L1 (see the module docstring). The node's
    fleet view is read at each call (``fleet``): it may be set after the node is made."""

    def __init__(
        self,
        *,
        holds: MoveHolds,
        l1: L1Cache,
        l2: L2Backend | None,
        tiers: TieredFetch,
        writes: TierWrites,
        layout: KVLayout,
        chunk_size: int,
        counters: Counter[str],
        key: Callable[[bytes, str], ObjectKey],
        fleet: Callable[[], FleetView | None],
        flush_events: Callable[[], None],
        sink: BatchSink | None,
    ) -> None:
        self.holds = holds
        self.l1 = l1
        self.l2 = l2
        self.tiers = tiers
        self.writes = writes
        self.layout = layout
        self.chunk_size = chunk_size
        self.counters = counters
        self.key = key
        self.fleet = fleet
        self.flush_events = flush_events
        self._sink = sink

    def load_and_hold(
        self, hold_id: str, tracker: RequestTracker, source: str, ttl_s: float
    ) -> Loaded:
        """Hold the keys of ``tracker``'s complete chunks in L1 for ``ttl_s``, loading each
        one L1 lacks (see the module docstring) a batch at a time (:data:`MOVE_BATCH`,
        :data:`MOVE_BATCH_BYTES`) for at most :data:`MOVE_BUDGET_S` (the rest is
        ``unfinished``: the coordinator asks again). The hold is set before anything is put
        (nothing loaded can be evicted before it is held) and ends holding only the keys L1
        has. A release that comes meanwhile stands: the end holds nothing then."""
        started = time.monotonic()
        hashes = tracker.chunk_hashes()
        tokens = tracker.get_token_ids()
        keys = [self.key(h, tracker.cache_salt) for h in hashes]
        c = self.chunk_size
        windows = {
            key: np.array(tokens[i * c : (i + 1) * c], dtype=np.uint32)
            for i, key in enumerate(keys)
        }
        known_missing = self.holds.missing(hold_id)  # found nowhere by this hold's last calls
        if not self.holds.hold(hold_id, keys, ttl_s):
            return Loaded([], [], [])  # released: its move is over, nothing to load or hold
        lacking = [k for k in keys if not self.l1.contains(k) and k not in known_missing]
        tried: set[ObjectKey] = set()  # came from some tier: put, whether L1 took it or not
        missing = [k for k in keys if k in known_missing and not self.l1.contains(k)]
        failure = ""
        done = 0
        step = max(1, min(MOVE_BATCH, MOVE_BATCH_BYTES // self.layout.chunk_bytes))
        for done in range(0, len(lacking), step):
            if done and time.monotonic() - started > MOVE_BUDGET_S:
                break
            batch = lacking[done : done + step]
            if self.l2 is not None:
                for key, chunk in self.l2.get_many(batch).items():
                    if self.tiers.usable(chunk):
                        self.writes.put_l1(chunk)
                        tried.add(key)
                batch = [k for k in batch if k not in tried]
            if batch:
                failure = self._load_from(source, batch, windows, tried)
                if failure:
                    break
                missing += [k for k in batch if k not in tried]
        else:
            done = len(lacking)
        unfinished = lacking[done:] if failure or done < len(lacking) else []
        held = [k for k in keys if self.l1.contains(k)]
        self.holds.hold(hold_id, held, ttl_s)
        self.holds.note_missing(hold_id, missing)
        if tried:  # the store events go out before the reply: the source's delete waits on them
            self.flush_events()
            delivered = getattr(self._sink, "flush", None)
            if callable(delivered):
                delivered(MOVE_FLUSH_S)
        no_room = [k for k in keys if k in tried and not self.l1.contains(k)]
        return Loaded(held, missing, no_room, failure, len(unfinished))

    def _load_from(
        self,
        source: str,
        keys: list[ObjectKey],
        windows: dict[ObjectKey, Any],
        tried: set[ObjectKey],
    ) -> str:
        """Put ``keys`` from ``source``'s L1, else its private L2, into L1 (each chunk's key
        and tokens checked); adds what came to ``tried``. Returns why the source could not be
        read (``""``: it answered)."""
        fleet = self.fleet()
        peer = fleet.peer(source) if fleet is not None else None
        if peer is None:
            return f"instance {source!r} is not reachable from this node (no peer URL)"
        for tier in ("l1", "l2"):
            wanted = [k for k in keys if k not in tried]
            if not wanted:
                break
            reply = peer.fetch(wanted, (tier,))
            if reply.failure:
                return f"fetch from {source!r} failed: {reply.failure}"
            for key, (chunk, digest) in reply.chunks.items():
                window = windows.get(key)
                if window is None or not self.tiers.usable(chunk):
                    continue
                cause = rejection(key, chunk, digest, window)
                if cause is not None:
                    self.counters[cause] += 1
                    continue
                self.writes.put_l1(StoredChunk(
                    key, chunk.kv, window, chunk.token_offset, chunk.kv_dtype
                ))  # fmt: skip
                tried.add(key)
                self.counters["moved_in_chunks"] += 1
        return ""


__all__ = ["MOVE_BATCH", "MOVE_BATCH_BYTES", "MOVE_BUDGET_S", "MOVE_FLUSH_S", "MoveTarget"]
