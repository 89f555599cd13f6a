"""Which peers are down: a peer whose fetch failed for want of a connection (``unreachable``,
``refused``, ``deadline``) is skipped for a while, so one dead or dripping peer costs the
node one deadline per down-time, not one per retrieval. The down-time starts at ``initial``
seconds and doubles (up to ``cap``) while the peer keeps failing, each jittered to 50-100 % of
its step (:class:`~kvatlas.backoff.Backoff`); the first success forgets it. At most
``max_peers`` peers are remembered (instance ids come from the directory): past that, those
no longer down are forgotten first, then all of them (a flood of fresh ids costs one
deadline each, never unbounded memory). See ``docs/node.md`` ("Safety beyond the hash").
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from kvatlas.backoff import Backoff

log = logging.getLogger(__name__)

__all__ = ["PeerHealth"]


class PeerHealth:
    """Down-times per peer instance id (module docstring). Thread-safe."""

    def __init__(
        self,
        initial: float = 10.0,
        cap: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        max_peers: int = 4096,
    ) -> None:
        self.initial = initial
        self.cap = max(cap, initial)
        self._clock = clock
        self._jitter = jitter
        self._max_peers = max_peers
        self._lock = threading.Lock()
        self._backoff: dict[str, Backoff] = {}
        self._until: dict[str, float] = {}

    def down(self, instance_id: str) -> bool:
        """Whether ``instance_id`` is in a down-time (skip it)."""
        with self._lock:
            until = self._until.get(instance_id)
        return until is not None and self._clock() < until

    def failed(self, instance_id: str, cause: str) -> None:
        """A fetch from ``instance_id`` failed for want of a connection: down for the next
        step of its backoff."""
        now = self._clock()
        with self._lock:
            backoff = self._backoff.get(instance_id)
            if backoff is None:
                self._make_room(now)
                backoff = self._backoff[instance_id] = Backoff(self.initial, self.cap, self._jitter)
            tell = backoff.report()
            wait = backoff.next_wait()
            self._until[instance_id] = now + wait
        if tell:
            log.info("peer %s is down (%s): skipped for up to %.3g s", instance_id, cause, wait)

    def succeeded(self, instance_id: str) -> None:
        """A fetch from ``instance_id`` got a reply: its next outage starts from ``initial``."""
        with self._lock:
            self._backoff.pop(instance_id, None)
            self._until.pop(instance_id, None)

    def _make_room(self, now: float) -> None:
        if len(self._backoff) < self._max_peers:
            return
        for instance_id in [i for i, until in self._until.items() if until <= now]:
            del self._backoff[instance_id], self._until[instance_id]
        if len(self._backoff) >= self._max_peers:
            self._backoff.clear()
            self._until.clear()

    def __len__(self) -> int:
        """Peers remembered (down now, or failed since their last success)."""
        with self._lock:
            return len(self._backoff)
