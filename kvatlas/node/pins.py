"""The coordinator's pins on this node: which of its keys an operator pinned
(``POST /cache/pins``), so that neither L1's LRU nor a capped private fs L2 evicts them and a
``DELETE /cache/objects`` without ``force`` skips them (``docs/cache-control.md``, "Pins on
the node").

The node learns them by polling ``GET /instances/{instance_id}/pins`` (its own pins: the keys
of its model in the salts its token is bound to, read-only) every ``--pin-refresh-interval-s``.
Polling, not a generation in the heartbeat reply: the heartbeat's reply is LMCache's shape, and
a poll of a few pages every few seconds costs nothing next to the chunks it guards. A poll
that fails keeps the last set (an outage must not unpin everything) and is counted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from kvatlas.keys import ObjectKey

log = logging.getLogger(__name__)


class PinnedKeys:
    """The set of pinned keys, replaced whole (reads need no lock: one reference swap)."""

    def __init__(self, keys: Iterable[ObjectKey] = ()) -> None:
        self._keys: frozenset[ObjectKey] = frozenset(keys)

    def replace(self, keys: Iterable[ObjectKey]) -> None:
        self._keys = frozenset(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[ObjectKey]:
        return iter(self._keys)


class PinFollower:
    """Every ``interval_s``: ``fetch()`` (all pages of this node's pins) into ``pins``.
    Failures are counted in ``counters["pin_refresh_failures"]`` and the last set is kept."""

    def __init__(
        self,
        fetch: Callable[[], list[ObjectKey]],
        pins: PinnedKeys,
        interval_s: float,
        counters: Counter[str],
    ) -> None:
        self._fetch = fetch
        self.pins = pins
        self.interval_s = interval_s
        self.counters = counters
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvatlas-pins", daemon=True)

    def start(self) -> PinFollower:
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def refresh(self) -> bool:
        """One poll; ``False`` when it failed (the previous set stays)."""
        try:
            keys = self._fetch()
        except Exception as exc:  # any failure: keep the pins we had
            self.counters["pin_refresh_failures"] += 1
            log.warning("reading this node's pins from the coordinator failed: %s", exc)
            return False
        self.pins.replace(keys)
        self.counters["pin_refreshes"] += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
