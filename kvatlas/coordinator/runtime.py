"""Interpreter settings of the coordinator process: the GIL switch interval, the collector and
the C allocator's free pages (:class:`MemoryTrim`).

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

import ctypes
import gc
import sys
import threading
import time
from collections.abc import Callable

from kvatlas.c_heap import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
    glibc,
)

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
    that grows with the keys (docs/performance.md, "Directory: design figures"). Doubling bounds
    the freezes to ≈log2(keys) over the process's life, and with them what
    :func:`freeze_long_lived` may keep."""

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


TRIM_INTERVAL_S = 10.0
"""How often the coordinator process hands the C allocator's free pages back
(:class:`MemoryTrim`): the default of ``--memory-trim-interval-s``."""


class MemoryTrim:
    """Every ``interval_s`` seconds, on a thread of its own, ``malloc_trim(0)``: the pages of
    the C allocator's free chunks go back to the kernel. Why: each ``POST /events`` of a
    thousand entries allocates and frees a few MB (the body and its copies, the token arena,
    the directory's temporaries), numpy buffers and large containers come from ``malloc``, and
    the freed memory stays resident inside the allocator's heaps (glibc returns only the top
    of a heap): 10–20 MB at 100,000 chunks, ≈100 B a chunk of the ≈1.16 KB the process grew
    by (docs/performance.md, "service"). A trim costs 0.05–1.6 ms (measured at 100,000
    chunks) with the GIL released; while it walks an arena it holds that arena's lock, so a
    thread allocating there waits as long. On a timer rather than after each request, and a
    long one: memory trimmed is faulted in again when reused (every second: +0.1 minor faults
    per ingested entry, ≈+30%; every 10 s, none measurable), and each trim is a chance for
    that wait (13–33 ms were seen with 2 cores shared by ≈10 runnable processes: the trimming
    thread preempted holding a lock). What it returns does not grow with the interval: what
    a request frees, the next ones reuse.

    Starting it also pins glibc's two thresholds (``c_heap.MMAP_THRESHOLD``,
    ``c_heap.TRIM_THRESHOLD``), so that the timer is the only one handing pages back. Left to
    itself glibc trims a heap's top after any ``free`` that leaves more than twice its mmap
    threshold there, a threshold that only rises when a block it had mapped on its own is
    freed: a ``POST /events`` whose blocks are each below it (a msgpack body of a thousand
    entries: a ``bytes`` per content and their join, ≈2 MB) was handed back at the end of
    every request and faulted in again by the next, ≈0.5 faults an entry
    (docs/performance.md, "Service: design figures"). :meth:`stop` leaves them pinned (glibc
    cannot slide them again): the process is ending."""

    def __init__(
        self,
        interval_s: float = TRIM_INTERVAL_S,
        trim: Callable[[int], int] | None = None,
        mallopt: Callable[[int, int], int] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._trim = (
            trim if trim is not None else glibc("malloc_trim", ctypes.c_int, ctypes.c_size_t)
        )
        self._mallopt = (
            mallopt
            if mallopt is not None
            else glibc("mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int)
        )
        self.pinned = False  # whether start() pinned the thresholds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.trims = 0
        self.longest_s = 0.0

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def start(self) -> bool:
        """Pin the thresholds and start trimming (False where the C library has no
        ``malloc_trim``: then nothing is pinned either, and glibc-less allocators keep their
        own policy)."""
        if self._trim is None or self._thread is not None:
            return self._thread is not None
        if self._mallopt is not None:
            self.pinned = bool(
                self._mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and self._mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            )
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvatlas-memory-trim", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def trim_now(self) -> None:
        """One trim, timed (:attr:`longest_s`)."""
        if self._trim is None:
            return
        started = time.perf_counter()
        self._trim(0)
        self.longest_s = max(self.longest_s, time.perf_counter() - started)
        self.trims += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.trim_now()


MEMORY_TRIM = MemoryTrim()
"""The coordinator process's trimmer (started by ``kvatlas coordinator``, not by an embedded
server: the heap is its host process's)."""
