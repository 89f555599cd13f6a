"""Interpreter settings of the coordinator process: the GIL switch interval and the collector.

Both are about stalls a client sees. The event loop, the match threads, the stream consumer and
the snapshot writer share one GIL: with the default 5 ms switch interval one thread's Python
work stalls every other for 5 ms at a time (p99 of lookups, ingestion during a snapshot); 1 ms
keeps them fair. And a full (generation 2) collection of the cyclic garbage collector stops
every thread while it walks every tracked container: the interpreter's, numba's and the web
stack's, plus the directory's large sets, which grow with its keys (the L1 chunk
sets; its records are untracked, docs/directory.md), so such a collection is the longest stall
a client can see. :func:`freeze_long_lived` moves everything alive at startup (restored
directory included) out of the collector's sight (docs/coordinator.md, process settings).
"""

from __future__ import annotations

import gc
import sys
import time

SWITCH_INTERVAL_S = 0.001
"""The coordinator's GIL switch interval (``sys.setswitchinterval``)."""


def set_switch_interval() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def freeze_long_lived() -> None:
    """One full collection, then ``gc.freeze()``: every object tracked now leaves the
    collector for good (full collections no longer walk it). Called once when the coordinator is
    up (after the restore and the app are built, before the first request) and again by
    :class:`GrowthFreeze`. Safe because what is alive then is the process's long-lived state
    (modules, compiled kernels, the framework, the directory and the registry): when a part of
    it is dropped later (a directory replaced by a restore, a record by a store), reference
    counting still frees it; a frozen object is only out of reach of the *cycle* collector. What
    stays for good is a frozen reference cycle that becomes garbage later (an open connection's
    objects, say): a few per freeze, and there are few freezes."""
    global freezes
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()
    freezes += 1


freezes = 0
"""How many times :func:`freeze_long_lived` ran in this process."""


class GrowthFreeze:
    """Freeze again after a snapshot once the directory has doubled since the last freeze: a
    coordinator that started small and ingested 10^6 keys has containers (the L1 chunk set of
    each instance, partition dicts) that every full collection would otherwise walk, a stall
    that grows with the keys (docs/performance.md, "Collections"). Doubling bounds the freezes to ≈log2(keys) over the process's life, and with them
    what :func:`freeze_long_lived` may keep."""

    def __init__(self, keys: int, minimum: int = 100_000) -> None:
        self.frozen_at = max(keys, minimum // 2)

    def after_snapshot(self, keys: int) -> bool:
        """Freeze if ``keys`` (the snapshot's) is at least twice the last freeze's; True if so."""
        if keys < 2 * self.frozen_at:
            return False
        freeze_long_lived()
        self.frozen_at = keys
        return True


class CollectionWatch:
    """The longest pause of each generation's collections so far (``gc.callbacks``), for
    ``GET /metrics``; :meth:`install` once per process (the coordinator's)."""

    def __init__(self) -> None:
        self.longest_s = [0.0] * len(gc.get_stats())
        self._started = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def reset(self) -> None:
        """Forget the pauses so far (those of start-up)."""
        self.longest_s = [0.0] * len(self.longest_s)

    @property
    def installed(self) -> bool:
        return self._callback in gc.callbacks

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            gen = info["generation"]
            self.longest_s[gen] = max(self.longest_s[gen], now - self._started)


COLLECTIONS = CollectionWatch()
