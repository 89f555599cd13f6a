"""The subscriber's sockets: one SUB socket per endpoint (connected or bound), each refusing a
frame above ``--kv-events-max-message-bytes`` and watched for disconnects (a connected endpoint
is connected again, whatever the cause), and each endpoint's replay (DEALER) socket, opened on
first use. What a message means is the subscriber's (:mod:`.subscriber`). Loads pyzmq only
when a socket opens. See docs/kv-events.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvatlas.coordinator.kv_events.settings import LinkSpec, SubscriberSettings

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)
TURN = 1000
"""The most messages read from one socket before the others get their turn (ZMQ's default
receive high-water mark: all a socket can queue)."""


@dataclass(slots=True)
class Link:
    """One endpoint: its settings, the engines it spoke for and where each topic's seq stands."""

    spec: LinkSpec
    seqs: dict[str, int] = field(default_factory=dict)  # topic -> last seq
    engine_of: dict[str, str] = field(default_factory=dict)  # topic -> engine of its last batch
    instances: set[str] = field(default_factory=set)  # the engines it speaks for
    dealer: Any = None  # the replay socket, opened on first use
    replay_after: float = 0.0  # monotonic time before which no replay is asked (after a failure)

    @property
    def endpoint(self) -> str:
        return self.spec.endpoint


class Endpoints:
    """The sockets of ``links``; a disconnect is counted in ``counts`` (the subscriber's)."""

    def __init__(
        self, settings: SubscriberSettings, links: list[Link], counts: Counter[str]
    ) -> None:
        self.settings = settings
        self.links = links
        self._counts = counts
        self._ctx: zmq.Context[Any] | None = None
        self._poller: zmq.Poller | None = None
        self._socks: dict[Any, Link] = {}
        self._monitors: dict[Any, tuple[Any, Link]] = {}  # monitor -> (its socket, link)

    def open(self) -> None:
        """Create the SUB sockets and connect them (a bad endpoint raises ``zmq.ZMQError``
        here, at start-up, not later in the thread)."""
        import zmq

        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        try:
            for link in self.links:
                self._open(link)
        except zmq.ZMQError:
            self.close()
            raise

    def _open(self, link: Link) -> None:
        """``link``'s SUB socket and its monitor, registered with the poller."""
        import zmq

        assert self._ctx is not None and self._poller is not None
        sock = self._ctx.socket(zmq.SUB)
        self._socks[sock] = link
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.message_limit_bytes)
        # ZMQ drops a peer whose frame is above the limit: seen here as a disconnect
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitors[monitor] = (sock, link)
        self._poller.register(monitor, zmq.POLLIN)
        # a named endpoint also takes vLLM's default topic, the empty one
        wanted = "" if link.spec.engine else self.settings.topic_prefix
        sock.setsockopt(zmq.SUBSCRIBE, wanted.encode())
        if link.spec.bind:
            sock.bind(link.endpoint)
        else:
            sock.connect(link.endpoint)
        self._poller.register(sock, zmq.POLLIN)

    def _close(self, monitor: Any) -> None:
        """Close a monitor and its SUB socket, unregistered from the poller."""
        sock, _ = self._monitors.pop(monitor)
        for s in (monitor, sock):
            if self._poller is not None:
                with contextlib.suppress(KeyError):
                    self._poller.unregister(s)
        sock.disable_monitor()
        monitor.close(0)
        del self._socks[sock]
        sock.close(0)

    def run(self, stop: threading.Event, handle: Callable[[Link, Sequence[bytes]], None]) -> None:
        """Hand every message to ``handle`` until ``stop`` is set; then close every socket."""

        if self._ctx is None:
            self.open()
        poller, socks = self._poller, self._socks
        assert poller is not None
        try:
            while not stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock in self._monitors:
                        self._disconnected(sock, handle)
                        continue
                    if sock in socks:  # (not replaced meanwhile: :meth:`_disconnected`)
                        _read_turn(sock, socks[sock], handle)
        finally:
            self.close()

    def dealer(self, link: Link) -> Any:
        """``link``'s replay socket (``zmq.DEALER``), connected on first use."""
        import zmq

        replay = link.spec.replay
        assert self._ctx is not None and replay is not None
        if link.dealer is None:
            link.dealer = self._ctx.socket(zmq.DEALER)
            link.dealer.setsockopt(zmq.LINGER, 0)
            link.dealer.setsockopt(zmq.MAXMSGSIZE, self.settings.message_limit_bytes)
            link.dealer.connect(replay)
        return link.dealer

    def drop_dealer(self, link: Link) -> None:
        """Close ``link``'s replay socket: a late reply cannot be taken for the next one."""
        if link.dealer is not None:
            link.dealer.close(0)
            link.dealer = None

    def _disconnected(self, monitor: Any, handle: Callable[[Link, Sequence[bytes]], None]) -> None:
        """A peer's connection closed: it went away, or ZMQ dropped it (a frame above the
        limit, another protocol error). ZMQ reconnects after the first, never after the others:
        a connected endpoint's socket is replaced by a new one, whatever the cause. (Not
        ``disconnect`` and ``connect`` on it: a message still queued from the old connection
        then fails libzmq's check that a message's frames come together, which aborts the
        process — ``Assertion failed: !_more (src/fq.cpp:80)``.) What the old one still
        queues is handed to ``handle`` first: a batch that arrived is never dropped."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        sock, link = self._monitors[monitor]
        seen = 0
        while monitor.poll(0):
            seen += recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        for _ in range(seen):
            self._counts["disconnects"] += 1
            n = self._counts["disconnects"]
            if n <= 10 or n & (n - 1) == 0:
                log.warning("kv events: a publisher on %s disconnected (#%d): it stopped, or "
                            "ZMQ dropped it for a frame above --kv-events-max-message-bytes %d",
                            link.endpoint, n, self.settings.message_limit_bytes)  # fmt: skip
        if seen and not link.spec.bind:
            _read_turn(sock, link, handle)  # (all it queues: at most the high-water mark)
            self._close(monitor)
            self._open(link)

    def close(self) -> None:
        for link in self.links:
            self.drop_dealer(link)
        for monitor in list(self._monitors):
            self._close(monitor)
        if self._ctx is not None:
            self._ctx.term()


def _read_turn(sock: Any, link: Link, handle: Callable[[Link, Sequence[bytes]], None]) -> None:
    """Hand ``handle`` what ``sock`` holds, at most :data:`TURN` messages (every socket gets
    its turn)."""
    import zmq

    for _ in range(TURN):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(link, frames)
