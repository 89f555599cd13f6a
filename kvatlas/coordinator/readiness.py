"""The coordinator's readiness (:class:`~kvatlas.coordinator.views.Readiness`) and the
resync that ends ``resyncing``.

Invariant: once ``resyncing`` began (events may be missing: a restart from a snapshot on the
HTTP transport, a stream trimmed past this replica's position, a Redis that lost events), only
:meth:`ReadinessTracker.check_resynced` ends it — every live instance completed a digest exchange
since, after the stream was read to its end — never a transport reporting that it caught up.
See docs/coordinator.md ("Readiness, start order and Redis restarts").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvatlas.coordinator.instances import InstanceRegistry
from kvatlas.coordinator.views import Readiness

__all__ = ["ReadinessTracker"]

log = logging.getLogger(__name__)


class ReadinessTracker:
    """The readiness the transports report and the resync that ends ``resyncing`` (whether
    the stream was trimmed past the restored position is the service's to ask, when its
    consumer joins: ``service.CoordinatorService``; past what a running consumer has read,
    the consumer's: ``StreamConsumer._check_trim``)."""

    def __init__(
        self,
        instances: InstanceRegistry,
        instance_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self.state = Readiness.RESTORING
        self._instances = instances
        self._timeout = instance_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._resyncing_since: float | None = None
        self._resync_known = 0  # registered instances when resyncing began
        self._replayed = False  # the stream was read to its end once (HTTP: nothing to read)

    def set(self, state: Readiness) -> None:
        """The readiness a transport reports (``serving``: it read the stream to its end;
        ``resyncing``: it lost events, and what the stream has now must be read again)."""
        if state is Readiness.RESYNCING:
            self._replayed = False
        if state is Readiness.SERVING:
            self._replayed = True
        with self._lock:
            if state is Readiness.RESYNCING:
                self._resyncing_since = self._clock()
                self._resync_known = len(self._instances.records())
                self._instances.owe_all()
                self._instances.owe_on_register = True
            elif state is Readiness.GROUP_HELD:
                self._resyncing_since = None  # final: this replica no longer consumes
            elif self._resyncing_since is not None and state in (
                Readiness.CATCHING_UP,
                Readiness.SERVING,
            ):
                return  # resyncing ends in check_resynced
            self.state = state

    def check_resynced(self) -> None:
        """``resyncing`` → ``serving`` once every live instance completed a digest exchange
        since and every node registered with another replica sent the listing this replica
        asked for (if it asked), or after twice the instance timeout (an instance that never
        exchanges — an old node — must not keep the replica unready forever). A replica that
        knew no instance (no snapshot registry) first waits one instance timeout for the live
        ones to register: their heartbeats get 404, they re-register and exchange."""
        with self._lock:
            since = self._resyncing_since
            if since is None or not self._replayed:  # what the stream still has comes first
                return
            elapsed = self._clock() - since
            waited = self._resync_known > 0 or elapsed > self._timeout
            done = not self._instances.owing() and not self._instances.listings_due()
            if (waited and done) or elapsed > 2 * self._timeout:
                self._resyncing_since = None
                self._instances.owe_on_register = False
                self._instances.stop_awaiting()
                self.state = Readiness.SERVING
                log.info("resync finished after %.1f s: serving", elapsed)
