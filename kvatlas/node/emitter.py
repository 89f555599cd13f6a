"""EventEmitter: turns a node's store/evict/touch stream into ordered cache-event batches.

Consecutive events with the same ``(event_type, tier, backend, shared)`` share one batch; a
different kind closes the open batch first, so batches are never reordered relative to each
other (a delete can never overtake the store it undoes). A batch is handed to the sink when it
reaches ``max_entries`` or is ``max_delay_s`` old; the sink delivers off the serving path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvatlas.events import CacheEntry

GroupKey = tuple[str, str, str, bool]


class BatchSink(Protocol):
    def emit(
        self,
        event_type: str,
        tier: str,
        backend: str,
        entries: list[CacheEntry],
        *,
        shared: bool = False,
        **extra: Any,
    ) -> bool: ...


class EventEmitter:
    def __init__(
        self,
        sink: BatchSink,
        *,
        max_entries: int = 1000,
        max_delay_s: float = 0.05,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import time

        self._sink = sink
        self.max_entries = max_entries
        self.max_delay_s = max_delay_s
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._group: GroupKey | None = None
        self._entries: list[CacheEntry] = []
        self._opened_at = 0.0
        self._stop = threading.Event()
        self.batches_emitted = 0
        self.entries_emitted = 0
        self._timer = threading.Thread(target=self._flush_loop, name="kvatlas-emitter", daemon=True)
        self._timer.start()

    def record(
        self, event_type: str, tier: str, backend: str, entry: CacheEntry, *, shared: bool = False
    ) -> None:
        group = (event_type, tier, backend, shared)
        ready: list[tuple[GroupKey, list[CacheEntry]]] = []
        with self._lock:
            if self._group is not None and self._group != group:
                ready.append(self._take_locked())
            if self._group is None:
                self._group, self._opened_at = group, self._clock()
            self._entries.append(entry)
            if len(self._entries) >= self.max_entries:
                ready.append(self._take_locked())
            self._hand_over_locked(ready)

    def flush(self) -> None:
        with self._lock:
            if self._group is not None:
                self._hand_over_locked([self._take_locked()])

    def barrier(self, action: Callable[[BatchSink], None]) -> None:
        """Hand the open batch to the sink, then run ``action(sink)`` while no event can be
        recorded: what ``action`` emits goes out behind everything recorded before."""
        with self._lock:
            if self._group is not None:
                self._hand_over_locked([self._take_locked()])
            action(self._sink)

    def _take_locked(self) -> tuple[GroupKey, list[CacheEntry]]:
        assert self._group is not None
        taken = (self._group, self._entries)
        self._group, self._entries = None, []
        return taken

    def _hand_over_locked(self, ready: list[tuple[GroupKey, list[CacheEntry]]]) -> None:
        # Under the lock so that batches reach the sink (which stamps seq) in record order.
        for (event_type, tier, backend, shared), entries in ready:
            self._sink.emit(event_type, tier, backend, entries, shared=shared)
            self.batches_emitted += 1
            self.entries_emitted += len(entries)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.max_delay_s / 2):
            with self._lock:
                if self._group is not None and self._clock() - self._opened_at >= self.max_delay_s:
                    self._hand_over_locked([self._take_locked()])

    def close(self) -> None:
        self._stop.set()
        self._timer.join(timeout=5)
        self.flush()
