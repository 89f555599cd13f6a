"""L1: the node's in-memory chunk tier, an LRU bounded by bytes (not entries).

Bytes, because chunk sizes differ by model (layers x heads x head_dim x dtype) and the thing
that runs out is memory. The budget is hard: ``used_bytes <= capacity_bytes`` always holds.

Pinning exists for peer transfers (``docs/node.md``): a peer lists the keys it wants and this node
must not evict them between "I have it" and "here are its bytes". Pins are counted per key (two
overlapping transfers may pin the same key) and only hold off *eviction*; an explicit
:meth:`L1Cache.remove` still removes a pinned key, because removal is a correctness decision
(stale or invalidated KV) that no transfer should be able to veto.

The operator's pins (``held``, a :class:`~kvatlas.node.pins.PinnedKeys` the node keeps from the
coordinator's pin table, joined with the moves' :class:`~kvatlas.node.holds.MoveHolds`) hold
off eviction the same way, for as long as they last: a put that needs their room is refused
(counted by the caller), never stored by evicting them.

Semantics chosen for pressure:

* a put that can only make room by evicting pinned entries is **refused** -- nothing is
  evicted and the new chunk is not stored. Inserting anyway would break the hard budget;
  evicting what can be evicted and then refusing would destroy cache for nothing. Pins last
  one transfer, so the next put succeeds.
* a chunk larger than the whole budget is refused the same way.
* a refused chunk is returned from :meth:`L1Cache.put` inside the "evicted" list (test with
  ``chunk in evicted``-by-identity, or :meth:`L1Cache.contains`), but ``on_evict`` is *not*
  called for it: ``on_evict`` means "left L1" (it drives L1 delete events and
  write-on-eviction to L2), and a refused chunk never entered L1.

``on_evict`` runs outside the lock, in the putting thread, after the put is complete: it may
do slow I/O (an L2 write) or call back into the cache without deadlocking. An exception from it
is logged, not raised.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from kvatlas.checks import is_plain_int
from kvatlas.keys import ObjectKey
from kvatlas.node.holds import KeptKeys
from kvatlas.node.pins import PinnedKeys
from kvatlas.node.stored_chunk import StoredChunk

log = logging.getLogger(__name__)


class L1Cache:
    """Thread-safe LRU of :class:`StoredChunk` with a byte budget and eviction pins."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        on_evict: Callable[[StoredChunk], None] | None = None,
        held: KeptKeys | None = None,
    ) -> None:
        if not is_plain_int(capacity_bytes):
            raise TypeError("capacity_bytes must be an int")
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[ObjectKey, StoredChunk] = OrderedDict()  # LRU first
        self._used = 0
        self._pins: Counter[ObjectKey] = Counter()
        self._held: KeptKeys = held if held is not None else PinnedKeys()
        self._lock = threading.Lock()

    # -- writes ---------------------------------------------------------------------------

    def put(self, chunk: StoredChunk) -> list[StoredChunk]:
        """Store ``chunk`` as most recently used; return the chunks that left (see module doc).

        Re-putting a present key replaces its value in place (the key never leaves L1, so the
        old value is not reported as evicted).
        """
        size = chunk.nbytes
        evicted: list[StoredChunk] = []
        with self._lock:
            old = self._entries.get(chunk.key)
            old_size = old.nbytes if old is not None else 0
            need = self._used - old_size + size - self.capacity_bytes
            if size > self.capacity_bytes or (need > 0 and need > self._evictable_bytes(chunk.key)):
                return [chunk]
            if need > 0:
                for key in list(self._entries):
                    if need <= 0:
                        break
                    if key == chunk.key or self._kept(key):
                        continue
                    victim = self._entries.pop(key)
                    self._used -= victim.nbytes
                    need -= victim.nbytes
                    evicted.append(victim)
            if old is not None:
                self._used -= old_size
            self._entries[chunk.key] = chunk
            self._entries.move_to_end(chunk.key)
            self._used += size
        self._notify(evicted)
        return evicted

    def remove(self, key: ObjectKey) -> bool:
        """Drop ``key`` even if pinned (removal is a correctness call); ``on_evict`` not called."""
        with self._lock:
            chunk = self._entries.pop(key, None)
            if chunk is None:
                return False
            self._used -= chunk.nbytes
            return True

    def _evictable_bytes(self, exclude: ObjectKey) -> int:
        kept = {k for k, n in self._pins.items() if n > 0} | set(self._held)  # O(pins)
        kept.add(exclude)
        entries = self._entries
        return self._used - sum(entries[k].nbytes for k in kept if k in entries)

    def _kept(self, key: ObjectKey) -> bool:
        """Not evictable: a transfer holds it or the operator pinned it."""
        return self._pins[key] > 0 or key in self._held

    def _notify(self, evicted: list[StoredChunk]) -> None:
        """Every evicted chunk reaches the callback even if one call fails (an L2 write error
        must not lose the other chunks' write-on-eviction, nor fail the engine's store)."""
        if self._on_evict is not None:
            for chunk in evicted:
                try:
                    self._on_evict(chunk)
                except Exception:
                    log.exception("L1 on_evict callback failed for %s", chunk.key)

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: ObjectKey, touch: bool = True) -> StoredChunk | None:
        """The chunk for ``key`` or ``None``; ``touch`` marks it most recently used."""
        with self._lock:
            chunk = self._entries.get(key)
            if chunk is not None and touch:
                self._entries.move_to_end(key)
            return chunk

    def peek(self, key: ObjectKey) -> StoredChunk | None:
        """:meth:`get` without touching: for inspection that must not skew the LRU order."""
        return self.get(key, touch=False)

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._entries

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[ObjectKey]:
        """A snapshot of the keys, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._entries)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- pins -----------------------------------------------------------------------------

    @contextmanager
    def pinned(self, keys: Iterable[ObjectKey]) -> Iterator[None]:
        """Hold off eviction of ``keys`` for the ``with`` block.

        Keys are pinned whether present or not (a key put during the block is pinned too);
        pins nest and are counted, so overlapping transfers of the same key compose.
        """
        held = list(dict.fromkeys(keys))
        with self._lock:
            self._pins.update(held)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(held)
                for key in held:
                    if self._pins[key] <= 0:
                        del self._pins[key]

    def is_pinned(self, key: ObjectKey) -> bool:
        """A transfer holds ``key`` or the operator pinned it."""
        with self._lock:
            return self._kept(key)
