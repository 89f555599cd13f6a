"""When each replica's directory last changed, sampled cheaply while the harness compares.

A full comparison with the truth reads every replica's whole listing; it takes longer as the
directories grow (≈1 s a replica at 26,000 pool files), and "converged" at the end of the
first agreeing comparison overstates the time by up to two comparisons. While the workload
is paused only the convergence itself changes a directory, so the instant it converged is
the instant its last change was made. :class:`ChangeWatch` samples each replica's counters
(``GET /directory/stats``: keys, placements, batches by outcome; every change moves one)
every :data:`WATCH_S` and keeps the first time each replica showed its current counters; a
comparison that agreed, with no replica changed since before it began, dates the convergence
to that time (see :meth:`Soak.converge <kvatlas.soak.run.Soak.converge>`)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

WATCH_S = 0.05
"""Between two samples of every replica's counters."""
SIGNATURE_FIELDS = (
    "keys", "chunks", "placements", "placements_by_tier", "l1_placements_by_instance", "batches"
)  # fmt: skip
"""The fields of ``/directory/stats`` a change to the directory moves (a placement replaced
by another counts an applied batch)."""


def signature(stats: dict[str, Any]) -> str:
    """The counters of one ``/directory/stats`` reply, comparable between samples."""
    return repr([stats.get(f) for f in SIGNATURE_FIELDS])


class ChangeWatch:
    """Samples ``urls`` (replica id → base URL) until :meth:`stop`."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self._seen: dict[str, tuple[str, float]] = {}  # replica -> (signature, first seen)
        self._rounds = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                for rid, url in self.urls.items():
                    try:
                        reply = client.get(f"{url}/directory/stats")
                        reply.raise_for_status()
                        sig = signature(reply.json())
                    except (httpx.HTTPError, ValueError) as exc:  # down or restarting
                        sig = f"unreadable: {type(exc).__name__}"
                    now = time.monotonic()
                    with self._cond:
                        if self._seen.get(rid, ("", 0.0))[0] != sig:
                            self._seen[rid] = (sig, now)
                with self._cond:
                    self._rounds += 1
                    self._cond.notify_all()
                self._stop.wait(WATCH_S)

    def settled_at(self, timeout: float = 10.0) -> float | None:
        """After one more round of samples begun after this call: the latest of the instants
        each replica first showed its current counters (``None``: no such round in
        ``timeout``, the watch stopped)."""
        with self._cond:
            target = self._rounds + 2  # the round under way may have begun before the call
            if not self._cond.wait_for(lambda: self._rounds >= target, timeout):
                return None
            if set(self._seen) != set(self.urls):
                return None
            return max(t for _, t in self._seen.values())
