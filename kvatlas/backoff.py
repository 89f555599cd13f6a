"""Retry waits for a peer that is not there yet: exponential steps from ``initial`` up to
``cap``, each wait jittered to 50-100% of its step so a fleet restarted together does not
knock in step. A caller logs once per new step (:meth:`Backoff.report`), never once per
attempt: a peer down for an hour costs a handful of log lines.

Used by the node's registrar (a coordinator not up yet) and the coordinator's stream consumer
(a Redis not up yet, or restarting)."""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    def __init__(
        self, initial: float, cap: float, jitter: Callable[[], float] = random.random
    ) -> None:
        if not 0 < initial <= cap:
            raise ValueError(f"backoff: need 0 < initial ({initial}) <= cap ({cap})")
        self.initial = initial
        self.cap = cap
        self._jitter = jitter
        self.step = initial
        self._logged: float | None = None

    def report(self) -> bool:
        """Whether the coming wait's step is new, i.e. worth one log line (marked as told)."""
        new = self.step != self._logged
        self._logged = self.step
        return new

    def next_wait(self) -> float:
        """The wait before the next attempt: 50-100% of the current step, which then doubles
        (up to the cap) for the attempt after."""
        wait = self.step * (0.5 + self._jitter() / 2)
        self.step = min(self.step * 2, self.cap)
        return wait

    def reset(self) -> None:
        """The peer answered: the next outage starts from ``initial`` and is reported anew."""
        self.step = self.initial
        self._logged = None
